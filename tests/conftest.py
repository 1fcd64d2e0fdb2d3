"""Shared pytest set-up. Fixtures live in tests/fixtures/<topic>.py, one module per topic,
registered here so every test directory sees them. Tests marked `gpu` are skipped here when no
CUDA device is present (no per-test skipif)."""

from __future__ import annotations

import pytest

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.s3",
    "tests.fixtures.trained",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every `gpu`-marked test without CUDA (torch is imported only if one is collected)."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: no CUDA device")
    for item in gpu:
        item.add_marker(skip)
