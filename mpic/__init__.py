"""MPIC serve: position-independent multimodal context caching served with vLLM and Ray Serve.

The import package `mpic` maps the repository's top-level folders (`linker/`, `storage/`, ...) to
subpackages (`mpic.linker`, `mpic.storage`, ...); see pyproject.toml's `package-dir`.
"""

__version__ = "0.1.0"
