"""A model folder given as a local path or an S3 prefix, as a local folder (any process that
loads a model: CLI, benchmark, Serve replica, vLLM's engine; both backends use it).

An S3 prefix (`s3://bucket/prefix?endpoint=host:port`, the store's URL form, keys from
MPIC_S3_ACCESS_KEY / MPIC_S3_SECRET_KEY) is copied once into `MPICHome().models_dir /
"s3-<hash>"`; a file whose size already matches is not fetched again.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from urllib.parse import urlparse

logger = logging.getLogger(__name__)


def resolve_model_dir(path: str | os.PathLike[str], cache_root: Path | None = None) -> str:
    """A local folder for `path`: itself, or the local copy of an `s3://` prefix (downloaded
    into `cache_root`, default `MPICHome().models_dir`). FileNotFoundError for an empty prefix."""
    text = str(path)
    if not text.startswith("s3://"):
        return text
    from mpic.config import MPICHome
    from mpic.storage.factory import make_object_store
    from mpic.storage.object_store import check_key

    u = urlparse(text)
    name = hashlib.sha256(f"{u.netloc}/{u.path.strip('/')}".encode()).hexdigest()[:16]
    local = (cache_root or MPICHome().models_dir) / f"s3-{name}"
    store = make_object_store(text)
    try:
        keys = sorted(store.list(""))
        if not keys:
            raise FileNotFoundError(f"{u.netloc}/{u.path.strip('/')}: no model files under it")
        for key in keys:
            target = local / check_key(key)  # no '..': never written outside `local`
            size = store.stat(key).size
            if target.is_file() and target.stat().st_size == size:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.part")
            partial.write_bytes(store.get(key))
            partial.replace(target)
    finally:
        store.close()
    logger.info("model %s copied to %s", f"s3://{u.netloc}{u.path}", local)
    return str(local)
