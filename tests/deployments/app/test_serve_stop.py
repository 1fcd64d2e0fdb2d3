"""`mpic serve` started and stopped as an operator's script does (a subprocess in a session of
its own, like `setsid mpic serve ... &`; fake engine): SIGINT stops it although it was started
with SIGINT ignored and blocked, SIGTERM although started with SIGTERM ignored, and a start after
a SIGKILL ends what the killed run left; after each, no process of the run (counted by its
session) is left 10 s after the signal or the restart. While the first one runs: Ray's ports
listen on the loopback (but Serve's inter-deployment gRPC server, `[::]` in Ray's code), and 150
bad inputs raised in the replicas answer JSON 4xx with no ERROR line or traceback in the console
log nor in Ray's Serve logs, each logged as one line with its request id."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.deployments.conftest import free_port, serve_config_file
from tests.deployments.test_client_errors import MAX_UPLOAD, bad_requests, check_answer

pytestmark = pytest.mark.slow

STOP_S = 10
"""No process of a run may be left this long after its stop signal (or the restart)."""
N_BAD = 150


def _config(tmp_path: Path) -> Path:
    args = {
        "engine": {"kind": "fake", "model": "fake"},
        "store": {"url": (tmp_path / "store").as_uri(), "fsync": False},
        "auth": {"mode": "dev"},
        "limits": {"max_upload_bytes": MAX_UPLOAD},
        "sweep_interval_s": 0,
        "llm_router": "power-of-two",
    }
    return serve_config_file(tmp_path, args)


class Run:
    """One `mpic serve` in a session of its own (session id = its pid), logging to a file."""

    def __init__(self, tmp_path: Path, port: int, name: str, preexec=None) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("MPIC_API_KEYS", "MPIC_ADMIN_KEYS")}
        env |= {"OMP_NUM_THREADS": "1", "MPIC_HOME": str(tmp_path / "home")}
        self.log = tmp_path / f"{name}.log"
        self.url = f"http://127.0.0.1:{port}"
        cmd = [str(Path(sys.executable).parent / "mpic"), "serve", "--config"]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [*cmd, str(_config(tmp_path)), "--port", str(port)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=preexec,
            )
        self.sid = self.proc.pid

    def wait_ready(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(self.log.read_text()[-3000:])

    def processes(self) -> list[psutil.Process]:
        """The live (not zombie) processes of the run's session."""
        out = []
        for proc in psutil.process_iter():
            try:
                if os.getsid(proc.pid) == self.sid and proc.status() != psutil.STATUS_ZOMBIE:
                    out.append(proc)
            except (psutil.Error, OSError):
                continue
        return out

    def gone_by(self, deadline: float) -> float:
        """Seconds until the session is empty (before `deadline`, monotonic); fails with the
        names of what is left."""
        t0 = time.monotonic()
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, [p.name() for p in left if p.is_running()]
        return time.monotonic() - t0

    def session_dir(self) -> Path:
        """Ray's session folder, from the run's record (`mpic.deployments.local_runs`)."""
        record = self.log.parent / "home" / "run" / f"ray-{self.proc.pid}.json"
        return Path(json.loads(record.read_text())["session_dir"])

    def kill(self) -> None:
        """SIGKILL every process of the run's session (clean-up after a failure)."""
        for proc in self.processes():
            try:
                proc.kill()
            except psutil.Error:
                pass
        self.proc.wait()


