"""A slow object store for benchmarks and tests (benchmark / test process): moto's S3 server on
loopback behind a small HTTP proxy that answers every GET `delay_s` late (the delay of a remote
S3 region or an overloaded MinIO), so entry reads that miss the local tiers cost what they would
cost there. Everything else (PUT, HEAD, LIST) passes at once.

`delayed_s3(delay_s)` is a context manager yielding an `s3://...` store URL (bucket created) that
`StorageConfig(url=...)` takes; the proxy counts the GETs it delayed (`proxy.gets`).
"""

from __future__ import annotations

import http.client
import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DelayProxy(ThreadingHTTPServer):
    """HTTP/1.1 reverse proxy to `upstream` (host, port) that sleeps `delay_s` before each GET."""

    daemon_threads = True

    def __init__(self, upstream: tuple[str, int], delay_s: float) -> None:
        self.upstream, self.delay_s, self.gets = upstream, delay_s, 0
        self._lock = threading.Lock()
        super().__init__(("127.0.0.1", free_port()), _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: DelayProxy

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
        pass

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        if self.command == "GET" and self.server.delay_s > 0:
            with self.server._lock:
                self.server.gets += 1
            time.sleep(self.server.delay_s)
        conn = http.client.HTTPConnection(*self.server.upstream, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


@dataclass
class DelayedS3:
    """A running slow store: its URL and the proxy (GET count, delay)."""

    url: str
    proxy: DelayProxy


@contextmanager
def delayed_s3(delay_s: float, bucket: str = "mpic-bench") -> Iterator[DelayedS3]:
    """moto's S3 server behind a `DelayProxy`; yields the store (URL with dummy credentials)."""
    from minio import Minio
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log

    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    proxy = DelayProxy(("127.0.0.1", port), delay_s)
    thread = threading.Thread(target=proxy.serve_forever, name="delay-proxy", daemon=True)
    thread.start()
    try:
        Minio(f"127.0.0.1:{port}", "test", "test", secure=False).make_bucket(bucket)
        host, pport = proxy.server_address[:2]
        prefix = uuid.uuid4().hex[:8]
        url = (
            f"s3://{bucket}/{prefix}?endpoint={host}:{pport}&secure=false"
            "&access_key=test&secret_key=test"
        )
        yield DelayedS3(url, proxy)
    finally:
        proxy.shutdown()
        proxy.server_close()
        moto.stop()
