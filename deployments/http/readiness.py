"""Readiness of the application (Ingress replica): can every deployment serve yet?

`GET /healthz` is liveness (the ingress answers). Readiness asks more: every deployment of this
application has a RUNNING replica, i.e. its constructor (for the LLM worker: loading the engine,
30-50 s for vLLM on CPU) has finished. Until then a chat routed to the worker would wait in
Serve's queue for minutes; instead it gets a fast 503 `not_ready` with `Retry-After`, and
`GET /readyz` answers 503 (the KubeRay manifests' readiness probes, k8s/rayservice.yaml), as do
`/health`, `/v1/models` and every route that calls a deployment. (Before the Ingress itself runs,
Serve's proxy gives the same answer: `mpic.deployments.http.startup_gate`.)

Serve's controller knows the replica states (`serve.status()`); `AppReadiness` polls them on a
background task, every `period_s` (0.5 s) while the application starts and every
`ready_period_s` (2 s) once it is ready, so a request only reads the last answer (no controller
call on the request path). Each `serve.status()` serialises the application's config (the
request-router class with it): an idle Ingress replica of `mpic serve` used 12.3% of a CPU core
polling every 0.5 s for good, 4.9% with 2 s once ready (60 s each, 2-core host). A replica that
dies later (engine restart) turns readiness off again, at the next poll, until
Serve has replaced it. A poll's answer is as old as the moment its probe began, and on a busy
host `serve.status()` takes seconds, while Serve's router hears of a new replica at once: a chat
can be served by the replacement while the last answer still says it is starting. A served chat
is newer evidence (`served`): readiness is on from then, and a not-ready answer of a probe that
began before it is dropped. Outside a Serve replica (the in-process test app, which builds
every deployment before it serves) the application is always ready.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from mpic.deployments.serve.admission import EngineUnavailableError

logger = logging.getLogger(__name__)

Probe = Callable[[], dict[str, bool]]
"""deployment name -> whether it can serve now (an empty dict: the application is unknown)."""


class NotReadyError(EngineUnavailableError):
    """A deployment is still starting (HTTP 503 with Retry-After)."""

    code = "not_ready"


def serve_probe(app_name: str) -> Probe:
    """A `Probe` over Serve's status of application `app_name`: a deployment can serve when it
    has a RUNNING replica (or is HEALTHY with none wanted: scaled to zero)."""

    def probe() -> dict[str, bool]:
        from ray import serve

        app = serve.status().applications.get(app_name)
        if app is None:
            return {}
        return {
            name: dep.replica_states.get("RUNNING", 0) > 0
            or (
                getattr(dep.status, "value", dep.status) == "HEALTHY"
                and not any(dep.replica_states.values())
            )
            for name, dep in app.deployments.items()
        }

    return probe


def replica_probe() -> Probe | None:
    """The probe of the application this Serve replica belongs to; None outside Serve."""
    try:
        from ray import serve

        app_name = serve.get_replica_context().replica_id.deployment_id.app_name
    except Exception:  # noqa: BLE001 - RayServeException (not in a replica) or no Ray at all
        return None
    return serve_probe(app_name)


class AppReadiness:
    """The cached readiness of the application (see the module docstring).

    probe: deployment -> can serve (None: always ready); period_s: how often it is polled
    until the application is ready, ready_period_s: after (how late a replica that died is
    noticed); retry_after_s: the `Retry-After` of the 503s; probe_timeout_s: the longest a
    first request waits for the first answer (a request never waits longer, hence the fast 503);
    poll_timeout_s: how long one poll may take (a poll that fails or times out after the app was
    ready keeps the ready answer); on_ready: called (in the event loop) each time readiness turns
    on, e.g. to ask a deployment what the routes need of it before the first request does."""

    def __init__(
        self,
        probe: Probe | None,
        period_s: float = 0.5,
        ready_period_s: float = 2.0,
        retry_after_s: int = 5,
        probe_timeout_s: float = 0.5,
        poll_timeout_s: float = 10.0,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self._probe = probe
        self.period_s = period_s
        self.ready_period_s = ready_period_s
        self.retry_after_s = retry_after_s
        self.probe_timeout_s = probe_timeout_s
        self.poll_timeout_s = poll_timeout_s
        self.on_ready = on_ready
        self.deployments: dict[str, bool] = {}
        self._ready = probe is None
        self._began_last = float("-inf")  # when the last finished poll began
        self._served_at = float("-inf")
        self._task: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        """The last answer (True once every deployment could serve at the last poll)."""
        return self._ready

    def served(self) -> None:
        """A chat was answered (the worker streamed its first event): the deployments on its
        path can serve now, whatever a probe that began earlier says."""
        self._served_at = time.monotonic()
        if not self._ready:
            logger.info("application ready (a chat was served)")
            self._set_ready(True)

    def _set_ready(self, ready: bool) -> None:
        turned_on = ready and not self._ready
        self._ready = ready
        if turned_on and self.on_ready is not None:
            try:
                self.on_ready()
            except Exception:  # noqa: BLE001 - a hook's failure must not stop the polls
                logger.exception("readiness on_ready hook failed")

    async def _poll_once(self) -> None:
        assert self._probe is not None
        began = time.monotonic()
        try:
            states = await asyncio.wait_for(
                asyncio.to_thread(self._probe), timeout=self.poll_timeout_s
            )
        except Exception as exc:  # noqa: BLE001 - controller busy or gone
            # A slow or unreachable controller says nothing about the replicas: keep the last
            # answer once the app was ready (a busy 2-core host made a 0.5 s probe time out and
            # flipped a serving app to 503); before that, not ready.
            logger.debug("readiness probe failed: %s", exc)
            if self._ready:
                return
            states = {}
        ready = bool(states) and all(states.values())
        if not ready and began < self._served_at:  # older than a served chat: stale
            return
        if ready != self._ready:
            logger.info("application %s (%s)", "ready" if ready else "not ready", states)
        self.deployments = states
        self._set_ready(ready)

    async def _loop(self) -> None:
        while True:
            began = time.monotonic()
            await self._poll_once()
            self._began_last = began
            await asyncio.sleep(self.ready_period_s if self._ready else self.period_s)

    def start(self) -> None:
        """Start polling now if an event loop runs in this thread (the Ingress constructor in a
        Serve replica): each replica then follows the application from its own start, so two
        ingress replicas turn ready within one poll of each other, not when the first request
        reaches the second one. Without a running loop the first `check` starts it."""
        if self._probe is None or (self._task is not None and not self._task.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._task = loop.create_task(self._loop())

    async def check(self) -> bool:
        """Readiness now: starts the polling task on first use; while the answer is not ready,
        waits (at most `probe_timeout_s`) for a poll that began after this call, so a request
        reads the freshest answer, then reads the cached answer."""
        if self._probe is None:
            return True
        asked = time.monotonic()
        self.start()
        deadline = asked + self.probe_timeout_s
        while not self._ready and self._began_last < asked and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self._ready

    async def require(self) -> None:
        """NotReadyError (503, Retry-After) unless every deployment can serve."""
        if not await self.check():
            starting = sorted(n for n, ok in self.deployments.items() if not ok)
            raise NotReadyError(
                "the service is starting ("
                + (", ".join(starting) or "deployments")
                + " not ready); retry shortly",
                retry_after=self.retry_after_s,
            )
