"""`mpic bench online --closed-loop` without a vLLM engine: a stub engine of known latency (a
first token after `ttft_s`, then one every `itl_s`; `serial`: one request at a time, as a
saturated engine) gives the throughput, TTFT and ITL the closed loop must measure; capacity,
clients under the TTFT bound and the ratio to prefix caching computed as the docs say; the CLI
writes its JSON and PNG and re-reads them."""

from __future__ import annotations

import asyncio
import json
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from mpic.benchmarks.online import closed as online_closed
from mpic.benchmarks.online import workload as online_workload
from mpic.benchmarks.online.closed_results import ClosedCurve, Level, level_of, summary


class StubEngine:
    """Streams `max_tokens` tokens, the first `ttft_s[system]` after submission (or after the
    request before it, when `serial`), then one every `itl_s`."""

    fallbacks = 0

    def __init__(self, ttft_s: dict[str, float], itl_s: float, serial: bool = False) -> None:
        self.ttft_s, self.itl_s, self.serial = ttft_s, itl_s, serial
        self.llm = SimpleNamespace(reset_prefix_cache=self._reset)
        self.resets = 0
        self._lock, self._loop = None, None

    async def _reset(self) -> None:
        self.resets += 1

    def _call(self, coro):  # vLLM's loop runs in a thread of its own: so does this one
        return asyncio.run(coro)

    async def stream(self, req, max_tokens, sampling):
        assert sampling == {"ignore_eos": True}
        if self._loop is not asyncio.get_running_loop():  # one asyncio.run per level
            self._lock, self._loop = asyncio.Lock(), asyncio.get_running_loop()
        system, _ = req
        async with self._lock if self.serial else _nothing():
            await asyncio.sleep(self.ttft_s[system])
            yield SimpleNamespace(token_ids=[7])
            for n in range(2, max_tokens + 1):
                await asyncio.sleep(self.itl_s)
                yield SimpleNamespace(token_ids=[7] * n)


class _nothing:
    async def __aenter__(self) -> None:
        pass

    async def __aexit__(self, *exc) -> None:
        pass


class StubWork:
    """`Workload` without vLLM: a request is (system, chat); every request is recorded."""

    def __init__(self, engine: StubEngine) -> None:
        self.engine = engine
        self.sent: list[tuple[str, object]] = []

    def request(self, chat, system: str, max_tokens: int):
        self.sent.append((system, chat))
        return system, chat


def _chats():
    return online_workload.chat_stream(users=2, per_user=4, items=3, seed=1)


def test_parallel_engine_throughput_ttft_and_itl_come_out_as_its_latency() -> None:
    """No queueing (every chat 40 ms to its first token, 3 more 10 ms apart: 70 ms): N clients
    answer N / 70 ms chats per second at TTFT 40 ms and ITL 10 ms."""
    engine = StubEngine({"x": 0.040}, itl_s=0.010)
    work = StubWork(engine)
    for n in (1, 4):
        lv = online_closed.run_level(work, "x", _chats(), n, duration_s=0.5, max_tokens=4)
        # lower bounds exact (a sleep is never shorter), upper ones with room for a busy host
        assert lv.clients == n and 4 * n <= lv.chats <= 8 * n  # 0.5 s / 70 ms: 8 per client
        assert 40 <= lv.ttft_p50_ms < 60 and 40 <= lv.ttft_p99_ms < 120
        assert 10 <= lv.itl_p50_ms < 20 and 10 <= lv.itl_mean_ms < 25
        assert 70 <= lv.latency_p50_ms < 110
        assert n / 0.070 * 0.6 < lv.chats_per_s <= n / 0.070 * 1.01
        assert lv.output_tokens_per_s == pytest.approx(4 * lv.chats_per_s)
        assert lv.chats_per_s == pytest.approx(lv.chats / lv.span_s)
        assert len(lv.ttfts_ms) == lv.chats
    assert engine.resets == 2  # vLLM's prefix cache reset before each level


def test_saturated_engine_throughput_stays_and_ttft_grows_with_clients() -> None:
    """One chat at a time (20 ms to the first token + 3 x 10 ms: 50 ms each): 20 chats per
    second whatever the clients; with N clients a chat waits for the N - 1 before it."""
    work = StubWork(StubEngine({"x": 0.020}, itl_s=0.010, serial=True))
    one = online_closed.run_level(work, "x", _chats(), 1, duration_s=0.5, max_tokens=4)
    four = online_closed.run_level(work, "x", _chats(), 4, duration_s=0.5, max_tokens=4)
    for lv in (one, four):
        assert 20 * 0.6 < lv.chats_per_s <= 20 * 1.01
    assert 20 <= one.ttft_p50_ms < 40
    assert 3 * 50 + 20 <= four.ttft_p50_ms < 1.4 * (3 * 50 + 20)  # waits for three chats
    assert 10 <= four.itl_p50_ms < 20


