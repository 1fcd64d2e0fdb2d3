"""Concurrent uploads and deletes of the SAME content by two users (issue 16), in-process on the
fake engine with the real file catalog and store: both users' lists stay consistent with what
each did, every listed file is linkable in a chat, and a sweep afterwards keeps the shared entry
while any user still holds it."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from tests.deployments.conftest import ADMIN_KEY, png


def test_two_users_upload_and_delete_same_content(fake_app) -> None:
    c = fake_app.client
    data = png(42)
    kept: dict[str, set[str]] = {"alice-key": set(), "bob-key": set()}
    lock = threading.Lock()

    def worker(key: str, rounds: int) -> None:
        h = fake_app.headers(key)
        for i in range(rounds):
            r = c.post(
                "/v1/files",
                headers=h,
                files={"file": ("same.png", data, "image/png")},
                data={"purpose": "vision"},
            )
            assert r.status_code == 200, r.text
            fid = r.json()["id"]
            if i % 3 != 2:  # delete two of every three right away
                d = c.delete(f"/v1/files/{fid}", headers=h)
                assert d.status_code == 200, d.text
            else:
                with lock:
                    kept[key].add(fid)

    with ThreadPoolExecutor(4) as pool:
        for f in [pool.submit(worker, k, 12) for k in ("alice-key", "bob-key") for _ in range(2)]:
            f.result()
    assert c.post("/v1/admin/sweep", headers=fake_app.headers(ADMIN_KEY)).status_code == 200
    for key, mine in kept.items():
        h = fake_app.headers(key)
        listed = {f["id"] for f in c.get("/v1/files", headers=h).json()["data"]}
        assert listed == mine  # exactly what this user kept, nothing of the other user
        for fid in listed:
            content = [{"type": "file", "file": {"file_id": fid}}, {"type": "text", "text": "ok"}]
            r = c.post(
                "/v1/chat/completions",
                headers=h,
                json={"model": "mpic", "messages": [{"role": "user", "content": content}]},
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert c.get(f"/v1/files/{fid}/content", headers=h).content == data
    other = next(iter(kept["bob-key"]))
    assert c.get(f"/v1/files/{other}", headers=fake_app.headers("alice-key")).status_code == 404
