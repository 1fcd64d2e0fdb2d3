"""Hardening, round 2 (issue 23 item 1), in-process on the fake engine: the inputs that answered
500 or were accepted where a 400 is due now answer a 4xx (or 507 for a full store) with the
OpenAI-style JSON body, and the server keeps serving after each: resize bombs refused from the
image header, policy numbers of thousands of digits, admin sources holding NUL or a lone
surrogate, strict JSON types, keys compared exactly, validation errors naming the right field,
a full object store, and `mpic-admin sweep --server --grace-s 0`."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.deployments.conftest import ADMIN_KEY, KEYS, png
from tests.deployments.http.test_hardening import _app, _is_error, _png_header
from tests.deployments.inprocess import fake_config, in_process_app


def _chat(app, key: str = "alice-key", **body):
    payload = {"model": "mpic", "messages": [{"role": "user", "content": "hi"}], **body}
    return app.client.post("/v1/chat/completions", headers=app.headers(key), json=payload)


def _upload(app, data: bytes, key: str = "alice-key"):
    return app.client.post(
        "/v1/files",
        headers=app.headers(key),
        files={"file": ("x.png", data, "image/png")},
        data={"purpose": "vision"},
    )


def _healthy(app) -> None:
    assert app.client.get("/healthz").status_code == 200
    ok = _chat(app)
    assert ok.status_code == 200, ok.text


def test_resize_bombs_refused_from_the_header(fake_app, monkeypatch) -> None:
    """100,000 x 1 is under the pixel limit (16 M) but no processor may see it: 400 before any
    decode (the engine is never called)."""
    encoded = []
    engine = fake_app.ingress.encoder._obj.engine
    real = engine.encode_image
    monkeypatch.setattr(engine, "encode_image", lambda b: encoded.append(1) or real(b))
    for width, height in ((100_000, 1), (1, 100_000), (9000, 900), (4000, 100)):
        err = _is_error(_upload(fake_app, _png_header(width, height)), 400, "invalid_image_size")
        assert err["param"] == "file" and f"{width}x{height}" in err["message"]
        url = "data:image/png;base64," + base64.b64encode(_png_header(width, height)).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "x"}]
        r = _chat(fake_app, messages=[{"role": "user", "content": content}])
        _is_error(r, 400, "invalid_image_size")
    assert encoded == []
    assert _upload(fake_app, png(1)).status_code == 200  # 40 x 40: fine
    _healthy(fake_app)


@pytest.mark.parametrize(
    "policy",
    [
        "mpic-" + "9" * 4301,
        "mpic-" + "9" * 20_000,
        "cacheblend-" + "9" * 4400,
        "boundary-" + "1" * 5000,
        "vlcache-0." + "1" * 4400,
        "vlcache-0.5:0." + "3" * 4400,
        "mpic-" + "9" * 8,
    ],
)
def test_policy_numbers_with_thousands_of_digits_400(fake_app, policy: str) -> None:
    err = _is_error(_chat(fake_app, mpic={"policy": policy}), 400)
    assert err["param"] == "mpic.policy"
    assert len(err["message"]) < 300  # the number is not echoed back whole
    _healthy(fake_app)


def test_admin_source_with_nul_or_lone_surrogate_400(tmp_path: Path) -> None:
    allowed = tmp_path / "refs"
    allowed.mkdir()
    with _app(tmp_path, admin_sources=[str(allowed)]) as app:
        h = {**app.headers(ADMIN_KEY), "content-type": "application/json"}
        sources = [
            str(allowed) + "/a\x00b",
            "\x00",
            str(allowed) + "/\ud800",
            "\udfff",
            "s3://b/p\x00",
            str(allowed) + "/x\x7f",
            "a" * 5000,
        ]
        for source in sources:
            for field in ("source", "captions"):
                body = {"source": str(allowed), field: source}
                raw = json.dumps(body).encode()  # \u escapes: NUL and surrogates arrive as sent
                r = app.client.post("/v1/admin/collections/c/refresh", headers=h, content=raw)
                err = _is_error(r, 400)
                assert err["param"] == field
        _healthy(app)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": True}, "max_tokens"),
        ({"max_completion_tokens": False}, "max_completion_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"max_tokens": "4"}, "max_tokens"),
        ({"n": True}, "n"),
        ({"seed": True}, "seed"),
        ({"top_logprobs": True, "logprobs": True}, "top_logprobs"),
        ({"stream": "yes"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"logprobs": "true"}, "logprobs"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"mpic": {"policy": ""}}, "mpic.policy"),
        ({"mpic": {"policy": 4}}, "mpic.policy"),
        ({"mpic": {"budget": True}}, "mpic.budget"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {"include_usage": False}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, None),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ],
)
def test_strict_json_types_400(fake_app, body: dict, param: str | None) -> None:
    err = _is_error(_chat(fake_app, **body), 400)
    if param is not None:
        assert err["param"] == param, err
    else:
        assert err["param"] and err["param"].startswith("stream_options"), err


def test_strict_types_keep_what_openai_accepts(fake_app) -> None:
    """An int for a float (JSON has one number type) and null for optional fields stay valid."""
    for body in (
        {"temperature": 1, "top_p": 1},
        {"max_tokens": 3, "stream_options": None},
        {"stream": True, "stream_options": {"include_usage": True}},
        {"mpic": {"policy": "mpic-4", "budget": 1}},
        {"logit_bias": {"5": 1}},
    ):
        r = _chat(fake_app, **body)
        assert r.status_code == 200, (body, r.text)


def test_file_expiry_update_strict_types(fake_app) -> None:
    r = _upload(fake_app, png(2))
    assert r.status_code == 200
    fid = r.json()["id"]
    h = fake_app.headers("alice-key")
    for body, param in (
        ({"ttl_seconds": True}, "ttl_seconds"),
        ({"ttl_seconds": "60"}, "ttl_seconds"),
        ({"ttl_seconds": 60.5}, "ttl_seconds"),
        ({"expires_after": {"anchor": "created_at", "seconds": True}}, "expires_after.seconds"),
    ):
        err = _is_error(fake_app.client.post(f"/v1/files/{fid}", headers=h, json=body), 400)
        assert err["param"] == param, err
    after = fake_app.client.get(f"/v1/files/{fid}", headers=h).json()
    assert after["expires_at"] - after["created_at"] > 3600  # not moved to 1 s
    ok = fake_app.client.post(f"/v1/files/{fid}", headers=h, json={"ttl_seconds": 120})
    assert ok.status_code == 200


@pytest.mark.parametrize("suffix", ["\xa0", "\x85", "\u2028", "\x00", "x", " x", "\t\xa0"])
def test_keys_compared_exactly(fake_app, suffix: str) -> None:
    """A key followed by NBSP or NEL (str.strip() would drop them) does not authenticate; the
    header is sent as raw latin-1 bytes, as a hostile client sends them."""
    from mpic.deployments.config import AuthConfig
    from mpic.deployments.http.auth import KeyRing
    from mpic.errors import AuthenticationError

    ring = KeyRing.from_config(AuthConfig(), env={"MPIC_API_KEYS": json.dumps(KEYS)})
    with pytest.raises(AuthenticationError):
        ring.authenticate("Bearer alice-key" + suffix)
    assert ring.authenticate("Bearer alice-key").user == "alice"
    assert ring.authenticate("Bearer  alice-key \t").user == "alice"  # HTTP whitespace only
    if suffix == "\u2028":
        return  # not encodable in a header
    raw = ("Bearer alice-key" + suffix).encode("latin-1")
    for path, method in (("/v1/models", "GET"), ("/v1/files", "GET")):
        r = fake_app.client.request(method, path, headers=[(b"authorization", raw)])
        _is_error(r, 401, "invalid_api_key")
    body = json.dumps({"model": "mpic", "messages": [{"role": "user", "content": "hi"}]})
    r = fake_app.client.post(
        "/v1/chat/completions",
        headers=[(b"authorization", raw), (b"content-type", b"application/json")],
        content=body,
    )
    _is_error(r, 401)


def test_validation_errors_name_the_right_param(fake_app) -> None:
    def message(content) -> dict:
        return _is_error(_chat(fake_app, messages=[{"role": "user", "content": content}]), 400)

    assert message([{"type": "file", "file": {}}])["param"] == "messages.0.content.0.file.file_id"
    err = message([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}])
    assert err["param"] == "messages.0.content.1.image_url.url"
    assert message([{"type": "text"}])["param"] == "messages.0.content.0.text"
    err = message([{"type": "file", "file": {"file_id": "file-x", "extra": 1}}])
    assert err["param"] == "messages.0.content.0.file.extra"
    assert message([{"type": "audio"}])["param"] == "messages.0.content.0"
    err = _is_error(_chat(fake_app, messages=[{"role": "robot", "content": "x"}]), 400)
    assert err["param"] == "messages.0.role"
    # malformed JSON: a clear message and no position posing as a field
    h = {**fake_app.headers("alice-key"), "content-type": "application/json"}
    for raw in (b'{"model": "mpic", "messages": [', b"{,}", b"\xff\xfe", b'{"a": 1} x'):
        r = fake_app.client.post("/v1/chat/completions", headers=h, content=raw)
        err = _is_error(r, 400, "invalid_json")
        assert err["param"] is None and "not valid JSON" in err["message"], err
    _healthy(fake_app)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


@needs_root
def test_full_object_store_507_nothing_half_written(tmp_path: Path) -> None:
    """The object store on a 1 MiB tmpfs: uploads until it is full answer 507 with Retry-After
    (never 500), leave no temp file, no record and no half object; files uploaded before still
    list and chat; after space returns an upload succeeds."""
    mount = tmp_path / "small"
    mount.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
            check=True,
            capture_output=True,
        )
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    try:
        cfg = fake_config(mount / "store")
        with in_process_app(cfg, KEYS, [ADMIN_KEY]) as app:
            statuses, first_ok = [], None
            for i in range(200):
                r = _upload(app, png(100 + i, side=96))
                statuses.append(r.status_code)
                if r.status_code == 200:
                    first_ok = first_ok or r.json()["id"]
                    continue
                err = _is_error(r, 507, "insufficient_storage")
                assert r.headers["retry-after"] == "60"
                assert str(mount) not in err["message"]
                if statuses.count(507) >= 5:
                    break
            assert 500 not in statuses and statuses.count(507) >= 5, statuses
            print(f"full store: {statuses.count(200)} x 200 then {statuses.count(507)} x 507")
            assert first_ok is not None
            store = mount / "store"
            assert not any((store / ".tmp").iterdir())  # no temp file left
            listed = app.client.get("/v1/files", headers=app.headers("alice-key")).json()
            assert len(listed["data"]) == statuses.count(200)  # only complete files are visible
            content = [{"type": "file", "file": {"file_id": first_ok}}]
            ok = _chat(app, messages=[{"role": "user", "content": content}])
            assert ok.status_code == 200, ok.text
            # room again: the sweeper drops the unreferenced blobs of the failed uploads
            for f in listed["data"]:
                app.client.delete(f"/v1/files/{f['id']}", headers=app.headers("alice-key"))
            sweep = app.client.post(
                "/v1/admin/sweep", headers=app.headers(ADMIN_KEY), json={"grace_s": 0}
            )
            assert sweep.status_code == 200 and sweep.json()["blobs_deleted"]
            assert _upload(app, png(7, side=96)).status_code == 200
    finally:
        subprocess.run(["umount", str(mount)], check=False, capture_output=True)


def test_s3_full_is_507(s3_server) -> None:
    """S3 quota / storage-full replies (MinIO's XMinioStorageFull, Ceph's QuotaExceeded) are
    StoreFullError (507), not StoreUnavailableError (503) or a 500."""
    from minio.error import S3Error

    from mpic.storage.object_store import StoreFullError
    from mpic.storage.s3_store import S3ObjectStore

    store = S3ObjectStore(s3_server.config())
    store.put("a/b", b"x")
    for code in ("XMinioStorageFull", "QuotaExceeded"):

        def full(*_a, code=code, **_k):
            raise S3Error(None, code, "full", "r", "id", "host")

        real, store.client.put_object = store.client.put_object, full
        try:
            with pytest.raises(StoreFullError) as info:
                store.put("a/c", b"y")
        finally:
            store.client.put_object = real
        assert info.value.status == 507 and code in info.value.detail
    assert store.get("a/b") == b"x" and not store.exists("a/c")


def test_admin_sweep_grace_zero_over_http(fake_app, tmp_path: Path) -> None:
    """`mpic-admin sweep --server URL --grace-s 0` sends 0 and the server honours it: an
    unreferenced blob written a moment ago is deleted (the server's grace is 600 s)."""
    from typer.testing import CliRunner

    import mpic.retriever.admin_client as admin_client
    from mpic.cli.admin import app as admin_app

    objects = fake_app.worker.library.objects
    key = f"media/{uuid.uuid4().hex}"
    objects.put(key, b"orphan")
    from mpic.storage import refs

    refs.add_ref(objects, key, "static.nobody.file-gone")  # a marker whose record never came

    class _Http:  # the admin client's httpx.Client, routed to the in-process app
        def __init__(self, *a, **k) -> None:
            self.base_url = "http://testserver"

        def request(self, method, path, json=None):
            return fake_app.client.request(
                method, path, json=json, headers=fake_app.headers(ADMIN_KEY)
            )

    saved = admin_client.httpx.Client
    admin_client.httpx.Client = _Http
    try:
        runner = CliRunner()
        kept = runner.invoke(admin_app, ["sweep", "--server", "http://x", "--api-key", "k"])
        assert kept.exit_code == 0, kept.output
        assert objects.exists(key)  # default grace (600 s): young blobs stay
        gone = runner.invoke(
            admin_app, ["sweep", "--server", "http://x", "--api-key", "k", "--grace-s", "0"]
        )
        assert gone.exit_code == 0, gone.output
    finally:
        admin_client.httpx.Client = saved
    assert key in json.loads(gone.output)["blobs_deleted"]
    assert not objects.exists(key)
    err = _is_error(
        fake_app.client.post(
            "/v1/admin/sweep", headers=fake_app.headers(ADMIN_KEY), json={"grace_s": True}
        ),
        400,
    )
    assert err["param"] == "grace_s"
    _is_error(
        fake_app.client.post("/v1/admin/sweep", headers=fake_app.headers("alice-key"), json={}),
        403,
    )