def test_level_of_known_times() -> None:
    """Two chats with given arrival times: the numbers by hand."""
    done = [
        (0.001, 0.0, [0.1, 0.2, 0.3]),  # TTFT 100 ms, gaps 100, 100
        (0.003, 0.1, [0.3, 0.35, 0.35, 0.5]),  # TTFT 200 ms, two tokens together: gaps 50, 150
    ]
    lv = level_of(2, 0.0, done, fallbacks=1)
    assert (lv.chats, lv.span_s, lv.chats_per_s) == (2, 0.5, 4.0)
    assert lv.output_tokens_per_s == pytest.approx(14.0)
    assert [lv.ttft_p50_ms, lv.ttft_p95_ms, lv.ttft_p99_ms] == pytest.approx([150, 195, 199])
    assert [lv.itl_p50_ms, lv.itl_p95_ms] == pytest.approx([100, 142.5])
    assert lv.itl_mean_ms == pytest.approx(100)
    assert lv.latency_p50_ms == pytest.approx(350) and lv.prepare_p50_ms == pytest.approx(2)
    assert lv.ttfts_ms == [100.0, 200.0] and lv.fallbacks == 1
    one_token = level_of(1, 0.0, [(0.0, 0.0, [0.2])])
    assert one_token.itl_p50_ms is None and one_token.itl_mean_ms is None


def _level(clients: int, per_s: float, p95_ms: float, p99_ms: float) -> Level:
    return Level(clients, 10, 1.0, per_s, 4 * per_s, p95_ms / 2, p95_ms, p99_ms,
                 10, 12, 14, 11, 100, 1)  # fmt: skip


def test_capacity_clients_under_bound_and_ratio() -> None:
    prefix = ClosedCurve("prefix", [_level(1, 2.0, 400, 450), _level(2, 2.5, 900, 1200),
                                    _level(4, 2.4, 1900, 2000)])  # fmt: skip
    auto = ClosedCurve("auto", [_level(1, 4.0, 200, 220), _level(2, 6.0, 400, 500),
                                _level(4, 7.5, 800, 1100), _level(8, 7.0, 1600, 1700)])  # fmt: skip
    spiky = ClosedCurve("mpic-32", [_level(1, 1.0, 1500, 1600), _level(2, 1.0, 900, 950)])
    assert prefix.capacity().clients == 2 and auto.capacity().chats_per_s == 7.5
    assert prefix.clients_under(1.0) == 2 and prefix.clients_under(1.0, "p99") == 1
    assert auto.clients_under(1.0) == 4 and auto.clients_under(1.0, "p99") == 2
    assert spiky.clients_under(1.0) == 2  # the most clients under it, not the first failure
    assert ClosedCurve("full").capacity() is None
    s = summary([prefix, auto, spiky], 1.0)
    assert s["capacity_chats_per_s"] == {"prefix": 2.5, "auto": 7.5, "mpic-32": 1.0}
    assert s["capacity_clients"] == {"prefix": 2, "auto": 4, "mpic-32": 1}
    assert s["capacity_output_tokens_per_s"]["auto"] == 30.0
    assert s["capacity_ratio_vs_prefix"] == {"auto": 3.0, "mpic-32": 0.4}
    assert s["clients_under_bound_p95"] == {"prefix": 2, "auto": 4, "mpic-32": 2}
    assert summary([prefix, auto], 0.5)["clients_under_bound_p95"] == {"prefix": 1, "auto": 2}
    assert "capacity_ratio_vs_prefix" not in summary([auto], 1.0)


