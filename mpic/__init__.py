"""MPIC serve: position-independent multimodal context caching served with vLLM and Ray Serve.

The import package `mpic` maps the repository's top-level folders (`linker/`, `storage/`, ...) to
subpackages (`mpic.linker`, `mpic.storage`, ...); see pyproject.toml's `package-dir`.
"""

__version__ = "0.1.0"


def installed_version() -> str:
    """The installed mpic-serve distribution's version (`__version__` when not installed): what
    `mpic --version` and the API's `/version` report."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mpic-serve")
    except PackageNotFoundError:
        return __version__
