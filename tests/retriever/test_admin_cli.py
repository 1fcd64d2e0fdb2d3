"""`mpic-admin library ...` end to end on a filesystem store, and its error exits."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mpic.cli.admin import app
from tests.retriever.conftest import write_images


@pytest.fixture
def cli(tmp_path, tiny_llava_dir):
    runner = CliRunner()
    store = f"file://{tmp_path / 'store'}"

    def run(*args: str):
        extra = ["--model", str(tiny_llava_dir)] if args[:2] == ("library", "refresh") else []
        return runner.invoke(app, [*args, "--store", store, *extra])

    return run


def test_refresh_list_show_search_rollback(tmp_path, cli) -> None:
    images = write_images(tmp_path / "src", [0, 1, 2])
    (tmp_path / "caps.jsonl").write_text(json.dumps({"file": "img-001.png", "caption": "one"}))
    r1 = cli(
        "library",
        "refresh",
        str(tmp_path / "src"),
        "--collection",
        "refs",
        "--captions",
        str(tmp_path / "caps.jsonl"),
        "--no-progress",
    )
    assert r1.exit_code == 0, r1.output
    v1 = json.loads(r1.stdout)["version"]
    write_images(tmp_path / "src", [3])
    r2 = cli("library", "refresh", str(tmp_path / "src"), "--collection", "refs", "--no-progress")
    report = json.loads(r2.stdout)
    assert (report["computed"], report["reused"]) == (1, 3)

    listed = json.loads(cli("library", "list", "--json").stdout)
    assert listed == [{"collection": "refs", "current": report["version"], "items": 4}]
    shown = json.loads(
        cli("library", "show", "--collection", "refs", "--version", v1, "--json").stdout
    )
    assert shown["versions"] == [v1, report["version"]] and len(shown["items"]) == 3
    assert {i["extra"]["name"]: i["caption"] for i in shown["items"]}["img-001.png"] == "one"

    for name in images:
        out = cli(
            "library",
            "search",
            "--collection",
            "refs",
            "--image",
            str(tmp_path / "src" / name),
            "--top-k",
            "2",
            "--json",
        )
        assert out.exit_code == 0, out.output
        assert json.loads(out.stdout)["hits"][0]["name"] == name
    out = cli(
        "library", "search", "--collection", "refs", "--text", "a cat", "--top-k", "10", "--json"
    )
    assert len(json.loads(out.stdout)["hits"]) == 4

    assert cli("library", "rollback", v1, "--collection", "refs").exit_code == 0
    listed = json.loads(cli("library", "list", "--json").stdout)
    assert listed[0]["current"] == v1 and listed[0]["items"] == 3
    assert cli("library", "rollback", report["version"], "--collection", "refs").exit_code == 0
    pruned = cli("library", "prune", "--collection", "refs", "--keep", "1")
    assert pruned.exit_code == 0 and f"released 1 version(s) {v1}" in pruned.stdout
    gone = cli("library", "rollback", v1, "--collection", "refs")
    assert gone.exit_code == 2 and f"No version {v1!r}" in gone.stderr
    other = cli(
        "library",
        "refresh",
        str(tmp_path / "src"),
        "--collection",
        "refs",
        "--system-prompt",
        "Be brief.",
        "--no-progress",
    )
    assert json.loads(other.stdout)["computed"] == 4  # another canonical context: new entries


def test_bad_input_exits_non_zero_with_a_message(tmp_path, cli) -> None:
    missing = cli("library", "refresh", str(tmp_path / "nope"), "--collection", "refs")
    assert missing.exit_code == 2 and "source folder not found" in missing.stderr
    write_images(tmp_path / "src", [0])
    (tmp_path / "src" / "bad.jpg").write_bytes(b"definitely not a jpeg")
    bad = cli("library", "refresh", str(tmp_path / "src"), "--collection", "refs", "--no-progress")
    assert bad.exit_code == 2 and "bad.jpg" in bad.stderr and "not a decodable image" in bad.stderr
    assert json.loads(cli("library", "list", "--json").stdout) == []  # nothing was written
    unknown = cli("library", "search", "--collection", "ghost", "--text", "x")
    assert unknown.exit_code == 2 and "unknown collection 'ghost'" in unknown.stderr
    both = cli("library", "search", "--collection", "refs", "--text", "x", "--image", "a.png")
    assert both.exit_code == 2 and "exactly one" in both.stderr
    name = cli("library", "show", "--collection", "bad/name")
    assert name.exit_code == 2 and "collection name" in name.stderr
    rb = cli("library", "rollback", "v0", "--collection", "ghost")
    assert rb.exit_code == 2 and "unknown collection" in rb.stderr


def test_refresh_a_folder_of_images_and_passages_and_search_text(tmp_path, cli) -> None:
    from tests.retriever.conftest import PASSAGES, write_passages

    write_images(tmp_path / "src", [0, 1])
    write_passages(tmp_path / "src")
    out = cli("library", "refresh", str(tmp_path / "src"), "--collection", "mix", "--no-progress")
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert (report["items"], report["documents"], report["computed"]) == (5, 3, 5)
    shown = json.loads(cli("library", "show", "--collection", "mix", "--json").stdout)
    kinds = sorted((i["extra"]["name"], i["media_type"]) for i in shown["items"])
    assert kinds == sorted(
        [("img-000.png", "image"), ("img-001.png", "image")] + [(n, "document") for n in PASSAGES]
    )
    query = PASSAGES["breakfast.md"]
    found = cli("library", "search", "-c", "mix", "--text", query, "--top-k", "5", "--json")
    hits = json.loads(found.stdout)["hits"]
    assert (hits[0]["name"], hits[0]["media_type"]) == ("breakfast.md", "document")
    assert hits[0]["score"] == pytest.approx(1.0, abs=1e-4) and len(hits) == 5
    text = cli("library", "search", "-c", "mix", "--text", query, "--top-k", "5")
    lines = text.stdout.splitlines()[1:]
    assert text.exit_code == 0 and len(lines) == 5
    assert lines[0].split()[2:4] == ["document", "breakfast.md"]
    assert sum(line.split()[2] == "document" for line in lines) == 3

    (tmp_path / "src" / "bad.txt").write_bytes(b"\xff\xfe not utf-8")
    bad = cli("library", "refresh", str(tmp_path / "src"), "--collection", "mix", "--no-progress")
    assert bad.exit_code == 2 and "bad.txt is not UTF-8" in bad.stderr
    assert json.loads(cli("library", "show", "-c", "mix", "--json").stdout)["versions"] == [
        report["version"]
    ]
