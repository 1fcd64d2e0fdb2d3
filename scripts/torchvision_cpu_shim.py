"""Start-up shim for CPU torch + PyPI torchvision (the one documented import-time workaround).

PyPI's torchvision 0.28 is a CUDA build: on CPU torch its C ops (torchvision::nms, ...) never
register, and `import torchvision` dies in `torch.library.register_fake("torchvision::nms")`.
vLLM's LLaVA/Qwen2-VL code and open_clip's transforms import torchvision's Python parts
(transforms, image ops), which do not need those C ops.

scripts/setup.sh copies this file into the venv's site-packages with a `.pth` line that imports it,
and only on machines whose torch is a CPU build. It installs a meta-path hook that does nothing
until `torchvision` is first imported; then, if torch has no CUDA, it makes `register_fake`
skip operators that do not exist instead of raising. Nothing else is touched.
"""

from __future__ import annotations

import importlib.abc
import sys


def _tolerate_missing_ops() -> None:
    import torch
    import torch.library

    if torch.version.cuda is not None:
        return
    original = torch.library.register_fake

    def register_fake(op, func=None, /, *args, **kwargs):
        def apply(fn):
            try:
                return original(op, fn, *args, **kwargs)
            except RuntimeError as exc:
                if "does not exist" not in str(exc):
                    raise
                return fn

        return apply if func is None else apply(func)

    torch.library.register_fake = register_fake


class _TorchvisionImportHook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            _tolerate_missing_ops()
        return None


sys.meta_path.insert(0, _TorchvisionImportHook())