def test_cli_closed_loop_writes_json_and_png_and_rereads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command end to end on a saturated stub engine: prefix caching's chats take 90 ms
    (60 + 3 x 10), the linked systems' 50 ms; every system gets the same chats in order."""
    from mpic.cli import app

    engine = StubEngine({"prefix": 0.060, "auto": 0.020, "mpic-32": 0.020}, 0.010, serial=True)
    work = StubWork(engine)
    sessions = []

    @contextmanager
    def session(name, model, kind, users, per_user, seed):
        sessions.append((name, model, kind, users, per_user, seed))
        yield work

    monkeypatch.setattr(online_workload, "model_setup", lambda m: ("stub-model", "image", 3, 4))
    monkeypatch.setattr(online_workload, "engine_session", session)
    out = tmp_path / "run"
    args = ["bench", "online", "--closed-loop", "--models", "llava", "--systems",
            "default,mpic-32,prefix", "--clients", "2,1", "--duration-s", "0.4",
            "--ttft-bound-s", "0.15", "--users", "2", "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert sessions == [("llava", "stub-model", "image", 2, 4, 0)]
    assert "capacity(system) / capacity(prefix)" in result.output
    assert "x1  clients" in result.output and "x2  clients" in result.output  # progress lines

    doc = json.loads((out / "online_closed.json").read_text())
    assert doc["meta"]["mode"] == "closed-loop" and doc["meta"]["ttft_bound_s"] == 0.15
    assert doc["meta"]["clients"] == [1, 2] and doc["meta"]["duration_s"] == 0.4
    curves = doc["models"]["llava"]["curves"]
    assert [c["system"] for c in curves] == ["auto", "mpic-32", "prefix"]
    assert all([lv["clients"] for lv in c["levels"]] == [1, 2] for c in curves)
    s = doc["models"]["llava"]["summary"]
    assert 1.5 < s["capacity_ratio_vs_prefix"]["auto"] < 2.1  # 90 ms vs 50 ms per chat
    # one client: TTFT 60 ms (prefix), 20 ms; two: the other's chat first, 150 and 70 ms
    assert s["clients_under_bound_p95"] == {"auto": 2, "mpic-32": 2, "prefix": 1}
    assert (out / "online_closed.png").stat().st_size > 1000

    # the same chats, in the same order, for every system: warm-up, then each level (levels
    # outer, systems inner: each system's requests of a level come in one run)
    runs: list[tuple[str, list]] = []
    for system, chat in work.sent:
        if runs and runs[-1][0] == system:
            runs[-1][1].append(chat)
        else:
            runs.append((system, [chat]))
    assert [r[0] for r in runs] == ["auto", "mpic-32", "prefix"] * 3
    for group, warm in ((runs[0:3], 0), (runs[3:6], 1), (runs[6:9], 2)):  # untimed round first
        n = min(len(chats) for _, chats in group)
        assert group[0][1][:n] == group[1][1][:n] == group[2][1][:n]
        assert all(len(chats) > warm for _, chats in group)
    assert runs[3][1][1] != runs[6][1][2]  # one seed per level
    assert all(len(lv["warmup_ttfts_ms"]) == lv["clients"] for c in curves for lv in c["levels"])

    again = tmp_path / "again"
    result = CliRunner().invoke(app, ["bench", "online", "--closed-loop", "--from-json",
                                      str(out / "online_closed.json"), "--ttft-bound-s", "0.1",
                                      "--out", str(again)])  # fmt: skip
    assert result.exit_code == 0, result.output
    re_doc = json.loads((again / "online_closed.json").read_text())
    assert re_doc["models"]["llava"]["curves"] == curves
    assert re_doc["models"]["llava"]["summary"]["clients_under_bound_p95"]["prefix"] == 1
    assert re_doc["models"]["llava"]["summary"]["clients_under_bound_p95"]["auto"] == 2
    assert (again / "online_closed.png").is_file()


def test_models_take_a_model_folder(tmp_path: Path) -> None:
    """`--models` takes a model folder beside the two names: a config with a vision tower is
    served 3 images per chat (as `llava`), one without 4 documents (as `smollm2`); anything
    else is a usage error naming what it expected."""
    import typer

    vision, text = tmp_path / "vl", tmp_path / "lm"
    for folder, config in ((vision, {"vision_config": {}}), (text, {"hidden_size": 8})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    assert online_workload.model_setup(str(vision)) == (str(vision), "image", 3, 4)
    assert online_workload.model_setup(str(text)) == (str(text), "text", 4, 5)
    with pytest.raises(typer.BadParameter, match="model folder"):
        online_workload.model_setup(str(tmp_path / "missing"))


def test_cli_dtype_reaches_the_engine_and_the_json_and_a_bad_one_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--dtype bfloat16` is the engine's dtype for every system (a `VllmOptions` override on the
    one engine session) and the JSON's `meta.dtype`; the default float32 overrides nothing; a
    dtype the engine does not take is a usage error before any engine starts."""
    from mpic.cli import app

    work = StubWork(StubEngine({"prefix": 0.01, "mpic-32": 0.01}, 0.001))
    options: list[dict] = []

    @contextmanager
    def session(name, model, kind, users, per_user, seed, **opts):
        options.append(opts)
        yield work

    monkeypatch.setattr(online_workload, "model_setup", lambda m: ("stub-model", "image", 3, 4))
    monkeypatch.setattr(online_workload, "engine_session", session)
    base = ["bench", "online", "--closed-loop", "--models", "llava", "--systems",
            "mpic-32,prefix", "--clients", "1", "--duration-s", "0.1"]  # fmt: skip
    for dtype, meant in (("bfloat16", "bfloat16"), ("float32", "float32"), ("half", "float16")):
        out = tmp_path / dtype  # vLLM's names, as `mpic serve --dtype`
        result = CliRunner().invoke(app, [*base, "--dtype", dtype, "--out", str(out)])
        assert result.exit_code == 0, result.output
        assert options[-1] == ({} if meant == "float32" else {"dtype": meant})
        assert json.loads((out / "online_closed.json").read_text())["meta"]["dtype"] == meant

    result = CliRunner().invoke(app, [*base, "--dtype", "int8", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "int8" in result.output
    assert len(options) == 3 and not (tmp_path / "x").exists()
