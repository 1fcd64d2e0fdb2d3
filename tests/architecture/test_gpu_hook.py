"""The conftest hook skips `gpu`-marked tests without CUDA and leaves the others alone, so gpu
tests carry no skipif of their own."""

from __future__ import annotations

import pytest
import torch

from tests import conftest


class _Item:
    def __init__(self, marks: list[str]) -> None:
        self.marks = [getattr(pytest.mark, m) for m in marks]
        self.added: list = []

    def get_closest_marker(self, name: str):  # noqa: ANN201
        return next((m.mark for m in self.marks if m.mark.name == name), None)

    def add_marker(self, marker) -> None:  # noqa: ANN001
        self.added.append(marker)


@pytest.mark.parametrize("cuda", [False, True])
def test_gpu_tests_skip_without_cuda(monkeypatch, cuda: bool) -> None:  # noqa: ANN001
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    gpu, cpu, slow_gpu = _Item(["gpu"]), _Item([]), _Item(["slow", "gpu"])
    conftest.pytest_collection_modifyitems(None, [gpu, cpu, slow_gpu])
    assert cpu.added == []
    for item in (gpu, slow_gpu):
        assert [m.name for m in item.added] == ([] if cuda else ["skip"])


def test_no_gpu_test_repeats_the_skip() -> None:
    """The files moved to the hook keep no skipif of their own."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [*sorted((root / "kernels").glob("test_*.py"))]
    files += [
        root / "engine/hf/test_reference_runner_gpu.py",
        root / "engine/vllm/connector/test_paged_kv_layout.py",
    ]
    for path in files:
        assert "skipif(not torch.cuda.is_available()" not in path.read_text(), path
