"""Cached tiers serve through an object-store outage (issue 23 item 4), in-process on the fake
engine over a real S3 server (moto's, stopped for the outage; tests/fixtures/s3.py): chats
linking files whose entries sit in the LLM worker's memory or disk tier answer 200 without an S3
call; list and retrieve answer from the records the replica last read; only what must reach the
store (media bytes, uploads, expiry changes, a file the replica never saw) answers 503 with
Retry-After; everything works again once the store is back."""

from __future__ import annotations

import time
from pathlib import Path

from tests.deployments.conftest import ADMIN_KEY, KEYS, png
from tests.deployments.http.test_hardening import _is_error
from tests.deployments.inprocess import in_process_app


def _config(s3_server, disk: Path):
    from mpic.deployments.config import ServeAppConfig

    s3 = s3_server.config().model_dump() | {"secret_key": "testing", "timeout_s": 1.0}
    return ServeAppConfig.model_validate(
        {
            "engine": {"kind": "fake", "model": "fake-model", "max_tokens_default": 4},
            "store": {
                "s3": s3,
                "memory_bytes": 16 << 20,
                "disk_cache_dir": str(disk),
                "disk_bytes": 64 << 20,
            },
            "auth": {"mode": "production"},
            "limits": {"max_upload_bytes": 256 * 1024},
        }
    )


def test_cached_tiers_serve_through_an_s3_outage(s3_server, tmp_path: Path, capsys) -> None:
    with in_process_app(_config(s3_server, tmp_path / "disk"), KEYS, [ADMIN_KEY]) as app:
        c, h = app.client, app.headers("alice-key")

        def upload(seed: int) -> dict:
            r = c.post(
                "/v1/files",
                headers=h,
                files={"file": (f"{seed}.png", png(seed), "image/png")},
                data={"purpose": "vision"},
            )
            assert r.status_code == 200, r.text
            return r.json()

        def chat(file_id: str):
            content = [
                {"type": "file", "file": {"file_id": file_id}},
                {"type": "text", "text": "x"},
            ]
            body = {"model": "mpic", "messages": [{"role": "user", "content": content}]}
            return c.post("/v1/chat/completions", headers=h, json=body)

        mem, disk, unseen = upload(1), upload(2), upload(3)
        for f in (mem, disk):
            assert chat(f["id"]).status_code == 200  # the resolver reads (and keeps) the record
        worker = app.worker.entries
        disk_key = app.ingress.resolver._obj.files.resolve(*("alice", disk["id"]))[0]
        worker.memory.discard(disk_key)  # this one only on the node's disk tier now
        assert disk_key in worker.disk and disk_key not in worker.memory
        listed = c.get("/v1/files", headers=h).json()["data"]
        assert len(listed) == 3

        s3_calls = []
        s3 = worker.objects
        for name in ("get", "put", "exists", "stat", "list", "open_read", "get_range"):
            real = getattr(s3, name)
            setattr(s3, name, lambda *a, _n=name, _r=real, **k: s3_calls.append(_n) or _r(*a, **k))

        with s3_server.down():
            t0 = time.perf_counter()
            r = chat(mem["id"])
            assert r.status_code == 200, r.text
            assert r.json()["mpic"]["tier_hits"] == {"memory": 1}
            r = chat(disk["id"])
            assert r.status_code == 200, r.text
            assert r.json()["mpic"]["tier_hits"] == {"disk": 1}
            outage_chat_s = time.perf_counter() - t0
            assert s3_calls == []  # the worker never reached for the store
            # list and retrieve from the records this replica last read
            r = c.get("/v1/files", headers=h)
            assert r.status_code == 200 and [f["id"] for f in r.json()["data"]] == [
                f["id"] for f in listed
            ]
            r = c.get(f"/v1/files/{mem['id']}", headers=h)
            assert r.status_code == 200 and r.json()["status"] == "processed"
            # other users still see nothing of alice's
            _is_error(c.get(f"/v1/files/{mem['id']}", headers=app.headers("bob-key")), 503)
            # what must reach the store: 503 + Retry-After, JSON
            for r in (
                c.get(f"/v1/files/{mem['id']}/content", headers=h),
                chat(unseen["id"]),  # never resolved by this resolver: its record is in S3
                c.post(
                    "/v1/files",
                    headers=h,
                    files={"file": ("n.png", png(9), "image/png")},
                    data={"purpose": "vision"},
                ),
                c.post(f"/v1/files/{mem['id']}", headers=h, json={"ttl_seconds": 60}),
            ):
                err = _is_error(r, 503, "store_unavailable")
                assert r.headers["retry-after"] == "5" and "127.0.0.1" not in err["message"]
            assert c.get("/healthz").status_code == 200

        t1 = time.perf_counter()
        while (r := chat(unseen["id"])).status_code != 200:
            assert time.perf_counter() - t1 < 30, r.text
            time.sleep(0.05)
        recovered_s = time.perf_counter() - t1
        assert c.get(f"/v1/files/{mem['id']}/content", headers=h).content == png(1)
        with capsys.disabled():
            print(
                f"\nS3 down: memory- and disk-tier chats 200 in {outage_chat_s:.2f} s "
                f"(0 S3 calls); unseen file 200 again {recovered_s:.2f} s after the store came back"
            )
