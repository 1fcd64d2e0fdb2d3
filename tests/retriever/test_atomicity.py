"""Refresh atomicity: concurrent searches each see exactly one whole version; a refresh process
killed half-way (SIGKILL) leaves the old version current and nothing half-built visible."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from mpic.retriever.service import RetrievalService
from mpic.retriever.sources import open_source
from mpic.storage.factory import make_object_store
from tests.retriever.conftest import write_images


def test_searches_during_refresh_each_see_one_version(tmp_path, engine):
    url = f"file://{tmp_path / 'store'}"
    admin = RetrievalService(make_object_store(url))
    write_images(tmp_path / "a", [0, 1, 2])
    write_images(tmp_path / "b", [1, 2, 3, 4, 5])
    v1 = admin.refresh(
        "refs", open_source(str(tmp_path / "a")), engine, model_fingerprint=engine.fingerprint
    ).version
    reader = RetrievalService(make_object_store(url))  # another process's view (a Serve replica)
    items = {v1: {"img-000.png", "img-001.png", "img-002.png"}}
    seen: list[tuple[str, set[str]]] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def search_loop() -> None:
        while True:
            finished = done.is_set()
            try:
                result = reader.search("refs", text="anything", top_k=10)
                seen.append((result.version, {h.name for h in result.hits}))
            except BaseException as exc:  # noqa: BLE001 - any failure fails the test
                errors.append(exc)
            if finished:
                return

    threads = [threading.Thread(target=search_loop) for _ in range(3)]
    for t in threads:
        t.start()
    while len(seen) < 3 and not errors:  # every reader is running before the refresh starts
        time.sleep(0.01)
    v2 = admin.refresh(
        "refs", open_source(str(tmp_path / "b")), engine, model_fingerprint=engine.fingerprint
    ).version
    done.set()
    for t in threads:
        t.join(timeout=60)
    items[v2] = {f"img-00{i}.png" for i in range(1, 6)}
    assert errors == []
    assert {v for v, _ in seen} == {v1, v2}
    for version, names in seen:
        assert names == items[version]


KILLED_REFRESH = textwrap.dedent("""
    import os, signal, sys
    from mpic.engine.hf.entries import cache_image
    from mpic.engine.hf.adapters import make_adapter
    from mpic.engine.hf.loader import load_hf_model
    from mpic.retriever.service import RetrievalService
    from mpic.retriever.sources import open_source
    from mpic.storage.factory import make_object_store

    model_dir, store_url, folder = sys.argv[1:]
    model, processor, spec = load_hf_model(model_dir)
    adapter = make_adapter(model)
    calls = []

    def compute(media):
        calls.append(1)
        if len(calls) == 3:  # two new entries are already stored
            os.kill(os.getpid(), signal.SIGKILL)
        return cache_image(model, processor, adapter, spec, media)

    RetrievalService(make_object_store(store_url)).refresh(
        "refs", open_source(folder), compute, model_fingerprint=spec.fingerprint)
""")


@pytest.mark.slow  # a subprocess imports torch and loads the model (~10-20 s)
def test_killed_refresh_leaves_old_version(tmp_path, engine, tiny_llava_dir):
    url = f"file://{tmp_path / 'store'}"
    retriever = RetrievalService(make_object_store(url))
    write_images(tmp_path / "a", [0, 1])
    v1 = retriever.refresh(
        "refs", open_source(str(tmp_path / "a")), engine, model_fingerprint=engine.fingerprint
    ).version
    listed = sorted(retriever.objects.list("dynamic/"))
    entries_before = set(retriever.objects.list("entries/"))
    write_images(tmp_path / "b", [3, 4, 5, 6])
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_REFRESH, str(tiny_llava_dir), url, str(tmp_path / "b")],
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert len(set(retriever.objects.list("entries/")) - entries_before) == 2  # orphans only
    assert sorted(retriever.objects.list("dynamic/")) == listed  # no manifest, no CURRENT change
    assert retriever.versions("refs") == ([v1], v1)
    result = retriever.search("refs", text="x", top_k=10)
    assert result.version == v1 and {h.name for h in result.hits} == {"img-000.png", "img-001.png"}