def _ignore_and_block_sigint() -> None:
    """At spawn, as a script's `cmd &` (SIGINT ignored) and then some (SIGINT, SIGTERM blocked)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


def _ignore_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


LOUD = re.compile(r"\bERROR\b|Traceback")


def _loud_lines(text: str) -> list[str]:
    return [line[:300] for line in text.splitlines() if LOUD.search(line)]


def _non_loopback_listeners(run: Run) -> dict[str, int]:
    """process name -> count of the run's listening sockets not on the loopback (each Serve
    replica is a process of its own: `ray::ServeReplica:<app>:<deployment>`)."""
    pids = {p.pid: p for p in run.processes()}
    out: dict[str, int] = {}
    for conn in psutil.net_connections("inet"):
        if conn.status != psutil.CONN_LISTEN or conn.pid not in pids:
            continue
        ip = conn.laddr.ip.removeprefix("::ffff:")
        if not (ip.startswith("127.") or ip == "::1"):
            name = pids[conn.pid].name()
            out[name] = out.get(name, 0) + 1
    return out


def test_sigint_ignored_at_spawn_stops_and_bad_inputs_log_no_error(tmp_path: Path) -> None:
    run = Run(tmp_path, free_port(), "sigint", preexec=_ignore_and_block_sigint)
    try:
        run.wait_ready()
        wide = _non_loopback_listeners(run)
        print("listening beyond the loopback:", wide)
        # Serve binds each replica's inter-deployment gRPC server to [::] (ray/serve/_private/
        # replica.py); every other Ray port follows the API onto the loopback
        assert all(n.startswith("ray::ServeReplica:") and k == 1 for n, k in wide.items()), wide
        session = run.session_dir()
        t0 = time.monotonic()
        with httpx.Client(base_url=run.url, timeout=60) as client:
            for _, kind, status, method, path, kwargs in bad_requests(
                N_BAD, "mpic-dev-alice", "mpic-dev-admin"
            ):
                check_answer(client.request(method, path, **kwargs), kind, status)
            assert client.get("/healthz").status_code == 200
        print(f"{N_BAD} bad inputs in {time.monotonic() - t0:.1f} s")
        time.sleep(2)  # Ray's log monitor forwards the replicas' lines to the console
        run.proc.send_signal(signal.SIGINT)
        t_signal = time.monotonic()
        assert run.proc.wait(timeout=STOP_S) == 0
        took = run.gone_by(t_signal + STOP_S)
        print(f"SIGINT: stopped in {time.monotonic() - t_signal - took:.1f} s, no process left")
    finally:
        run.kill()
    console = run.log.read_text()
    assert "stopped" in console
    serve_logs = {p.name: p.read_text() for p in (session / "logs" / "serve").glob("*.log")}
    loud = _loud_lines(console) + [
        f"{n}: {x}" for n, t in serve_logs.items() for x in _loud_lines(t)
    ]
    assert not loud, loud[:20]
    ingress = "".join(t for n, t in serve_logs.items() if n.startswith("replica_mpic_Ingress"))
    for i in range(N_BAD):  # one line each, with the request id (the client's X-Request-ID)
        assert len(re.findall(rf"request bad-{i} answered 4\d\d ", ingress)) == 1, i


def test_restart_after_sigkill_ends_the_leftovers_then_sigterm(tmp_path: Path) -> None:
    port = free_port()
    first = Run(tmp_path, port, "killed")
    second = None
    try:
        first.wait_ready()
        assert len(first.processes()) > 5
        first.proc.kill()  # `mpic serve` itself, as a crash or the OOM killer does
        first.proc.wait()
        second = Run(tmp_path, port, "restart", preexec=_ignore_sigterm)
        t_restart = time.monotonic()
        took = first.gone_by(t_restart + STOP_S)
        print(f"SIGKILL: the killed run's processes ended {took:.1f} s after the restart")
        second.wait_ready()
        assert "left by the local Ray instance of pid" in second.log.read_text()
        h = {"Authorization": "Bearer mpic-dev-alice"}
        body = {"model": "mpic", "messages": [{"role": "user", "content": "red cat"}]}
        r = httpx.post(f"{second.url}/v1/chat/completions", json=body, headers=h, timeout=60)
        assert r.status_code == 200, r.text
        second.proc.send_signal(signal.SIGTERM)
        t_signal = time.monotonic()
        assert second.proc.wait(timeout=STOP_S) == 0
        second.gone_by(t_signal + STOP_S)
        print(f"SIGTERM: stopped and no process left {time.monotonic() - t_signal:.1f} s after")
        assert not list((tmp_path / "home" / "run").glob("*.json"))  # records dropped
    finally:
        first.kill()
        if second is not None:
            second.kill()
