"""Whether vLLM's CPU ops are built here (tests that call them directly skip where not)."""

import torch


def vllm_cpu_op_built(name: str) -> bool:
    """True when `torch.ops._C.<name>` is registered after importing vLLM's op bindings."""
    try:
        from vllm import _custom_ops  # noqa: F401

        getattr(torch.ops._C, name)  # raises if not registered
    except (ImportError, AttributeError, RuntimeError):
        return False
    return True
