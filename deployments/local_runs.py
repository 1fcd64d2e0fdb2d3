"""The processes of a local Ray instance (CLI process: `mpic serve`, `mpic demo`, tests and
benchmarks through `mpic.deployments.local`): record them, end them, bind them to the loopback.

Every process Ray starts for an instance (the GCS, the raylet, the dashboard head and the
monitors; the raylet's DashboardAgent, RuntimeEnvAgent and workers: Serve's controller, proxy and
replicas, and what they start, e.g. vLLM's engine core) writes its output to files under the
instance's session folder (`<Ray temp>/session_.../logs`), and keeps them open. That is how a
process of the run is found here, whatever its parent, process group or session (Serve's workers
make process groups of their own, the agents are re-parented when the raylet dies, and their
process titles overwrite their command lines and part of their environment):

- `record_run(home, session_dir)` writes `<home>/run/ray-<pid>.json` (the owner's pid and start
  time, the session folder) once the instance is up;
- `end_orphans(home)`, at every local start, ends the processes of every recorded run whose owner
  is gone, and drops its record. A SIGKILLed `mpic serve` takes its raylet and GCS along (Ray's
  parent-death signal) and the workers follow, but the DashboardAgent and RuntimeEnvAgent lived
  on for ~60 s holding ports;
- `end_run(record)`, after `ray.shutdown()`, ends what of the run outlived a clean stop and drops
  its record.

Ray 2.60 replaces a loopback node address by the machine's address on Linux (its single-node
loopback mode is for macOS and Windows); `loopback_node()` keeps 127.0.0.1 for the duration of
`ray.init`, and Ray's ports then listen on the loopback (docs/serving.md lists the exceptions).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("localhost", "::1")
ANY_HOST = ("0.0.0.0", "::", "")


def runs_dir(home: Path) -> Path:
    """Where the records of local Ray instances live (`<MPIC_HOME>/run`)."""
    return home / "run"


def record_run(home: Path, session_dir: str) -> Path:
    """Record this process's Ray instance (session folder `session_dir`); returns the record."""
    me = psutil.Process()
    path = runs_dir(home) / f"ray-{me.pid}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "pid": me.pid,
        "create_time": me.create_time(),
        "session_dir": session_dir,
        "started_at": time.time(),
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)
    return path


def _owner_alive(record: dict) -> bool:
    try:
        proc = psutil.Process(int(record["pid"]))
        same = abs(proc.create_time() - float(record["create_time"])) < 0.05
        return same and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, KeyError, TypeError, ValueError):
        return False
    except psutil.Error:
        return True  # not ours to judge


def session_processes(session_dir: str) -> list[psutil.Process]:
    """The processes (this one and zombies excluded) holding a file open under `session_dir`."""
    prefix = session_dir.rstrip("/") + "/"
    out = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if any(f.path.startswith(prefix) for f in proc.open_files()):
                out.append(proc)
        except (psutil.Error, OSError):
            continue  # gone, or another user's
    return out


def _names(procs: list[psutil.Process]) -> str:
    names = []
    for proc in procs:
        try:
            names.append(proc.name())
        except psutil.Error:
            names.append(str(proc.pid))
    return ", ".join(names)


def _end(procs: list[psutil.Process], grace_s: float) -> None:
    """SIGTERM, then SIGKILL what is still there after `grace_s` (at once with 0)."""
    if grace_s > 0:
        for proc in procs:
            try:
                proc.terminate()
            except psutil.Error:
                pass
        _, procs = psutil.wait_procs(procs, timeout=grace_s)
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)


def end_orphans(home: Path) -> int:
    """End (SIGKILL) the processes of every recorded run under `home` whose owner is gone (a
    crashed run's leftovers) and drop their records; returns how many processes there were."""
    ended = 0
    for path in sorted(runs_dir(home).glob("ray-*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        if _owner_alive(record):
            continue
        procs = session_processes(str(record.get("session_dir", "")))
        if procs:
            logger.warning(
                "ending %d processes left by the local Ray instance of pid %s (gone): %s",
                len(procs),
                record.get("pid"),
                _names(procs),
            )
            _end(procs, grace_s=0)
            ended += len(procs)
        path.unlink(missing_ok=True)
    return ended


def end_run(path: Path, grace_s: float = 2.0) -> int:
    """After `ray.shutdown()`: end what of the recorded run `path` is still there, drop the
    record; returns how many processes there were."""
    try:
        session_dir = json.loads(path.read_text())["session_dir"]
    except (OSError, ValueError, KeyError):
        return 0
    procs = session_processes(session_dir)
    if procs:
        logger.warning(
            "ending %d processes that outlived the Ray shutdown: %s", len(procs), _names(procs)
        )
        _end(procs, grace_s)
    path.unlink(missing_ok=True)
    return len(procs)


def ray_node_ip(host: str) -> str | None:
    """The node address Ray should use for an API listening on `host`: 127.0.0.1 for a loopback
    host, the host itself for one IP address, None (Ray's choice: the machine's address) for all
    interfaces or a host name."""
    if host in LOOPBACK_HOSTS or host.startswith("127."):
        return "127.0.0.1"
    if host in ANY_HOST:
        return None
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


@contextmanager
def loopback_node(enabled: bool = True) -> Iterator[None]:
    """For the duration of a local `ray.init(_node_ip_address="127.0.0.1")`: keep that address
    (Ray on Linux would resolve it to the machine's address,
    `ray._private.services.resolve_ip_for_localhost`, unless its single-node mode is on)."""
    if not enabled:
        yield
        return
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
