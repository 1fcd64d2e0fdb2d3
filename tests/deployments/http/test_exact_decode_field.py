"""The `mpic.exact_decode` request field over HTTP (fake engine, in-process): honoured (reported
back, the server's `default_exact_decode` when absent), a non-boolean is a 400 naming it."""

from __future__ import annotations

from tests.deployments.conftest import ADMIN_KEY, KEYS
from tests.deployments.inprocess import fake_config, in_process_app

ALICE = {"Authorization": "Bearer alice-key"}
BODY = {"model": "mpic", "max_tokens": 6, "messages": [{"role": "user", "content": "red cat"}]}


def _chat(app, **mpic):
    return app.client.post(
        "/v1/chat/completions", json={**BODY, "mpic": mpic} if mpic else BODY, headers=ALICE
    )


def test_exact_decode_is_honoured_and_reported(fake_app) -> None:
    plain, exact = _chat(fake_app), _chat(fake_app, exact_decode=True)
    assert plain.status_code == exact.status_code == 200, exact.text
    assert plain.json()["mpic"]["exact_decode"] is False
    assert exact.json()["mpic"]["exact_decode"] is True
    # the echo engine answers the same whichever KV it decodes over
    assert exact.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


def test_exact_decode_must_be_a_boolean(fake_app) -> None:
    for bad in ("yes", 1, None):
        r = _chat(fake_app, exact_decode=bad)
        if bad is None:  # JSON null: the server's default
            assert r.status_code == 200 and r.json()["mpic"]["exact_decode"] is False
            continue
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "mpic.exact_decode", r.text


def test_the_servers_default_applies_when_absent(tmp_path) -> None:
    cfg = fake_config(tmp_path / "store").model_copy(update={"default_exact_decode": True})
    with in_process_app(cfg, KEYS, [ADMIN_KEY]) as app:
        assert _chat(app).json()["mpic"]["exact_decode"] is True
        assert _chat(app, exact_decode=False).json()["mpic"]["exact_decode"] is False
