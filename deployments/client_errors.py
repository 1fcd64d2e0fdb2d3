"""Client errors (HTTP 4xx) across a Serve hop: returned as values by the replica that finds
them, raised again by the caller (every replica behind the Ingress; the caller's side in the
Ingress, Resolver, Retriever and LLM worker).

Ray Serve treats every exception a replica method raises as a replica failure: an ERROR line
with its traceback ("Request failed."), an access-log line with status ERROR, its error counter.
A typed error with a 4xx status (`mpic.errors.MPICError`: an unknown file id, a bad policy name,
bytes that are not an image) is the client's doing, not the replica's, so it crosses the hop as
a value:

- `answering_client_errors(cls)` (applied by the app builder to the Encoder, LLMWorker, Retriever
  and Resolver classes) is a subclass whose public methods return a `ClientError` holding the
  typed error where they would raise one with a 4xx status (a stream yields it as its last
  item). A 5xx or an untyped exception is raised as before, and Serve logs it with its traceback.
  An argument that is a `ClientError` (another deployment's answer chained into this call: the
  Encoder's result passed to `LLMWorker.upload`) is the answer at once. A public method is an
  entry point: called from another method of the same replica it would answer the value too,
  so shared steps live in private (`_`) methods or functions, as they do.
- `raising(handle)` wraps a deployment handle in the caller: a response, `.result()` or stream
  item that is a `ClientError` raises its typed error there, so the Ingress answers it with the
  same JSON body and status as before and logs one line with the request id
  (`mpic.deployments.http.http_errors`). A value fetched another way (an ObjectRef from
  `_to_object_ref`) goes through `raise_client_error`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mpic.errors import MPICError

SERVE_HOOKS = frozenset({"check_health", "record_routing_stats", "reconfigure"})
"""Methods Serve itself calls (not through a handle): left as they are."""


@dataclass
class ClientError:
    """A replica's answer that is a client error: the typed error, its traceback dropped."""

    error: MPICError


def is_client_error(exc: BaseException) -> bool:
    """A typed error with a 4xx status."""
    return isinstance(exc, MPICError) and exc.status < 500


def raise_client_error(value: Any) -> Any:
    """`value`, or its typed error raised if it is a `ClientError`."""
    if isinstance(value, ClientError):
        raise value.error.with_traceback(None)
    return value


def _passed(args: tuple, kwargs: dict) -> ClientError | None:
    return next((v for v in (*args, *kwargs.values()) if isinstance(v, ClientError)), None)


def _answering(fn: Callable) -> Callable:
    """`fn` (a method: sync, async or an async generator) with its client errors as values."""
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream(self, *args, **kwargs):
            if (passed := _passed(args, kwargs)) is not None:
                yield passed
                return
            gen = fn(self, *args, **kwargs)
            try:
                async for item in gen:
                    yield item
            except MPICError as exc:
                if not is_client_error(exc):
                    raise
                yield ClientError(exc)
            finally:
                await gen.aclose()  # a stream cut short closes the method's own generator

        return stream

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def call(self, *args, **kwargs):
            if (passed := _passed(args, kwargs)) is not None:
                return passed
            try:
                return await fn(self, *args, **kwargs)
            except MPICError as exc:
                if not is_client_error(exc):
                    raise
                return ClientError(exc)

        return call

    @functools.wraps(fn)
    def sync_call(self, *args, **kwargs):
        if (passed := _passed(args, kwargs)) is not None:
            return passed
        try:
            return fn(self, *args, **kwargs)
        except MPICError as exc:
            if not is_client_error(exc):
                raise
            return ClientError(exc)

    return sync_call


def answering_client_errors(cls: type) -> type:
    """A subclass of the deployment class `cls` whose public methods (Serve's hooks and static
    methods aside) answer client errors as `ClientError` values."""
    methods = {}
    for name in dir(cls):
        if name.startswith("_") or name in SERVE_HOOKS:
            continue
        raw = inspect.getattr_static(cls, name)
        if inspect.isfunction(raw):
            methods[name] = _answering(raw)
    namespace = {"__module__": cls.__module__, "__doc__": cls.__doc__, **methods}
    return type(cls.__name__, (cls,), namespace)


class _Response:
    """A deployment response (or response generator) whose `ClientError` raises."""

    def __init__(self, response: Any) -> None:
        self.response = response
        self._items: Any = None

    async def _value(self) -> Any:
        return raise_client_error(await self.response)

    def __await__(self):
        return self._value().__await__()

    def result(self, *args: Any, **kwargs: Any) -> Any:
        """The value, waited for (sync), or its client error raised."""
        return raise_client_error(self.response.result(*args, **kwargs))

    def __aiter__(self) -> _Response:
        self._items = self.response.__aiter__()
        return self

    async def __anext__(self) -> Any:
        return raise_client_error(await self._items.__anext__())

    def __getattr__(self, name: str) -> Any:  # _to_object_ref, cancel, ...
        return getattr(self.response, name)


class _Method:
    def __init__(self, method: Any) -> None:
        self.method = method

    def remote(self, *args: Any, **kwargs: Any) -> _Response:
        """The call, with responses passed as arguments handed over as they are (Serve chains
        them)."""
        args = tuple(a.response if isinstance(a, _Response) else a for a in args)
        kwargs = {k: v.response if isinstance(v, _Response) else v for k, v in kwargs.items()}
        return _Response(self.method.remote(*args, **kwargs))


class RaisingHandle:
    """A deployment handle whose responses raise a replica's `ClientError` as its typed error."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def options(self, *args: Any, **kwargs: Any) -> RaisingHandle:
        """Serve's `options` (e.g. `stream=True`), still raising."""
        return RaisingHandle(self.handle.options(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name.startswith("_"):  # the handle's own attributes, not a deployment method
            return getattr(self.handle, name)
        return _Method(getattr(self.handle, name))


def raising(handle: Any) -> Any:
    """`handle` (a deployment handle, or the in-process harness's look-alike) raising client
    errors; None stays None."""
    if handle is None or isinstance(handle, RaisingHandle):
        return handle
    return RaisingHandle(handle)
