"""The MPIC application in-process, without Ray (tests/deployments): every deployment class is
instantiated directly and wired through `LocalHandle`s that mimic Serve's `DeploymentHandle`
(`.method.remote(...)` awaitable, `.options(stream=True)` async-iterable, responses passed as
arguments are resolved first), and the ingress's FastAPI app is served by Starlette's
`TestClient` (an `httpx.Client`, so the official `openai` client can use it as its transport).
With `engine.kind: fake` an HTTP test takes milliseconds; with `reference` it runs the real
model path, still without a Ray cluster.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class LocalResponse:
    """One call of a deployment method: awaitable, or async-iterable for streaming calls."""

    def __init__(self, fn: Any, args: tuple, kwargs: dict) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs

    async def _resolved(self) -> tuple[list, dict]:
        args = [await a if isinstance(a, LocalResponse) else a for a in self.args]
        kwargs = {k: await v if isinstance(v, LocalResponse) else v for k, v in self.kwargs.items()}
        return args, kwargs

    async def _result(self) -> Any:
        args, kwargs = await self._resolved()
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(*args, **kwargs)
        return await asyncio.to_thread(self.fn, *args, **kwargs)  # Serve runs sync methods so

    def __await__(self):
        return self._result().__await__()

    def result(self) -> Any:
        """The value, waited for from a thread without an event loop (as a sync Serve method
        calls `handle.method.remote(...).result()`)."""
        return asyncio.run(self._result())

    def _to_object_ref(self) -> LocalResponse:
        return self  # awaiting it gives the value itself (no object store in-process)

    async def __aiter__(self):
        args, kwargs = await self._resolved()
        async for item in self.fn(*args, **kwargs):
            yield item


class LocalHandle:
    """A `DeploymentHandle` look-alike over one in-process replica object. `calls`, when given,
    records every `.remote` call as (deployment class name, method name): one Ray hop each."""

    def __init__(self, obj: Any, calls: list[tuple[str, str]] | None = None) -> None:
        self._obj, self._calls = obj, calls

    def options(self, **_: Any) -> LocalHandle:
        return self

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._obj, name)
        calls, hop = self._calls, (type(self._obj).__name__, name)

        class _Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> LocalResponse:
                if calls is not None:
                    calls.append(hop)
                return LocalResponse(method, args, kwargs)

        return _Method


@dataclass
class InProcessApp:
    """The application behind a TestClient (`client`), its config and its replica objects;
    `calls`: every deployment-handle call made so far, in order (see `LocalHandle`)."""

    client: Any
    config: Any
    ingress: Any
    worker: Any
    resolver: Any
    calls: list[tuple[str, str]]
    url: str = "http://testserver"

    def headers(self, key: str) -> dict[str, str]:
        """Authorization header for `key`."""
        return {"Authorization": f"Bearer {key}"}


def ingress_class() -> type:
    """The undecorated Ingress class (`serve.ingress` wraps it in a Serve replica class)."""
    from mpic.deployments.http.ingress import Ingress

    return next(c for c in Ingress.__mro__[1:] if c.__name__ == "Ingress")


@contextmanager
def in_process_app(
    config: Any, keys: dict[str, str], admin_keys: list[str]
) -> Iterator[InProcessApp]:
    """Build every deployment in this process and serve the ingress app with a TestClient."""
    from fastapi.testclient import TestClient

    from mpic.deployments.client_errors import answering_client_errors as values
    from mpic.deployments.http.ingress import app
    from mpic.deployments.serve.policy_check import model_layers
    from mpic.deployments.serve.resolver import Resolver
    from mpic.deployments.serve.retriever import Retriever
    from mpic.deployments.serve.workers import Encoder, LLMWorker

    saved = {k: os.environ.get(k) for k in ("MPIC_API_KEYS", "MPIC_ADMIN_KEYS")}
    os.environ.update(
        {"MPIC_API_KEYS": json.dumps(keys), "MPIC_ADMIN_KEYS": json.dumps(admin_keys)}
    )
    calls: list[tuple[str, str]] = []
    try:
        # the classes as build_app deploys them: client errors (4xx) answered as values
        enc = LocalHandle(values(Encoder)(config), calls)
        worker = values(LLMWorker)(config)
        wrk = LocalHandle(worker, calls)
        ret = LocalHandle(values(Retriever)(config, wrk), calls)
        resolver = values(Resolver)(config, ret, model_layers(config.engine))  # as build_app
        res = LocalHandle(resolver, calls)
        cls = ingress_class()
        ingress = cls.__new__(cls)
        cls.__init__(ingress, config, enc, res, wrk, ret)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    overrides = {}
    for route in app.routes:
        for dep in getattr(getattr(route, "dependant", None), "dependencies", []):
            if getattr(dep.call, "__name__", "") == "get_current_servable_instance":
                overrides[dep.call] = lambda: ingress
    # one module-level app: an app opened inside another (a module fixture's) takes the routes
    # over while it runs and hands them back after
    outer = {c: app.dependency_overrides[c] for c in overrides if c in app.dependency_overrides}
    app.dependency_overrides.update(overrides)
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            yield InProcessApp(
                client=client,
                config=config,
                ingress=ingress,
                worker=worker,
                resolver=resolver,
                calls=calls,
            )
    finally:
        for call in overrides:
            app.dependency_overrides.pop(call, None)
        app.dependency_overrides.update(outer)
        worker.engine.close()  # a vLLM engine's processes would outlive the app


def fake_config(store_dir: Path, **engine: Any) -> Any:
    """A ServeAppConfig on the fake engine with a filesystem store in `store_dir`."""
    from mpic.deployments.config import ServeAppConfig

    return ServeAppConfig.model_validate(
        {
            "engine": {"kind": "fake", "model": "fake-model", "max_tokens_default": 6, **engine},
            "store": {"url": store_dir.as_uri(), "fsync": False, "memory_bytes": 16 << 20},
            "auth": {"mode": "production"},
            "limits": {"max_upload_bytes": 256 * 1024},
        }
    )
