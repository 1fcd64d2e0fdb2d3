"""The records of local Ray instances (`mpic.deployments.local_runs`), without Ray: a process
holding a file open under a recorded session folder is ended once the run's owner is gone (not
while it lives), the record dropped; the node address Ray is given for an API host."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil

from mpic.deployments.local_runs import end_orphans, end_run, ray_node_ip, record_run, runs_dir

HOLD = "import sys, time; f = open(sys.argv[1], 'a'); print('ok', flush=True); time.sleep(600)"


def _holder(path: Path) -> subprocess.Popen:
    """A process keeping `path` open, as a Ray process keeps its log files."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ok"
    return proc


def test_a_gone_owners_session_processes_are_ended_a_live_ones_kept(tmp_path: Path) -> None:
    home = tmp_path / "home"
    gone_session, live_session = tmp_path / "session_a" / "logs", tmp_path / "session_b" / "logs"
    for d in (gone_session, live_session):
        d.mkdir(parents=True)
    owner = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(owner.pid).create_time()
    owner.wait()  # the owner is gone (as after a SIGKILL)
    gone = runs_dir(home) / f"ray-{owner.pid}.json"
    gone.parent.mkdir(parents=True)
    record = {"pid": owner.pid, "create_time": started, "session_dir": str(gone_session.parent)}
    gone.write_text(json.dumps(record))
    live = record_run(home, str(live_session.parent))  # this process: alive
    leftover, kept = _holder(gone_session / "agent.out"), _holder(live_session / "agent.out")
    try:
        assert end_orphans(home) == 1  # (ended and reaped: its pid is free)
        assert not psutil.pid_exists(leftover.pid) and kept.poll() is None
        assert not gone.exists() and live.exists()
        assert end_run(live, grace_s=1) == 1  # a clean stop ends what outlived it
        assert not psutil.pid_exists(kept.pid) and not live.exists()
    finally:
        for proc in (leftover, kept):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_ray_node_address_follows_the_api_host() -> None:
    assert [ray_node_ip(h) for h in ("127.0.0.1", "localhost", "::1", "127.0.1.1")] == [
        "127.0.0.1"
    ] * 4
    assert ray_node_ip("0.0.0.0") is None and ray_node_ip("::") is None
    assert ray_node_ip("10.1.2.3") == "10.1.2.3" and ray_node_ip("my-host") is None
