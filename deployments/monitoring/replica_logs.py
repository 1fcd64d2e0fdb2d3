"""The project's log lines in a Serve replica (every replica's process, from its constructor).

Serve configures only its own `ray.serve` logger in a replica: the replica's log file under the
Ray session's `logs/serve/` and stderr (which Ray forwards to the driver's console), each line
with the request id, deployment and replica (JSON with `log_encoding: JSON`). Other loggers fall
to Python's last-resort handler: WARNING and up, bare messages on stderr, INFO dropped.
`use_serve_logging()` hands the `mpic` loggers to Serve's handlers at Serve's level, so their
lines (a client error answered, a fallback, an engine death) carry the request id too. Outside a
replica (the in-process test harness, a driver) it does nothing.
"""

from __future__ import annotations

import logging

SERVE_LOGGER = "ray.serve"


def use_serve_logging(name: str = "mpic") -> bool:
    """Route the `name` loggers through this replica's Serve log handlers; False outside a
    Serve replica."""
    try:
        from ray import serve

        serve.get_replica_context()
    except Exception:  # noqa: BLE001 - RayServeException outside a replica, or no Ray
        return False
    serve_logger = logging.getLogger(SERVE_LOGGER)
    ours = logging.getLogger(name)
    ours.handlers = list(serve_logger.handlers)
    ours.setLevel(serve_logger.level)
    ours.propagate = False
    return True
