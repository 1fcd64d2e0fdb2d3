"""The Ray Serve application, in rooms by process and concern:

- `app.py` builds the deployment graph from ONE `ServeAppConfig` (`config.py`); `local.py` starts
  it on a local Ray instance (`local_runs.py`: that instance's processes, recorded, ended, kept on
  the loopback); `messages.py` holds the torch-free messages every deployment exchanges, and
  `client_errors.py` how a client error (4xx) crosses a hop: as a value, not a replica failure.
- `http/`: the HTTP surface (Ingress replica).
- `serve/`: the deployments behind it (Resolver, Encoder, LLM worker, Retriever), the file catalog,
  admission and the cache-aware router.
- `monitoring/`: metrics and the live fidelity guarantee.
- `engines/`: the serve engines the Encoder and LLM-worker replicas drive (reference, vLLM, fake).

Modules that lived flat in this package before the rooms still import under their old names
(`mpic.deployments.http.ingress` is `mpic.deployments.http.ingress`, the same module object), with a
DeprecationWarning; `MOVED` lists them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED: dict[str, str] = {
    **{
        name: f"mpic.deployments.http.{name}"
        for name in (
            "ingress",
            "schemas",
            "completion_schemas",
            "vllm_routes",
            "http_errors",
            "auth",
            "shedding",
            "readiness",
            "chat_client",
        )
    },
    **{
        name: f"mpic.deployments.serve.{name}"
        for name in (
            "resolver",
            "workers",
            "retriever",
            "router",
            "admission",
            "files",
        )
    },
    **{
        name: f"mpic.deployments.monitoring.{name}"
        for name in ("metrics", "vllm_metrics", "fidelity_monitor", "fidelity_control")
    },
    **{
        name: f"mpic.deployments.engines.{name}"
        for name in (
            "engine",
            "reference_engine",
            "vllm_serve_engine",
            "fake_engine",
            "prompting",
            "tokenization",
        )
    },
    "token_bytes": "mpic.engine.token_bytes",
}
"""Old flat module name -> where it lives now."""


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `mpic.deployments.<old>` as the module it moved to (one object, two names)."""

    def find_spec(self, fullname, path=None, target=None):
        head, _, name = fullname.rpartition(".")
        if head != __name__ or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name.rpartition(".")[2]]
        warnings.warn(f"{spec.name} moved to {new}", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        """Nothing to run: the module was executed under its new name."""


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
