"""Reference markers and the blob garbage collector shared by the static and dynamic libraries
(Serve replicas, the admin CLI, the sweeper).

A blob (`media/<sha256>` or an entry) is referenced by one empty marker object per holder:
`refs/<blob key>/<holder>`. Markers instead of counters: S3 has no atomic increment, and
put/delete of distinct keys never conflict between nodes. Releasing a holder writes a candidate
`gc/<blob key>`; the sweeper deletes a candidate blob once no marker remains and the blob is older
than a grace period (so an upload that is re-using the blob right now keeps it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from mpic.storage.object_store import ObjectNotFoundError, ObjectStore

log = logging.getLogger(__name__)

REFS, GC = "refs/", "gc/"


def add_ref(store: ObjectStore, blob_key: str, holder: str) -> None:
    """Record that `holder` uses `blob_key`."""
    store.put(f"{REFS}{blob_key}/{holder}", b"")


def drop_ref(store: ObjectStore, blob_key: str, holder: str) -> None:
    """Release `holder`'s use of `blob_key`; the blob becomes a GC candidate."""
    store.put(f"{GC}{blob_key}", b"")
    store.delete(f"{REFS}{blob_key}/{holder}")


def holders(store: ObjectStore, blob_key: str) -> list[str]:
    """Holders that reference `blob_key`."""
    prefix = f"{REFS}{blob_key}/"
    return [k[len(prefix) :] for k in store.list(prefix)]


def collect(store: ObjectStore, grace_s: float, delete_blob: Callable[[str], None]) -> list[str]:
    """Delete every candidate blob with no holder that is older than `grace_s` (blob mtime vs the
    wall clock); returns the deleted blob keys. `delete_blob` removes the blob and cached copies."""
    now = time.time()
    deleted = []
    for cand in list(store.list(GC)):
        blob_key = cand[len(GC) :]
        if holders(store, blob_key):
            store.delete(cand)
            continue
        try:
            age = now - store.stat(blob_key).mtime
        except ObjectNotFoundError:
            store.delete(cand)
            continue
        if age < grace_s:
            continue
        delete_blob(blob_key)
        store.delete(cand)
        deleted.append(blob_key)
        log.info("gc: deleted unreferenced blob %s", blob_key)
    return deleted
