"""Hosts on one machine for fault tests (test process, root only): Linux network namespaces joined
by a bridge, each with its own address in a private range, so that traffic between them crosses
veth links (never loopback) and cutting a host off is one command.

    switch namespace, bridge `br0`:
      port <prefix>-<host>b <-> <prefix>-<host>e in the host's namespace (10.213.7.x/24)
      port <prefix>-rootb   <-> <prefix>-roote in the test's own namespace (10.213.7.1/24)

`cut(host)` sets the host's bridge port down: its packets are dropped, as when a cable is
pulled (the host keeps its address; peers time out rather than being refused); `restore(host)`
sets it up again. `close()` kills every process left in the namespaces (by pid, from `ip netns
pids`), then deletes the namespaces and the test's own veth end; it runs from a fixture's
`finally`, so nothing outlives the test.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

SUBNET = "10.213.7"
"""The /24 these tests use (private, RFC 1918); the test's own namespace is .1."""


def available() -> str | None:
    """Why namespaces cannot be made here (not root, no `ip`), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    return None


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=15, check=check)


class Hosts:
    """Named hosts (`hosts[name]` is its address) in namespaces `<prefix>-<name>`."""

    def __init__(self, names: Sequence[str], prefix: str | None = None) -> None:
        self.prefix = prefix or f"mp{os.getpid() % 10000}"
        self.switch = f"{self.prefix}-sw"
        self.addr: dict[str, str] = {}
        self.client = f"{SUBNET}.1"
        self._made: list[str] = []
        try:
            self._build(list(names))
        except BaseException:
            self.close()
            raise

    def ns(self, host: str) -> str:
        """The namespace of `host`."""
        return f"{self.prefix}-{host}"

    def _port(self, host: str) -> str:
        return f"{self.prefix}-{host}b"[:15]

    def _build(self, names: list[str]) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("link", "set", "lo", "up", ns=self.switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        for i, host in enumerate(["root", *names]):
            end, port = f"{self.prefix}-{host}e"[:15], self._port(host)
            _ip("link", "add", end, "type", "veth", "peer", "name", port)
            _ip("link", "set", port, "netns", self.switch)
            _ip("link", "set", port, "master", "br0", ns=self.switch)
            _ip("link", "set", port, "up", ns=self.switch)
            if host == "root":
                self._root_end = end
                _ip("addr", "add", f"{self.client}/24", "dev", end)
                _ip("link", "set", end, "up")
                continue
            ns = self.ns(host)
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("link", "set", end, "netns", ns)
            self.addr[host] = f"{SUBNET}.{10 + i}"
            _ip("addr", "add", f"{self.addr[host]}/24", "dev", end, ns=ns)
            _ip("link", "set", end, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)

    def __getitem__(self, host: str) -> str:
        return self.addr[host]

    def popen(self, host: str, argv: Sequence[str], **kw) -> subprocess.Popen:  # noqa: ANN003
        """Start `argv` inside `host`'s namespace (its own session, so it can be killed as a
        group)."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.ns(host), *argv], start_new_session=True, **kw
        )

    def cut(self, host: str) -> None:
        """Drop every packet to and from `host` (its bridge port down)."""
        _ip("link", "set", self._port(host), "down", ns=self.switch)

    def restore(self, host: str) -> None:
        """Reconnect `host`."""
        _ip("link", "set", self._port(host), "up", ns=self.switch)

    def pids(self, host: str) -> list[int]:
        """Processes running in `host`'s namespace."""
        out = subprocess.run(
            ["ip", "netns", "pids", self.ns(host)], capture_output=True, text=True, timeout=15
        )
        return [int(p) for p in out.stdout.split()]

    def kill_all(self, host: str, grace_s: float = 3.0) -> None:
        """SIGTERM then SIGKILL every process of `host`'s namespace (by pid)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.pids(host)
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while self.pids(host) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not self.pids(host):
                return

    def close(self) -> None:
        """Kill what runs in the namespaces, delete them and the test's veth end."""
        for ns in reversed(self._made):
            host = ns[len(self.prefix) + 1 :]
            try:
                self.kill_all(host)
            except (OSError, subprocess.SubprocessError):
                pass
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        root_end = getattr(self, "_root_end", None)
        if root_end:
            _ip("link", "del", root_end, check=False)
