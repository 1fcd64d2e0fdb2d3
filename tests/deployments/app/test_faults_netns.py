"""Faults across real hosts (slow; root; run under `flock /tmp/mpic-heavy.lock`): four hosts on
this machine, each a network namespace with its own address (`tests.deployments.netns`): a Ray
head host (GCS, Serve controller, HTTP proxy, Ingress, Encoder, Resolver, Retriever), two worker
hosts (one LLM-worker replica each, pinned by a custom resource) and an S3 host (moto's server).
The client (this test) talks to the head's proxy over a veth link; the hosts reach each other and
the S3 host only through the bridge: no loopback between them. The engine is the fake engine
(streams one token per 0.1 s): the CPU goes to Ray, not to a model.

1. A worker host cut off mid-stream (its bridge port down: packets dropped, as a pulled cable):
   of the streams in flight, those served there end with an SSE error event (or a closed
   stream), the others finish; new chats are answered by the other host; every uploaded file is
   still listed and answerable. The host is reconnected and its Ray node restarted (what a
   node's supervisor does): Serve places the replacement replica there again.
2. The S3 host cut off and back: uploads answer a JSON 503 within the store's timeouts while it
   is away, a chat on a file read once before (its entry in the worker's memory tier, its record
   in the resolver's) is answered, and the first upload after the host returns succeeds;
   nothing uploaded is lost.

What the client saw, the times and the files lost are printed as JSON (docs/deployment.md
"Faults across hosts"). Skipped without root, `ip`, Ray or moto. Every process started runs in
one of the namespaces and is killed by pid in the fixture's `finally`; the namespaces are
deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deployments import netns
from tests.deployments.conftest import png

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
KEYS = {"alice-key": "alice"}
ALICE = {"Authorization": "Bearer alice-key"}
PORT = 8000
BUCKET = "mpic-netns"
RAY_ENV = {
    # a node whose raylet stops answering is declared dead after ~3 s (Ray's default: ~15 s)
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "OMP_NUM_THREADS": "1",
}


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _wait_port(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{host}:{port} not reachable in {timeout_s} s")


def _app_config(hosts: netns.Hosts) -> dict:
    head = {"num_cpus": 0.1, "resources": {"mpic_head": 1}}
    return {
        "name": "mpic",
        "route_prefix": "/",
        "engine": {
            "kind": "fake",
            "model": "fake-model",
            "max_tokens_default": 6,
            "fake_token_delay_s": 0.1,
        },
        "store": {
            "s3": {
                "endpoint": f"{hosts['s3']}:5000",
                "bucket": BUCKET,
                "access_key": "testing",
                "secret_key": "testing",
                "secure": False,
                "region": "us-east-1",
                "timeout_s": 2.0,
                "retries": 1,
            },
            "memory_bytes": 16 << 20,
        },
        "auth": {"mode": "production"},
        "sweep_interval_s": 0,
        "llm_router": "cache-aware",
        **{d: head for d in ("ingress", "encoder", "retriever", "resolver")},
        "llm_worker": {
            "num_cpus": 0.1,
            "resources": {"mpic_llm": 1},
            "max_ongoing_requests": 8,
            "autoscaling": {"min_replicas": 2, "max_replicas": 2},
        },
    }


class Cluster:
    """The four hosts with their processes; `driver` deployed the app and answers `status`."""

    def __init__(self, hosts: netns.Hosts, logs: Path) -> None:
        self.hosts = hosts
        self.logs = logs
        self.env = {**os.environ, **RAY_ENV, "PYTHONPATH": str(ROOT)}
        self.env.update(
            {"MPIC_API_KEYS": json.dumps(KEYS), "MPIC_ADMIN_KEYS": "[]", "MPIC_HOME": str(logs)}
        )
        self.url = f"http://{hosts['head']}:{PORT}"
        self.driver = None
        # Ray's own temp dir, short (socket paths) and apart from /tmp/ray: its
        # `ray_current_cluster` file must not send other local `ray.init()` calls here
        self.ray_tmp = Path(f"/tmp/mpn{os.getpid()}")

    def _start(self, host: str, argv: list[str], name: str):  # noqa: ANN202
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - lives with the process
        return self.hosts.popen(host, argv, env=self.env, stdout=log, stderr=log, cwd=ROOT)

    def start_s3(self) -> None:
        self._start("s3", [_bin("moto_server"), "-H", self.hosts["s3"], "-p", "5000"], "s3")
        _wait_port(self.hosts["s3"], 5000, 60)

    def start_head(self) -> None:
        head = self.hosts["head"]
        self._start("head", [*self._ray_start(head), "--head", "--port", "6379",
                             "--resources", json.dumps({"mpic_head": 100}),
                             "--include-dashboard", "false"], "head")  # fmt: skip
        _wait_port(head, 6379, 120)

    def start_worker(self, host: str, attempts: int = 3, timeout_s: float = 120) -> None:
        """Join `host` to the cluster; a node that times out registering (a busy 2-core
        machine) is started again."""
        argv = [*self._ray_start(self.hosts[host]), "--address", f"{self.hosts['head']}:6379"]
        argv += ["--resources", json.dumps({"mpic_llm": 1})]
        log = self.logs / f"{host}.log"
        for _ in range(attempts):
            seen = log.stat().st_size if log.exists() else 0
            proc = self._start(host, argv, host)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and proc.poll() is None:
                if b"Ray runtime started" in log.read_bytes()[seen:]:
                    return
                time.sleep(0.5)
            self.hosts.kill_all(host)
        raise TimeoutError(f"{host} did not join the Ray cluster in {attempts} attempts")

    def _ray_start(self, ip: str) -> list[str]:
        return [_bin("ray"), "start", "--block", "--node-ip-address", ip, "--num-cpus", "1",
                "--object-store-memory", str(150 << 20), "--disable-usage-stats",
                "--temp-dir", str(self.ray_tmp)]  # fmt: skip

    def deploy(self, timeout_s: float = 420) -> None:
        import subprocess

        cfg = json.dumps(_app_config(self.hosts))
        argv = [
            sys.executable,
            "-m",
            "tests.deployments.app.test_faults_netns",
            self.hosts["head"],
            cfg,
        ]
        self.driver = self.hosts.popen(
            "head", argv, env=self.env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=open(self.logs / "driver.log", "ab"), text=True, bufsize=1,  # noqa: SIM115
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while _readline(self.driver, max(1.0, deadline - time.monotonic())) != "READY\n":
            pass

    def status(self) -> dict:
        """LLM-worker replica states and the live Ray nodes, from the driver."""
        self.driver.stdin.write("status\n")
        self.driver.stdin.flush()
        deadline = time.monotonic() + 60
        while True:  # Ray may print its own lines on the driver's stdout
            line = _readline(self.driver, max(1.0, deadline - time.monotonic()))
            if line.startswith('{"llm_worker"'):
                return json.loads(line)

    def replica_hosts(self) -> dict[str, int]:
        """host -> LLM-worker replica processes running in its namespace."""
        import psutil

        out = {}
        for host in ("w1", "w2"):
            n = 0
            for pid in self.hosts.pids(host):
                try:
                    if "LLMWorker" in " ".join(psutil.Process(pid).cmdline()):
                        n += 1
                except psutil.Error:
                    continue
            out[host] = n
        return out


def _readline(proc, timeout_s: float) -> str:  # noqa: ANN001
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not got or not got[0]:
        raise TimeoutError(f"no answer from the driver in {timeout_s} s")
    return got[0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    why = netns.available()
    if why:
        pytest.skip(why)
    pytest.importorskip("moto.server")
    pytest.importorskip("ray")
    logs = tmp_path_factory.mktemp("netns-logs")
    hosts = netns.Hosts(["head", "w1", "w2", "s3"])
    c = None
    try:
        c = Cluster(hosts, logs)
        c.start_s3()
        c.start_head()
        c.start_worker("w1")
        c.start_worker("w2")
        c.deploy()
        yield c
    finally:
        hosts.close()
        if c is not None and not os.environ.get("MPIC_NETNS_KEEP"):
            shutil.rmtree(c.ray_tmp, ignore_errors=True)
        print(f"netns logs: {logs}")


def _upload(url: str, seed: int, timeout: float = 30):  # noqa: ANN202
    import httpx

    return httpx.post(
        f"{url}/v1/files",
        headers=ALICE,
        files={"file": (f"f{seed}.png", png(seed), "image/png")},
        data={"purpose": "vision"},
        timeout=timeout,
    )


def _chat(url: str, fid: str, timeout: float = 30):  # noqa: ANN202
    import httpx

    content = [{"type": "file", "file": {"file_id": fid}}, {"type": "text", "text": "red cat"}]
    body = {"model": "mpic", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    return httpx.post(f"{url}/v1/chat/completions", headers=ALICE, json=body, timeout=timeout)


def _lost(url: str, fids: list[str]) -> int:
    import httpx

    listed = httpx.get(f"{url}/v1/files", headers=ALICE, timeout=30).json()["data"]
    have = {f["id"] for f in listed}
    return sum(1 for f in fids if f not in have or _chat(url, f).status_code != 200)


class Stream(threading.Thread):
    """One long streamed answer; records its lines, how it ended and when."""

    def __init__(self, url: str, words: int) -> None:
        super().__init__(daemon=True)
        self.url, self.words = url, words
        self.lines: list[str] = []
        self.first = threading.Event()
        self.end = ""
        self.ended_at = 0.0

    def run(self) -> None:
        import httpx

        text = " ".join(["cat"] * self.words)
        body = {
            "model": "mpic",
            "max_tokens": self.words,
            "stream": True,
            "messages": [{"role": "user", "content": text}],
        }
        try:
            with httpx.stream(
                "POST", f"{self.url}/v1/chat/completions", headers=ALICE, json=body, timeout=60
            ) as r:
                self.end = f"http {r.status_code}"
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.first.set()
            tail = self.lines[-3:]
            if any('"error"' in x for x in tail):
                self.end = "sse error: " + next(x for x in tail if '"error"' in x)[:160]
            elif tail and tail[-1] == "data: [DONE]":
                self.end = "done"
        except Exception as exc:  # noqa: BLE001 - the connection closed under us: an answer too
            self.end = f"closed: {type(exc).__name__}"
        finally:
            self.ended_at = time.monotonic()
            self.first.set()


def test_worker_host_cut_off_mid_stream(cluster: Cluster) -> None:
    url = cluster.url
    assert cluster.replica_hosts() == {"w1": 1, "w2": 1}
    fids = []
    for seed in (7001, 7002, 7003):
        r = _upload(url, seed)
        assert r.status_code == 200, r.text
        fids.append(r.json()["id"])
    streams = []
    for _ in range(4):  # entry-less: power-of-two choices spread them over both replicas
        s = Stream(url, 300)
        s.start()
        assert s.first.wait(60) and s.lines, s.end
        streams.append(s)
    t_cut = time.monotonic()
    cluster.hosts.cut("w1")
    while time.monotonic() - t_cut < 60 and not any(s.ended_at for s in streams):
        time.sleep(0.1)  # the first stream to end is one of the cut host's
    # new chats while w1 is away (w2's streams still running): answered by w2
    t0 = time.monotonic()
    served_after = None
    while time.monotonic() - t0 < 60:
        r = _chat(url, fids[0], timeout=20)
        if r.status_code == 200:
            served_after = time.monotonic() - t_cut
            break
        assert r.status_code in (503, 504), r.text
        time.sleep(0.5)
    for s in streams:
        s.join(90)
    cut_ends = [s for s in streams if s.end != "done"]
    lost_during = _lost(url, fids)
    status_cut = cluster.status()
    # reconnect w1 and restart its Ray node (the old raylet was declared dead and exits)
    cluster.hosts.restore("w1")
    t_back = time.monotonic()
    cluster.hosts.kill_all("w1")
    cluster.start_worker("w1")
    rejoined = None
    while time.monotonic() - t_back < 240:
        if cluster.replica_hosts() == {"w1": 1, "w2": 1}:
            if cluster.status()["llm_worker"].get("RUNNING") == 2:
                rejoined = time.monotonic() - t_back
                break
        time.sleep(1)
    lost_after = _lost(url, fids)
    facts = {
        "fault": "worker host cut off mid-stream",
        "streams": [s.end for s in streams],
        "streams_cut_end_s": [round(s.ended_at - t_cut, 1) for s in cut_ends],
        "chat_served_by_other_host_after_s": served_after and round(served_after, 1),
        "status_while_cut": status_cut,
        "rejoined_s": rejoined and round(rejoined, 1),
        "files_lost": max(lost_during, lost_after),
    }
    print(json.dumps(facts))
    assert cut_ends, "no stream was on the cut host"
    assert len(cut_ends) < len(streams), "no stream was on the other host"
    for s in cut_ends:
        assert s.end.startswith(("sse error", "closed")), s.end
    assert served_after is not None, "the other host did not serve"
    assert lost_during == 0 and lost_after == 0
    assert rejoined is not None, "w1 did not get its replica back"


def test_s3_host_cut_off_and_back(cluster: Cluster) -> None:
    url = cluster.url
    r = _upload(url, 7101)
    assert r.status_code == 200, r.text
    fids = [r.json()["id"]]
    # read once before the outage: the resolver keeps the file's record, the serving worker its
    # entry in memory (and reports it to the cache-aware router within a second)
    assert _chat(url, fids[0]).status_code == 200
    time.sleep(2)
    cluster.hosts.cut("s3")
    try:
        t0 = time.monotonic()
        r = _upload(url, 7102, timeout=60)
        upload_s = time.monotonic() - t0
        outage_upload = (r.status_code, r.headers.get("retry-after"), r.json()["error"]["code"])
        t0 = time.monotonic()
        c = _chat(url, fids[0], timeout=60)
        chat_s = time.monotonic() - t0
        outage_chat = c.status_code
        outage_tiers = c.json().get("mpic", {}).get("tier_hits") if c.status_code == 200 else None
    finally:
        cluster.hosts.restore("s3")
    t_back = time.monotonic()
    recovered = None
    while time.monotonic() - t_back < 60:
        r = _upload(url, 7103, timeout=30)
        if r.status_code == 200:
            recovered = time.monotonic() - t_back
            fids.append(r.json()["id"])
            break
        time.sleep(0.5)
    lost = _lost(url, fids)
    facts = {
        "fault": "s3 host cut off",
        "upload_while_cut": outage_upload,
        "upload_answer_s": round(upload_s, 1),
        "chat_on_memory_tier_file_while_cut": outage_chat,
        "its_tier_hits": outage_tiers,
        "chat_answer_s": round(chat_s, 1),
        "upload_ok_after_restore_s": recovered and round(recovered, 1),
        "files_lost": lost,
    }
    print(json.dumps(facts))
    assert outage_upload[0] == 503 and outage_upload[1], outage_upload
    assert outage_chat == 200 and outage_tiers == {"memory": 1}, (outage_chat, outage_tiers)
    assert recovered is not None and lost == 0


def _drive(head: str, cfg_json: str) -> None:
    """Driver (runs in the head host's namespace): deploy the app, then answer `status` lines
    on stdin until `quit` or EOF."""
    import logging

    import ray
    from ray import serve

    from mpic.deployments.app import build_app
    from mpic.deployments.config import ServeAppConfig
    from mpic.deployments.local import prepare_local, wait_healthy

    env = {k: os.environ[k] for k in ("MPIC_API_KEYS", "MPIC_ADMIN_KEYS", "MPIC_HOME")}
    env.update(RAY_ENV)
    ray.init(
        address=f"{head}:6379",
        runtime_env={"env_vars": env},
        log_to_driver=False,
        logging_level=logging.WARNING,
    )
    serve.start(proxy_location="HeadOnly", http_options={"host": head, "port": PORT})
    cfg = prepare_local(ServeAppConfig.model_validate_json(cfg_json))
    serve.run(build_app(cfg), name=cfg.name, route_prefix=cfg.route_prefix)
    wait_healthy(f"http://{head}:{PORT}", 300)
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "status":
            break
        app = serve.status().applications[cfg.name]
        states = app.deployments["LLMWorker"].replica_states
        nodes = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
        counts = {str(getattr(k, "value", k)): v for k, v in states.items()}
        print(json.dumps({"llm_worker": counts, "nodes": nodes}), flush=True)


if __name__ == "__main__":
    _drive(sys.argv[1], sys.argv[2])
