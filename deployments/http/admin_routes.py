"""The `/v1/admin/*` routes (Ingress replica; admin keys only): run the file sweeper now, and the
dynamic-library collections: list them, list one's versions, refresh one from a source folder or
prefix (only under the configured `admin_sources`), roll one back. The work is done by the LLM
worker (sweep) and the Retriever (collections); `mpic-admin` drives these routes.

They are methods of `AdminRoutes`, a base class of the `Ingress` (Serve builds the routes of every
class in the ingress's MRO), on `router`, which the ingress's FastAPI app includes; their bodies
are defined here.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header
from pydantic import BaseModel, ConfigDict, Field

from mpic.deployments.http.auth import KeyRing
from mpic.retriever.sources import allowed_source

router = APIRouter()


class RefreshBody(BaseModel):
    """`POST /v1/admin/collections/{name}/refresh`."""

    model_config = ConfigDict(extra="forbid", strict=True)
    source: str = Field(description="Folder or s3:// prefix holding the collection's images.")
    captions: str | None = Field(None, description="Optional captions JSONL (file, caption).")


class SweepBody(BaseModel):
    """`POST /v1/admin/sweep` (optional body)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    grace_s: float | None = Field(
        None,
        ge=0,
        le=10**9,
        description="This sweep's grace in seconds (0 honoured); "
        "absent: the server's store.sweep_grace_s.",
    )


class RollbackBody(BaseModel):
    """`POST /v1/admin/collections/{name}/rollback`."""

    model_config = ConfigDict(extra="forbid", strict=True)
    version: str = Field(description="The version to make current again.")


class AdminRoutes:
    """The admin routes; mixed into `Ingress` (uses its `cfg`, `_auth`, `readiness`, `worker`
    and `retriever`)."""

    @router.post("/v1/admin/sweep")
    async def admin_sweep(
        self,
        body: SweepBody | None = None,
        authorization: Annotated[str | None, Header()] = None,
    ):
        """Admin: run the file sweeper now (expire, release, delete unreferenced blobs older
        than `grace_s`, default the server's)."""
        KeyRing.require_admin(self._auth(authorization))
        await self.readiness.require()  # the worker / retriever may still be starting
        return await self.worker.sweep.remote(body.grace_s if body else None)

    @router.get("/v1/admin/collections")
    async def admin_collections(self, authorization: Annotated[str | None, Header()] = None):
        """Admin: dynamic-library collections and their current versions."""
        KeyRing.require_admin(self._auth(authorization))
        await self.readiness.require()  # the worker / retriever may still be starting
        return await self.retriever.collections.remote()

    @router.get("/v1/admin/collections/{name}/versions")
    async def admin_versions(
        self, name: str, authorization: Annotated[str | None, Header()] = None
    ):
        """Admin: the versions of one collection, newest last."""
        KeyRing.require_admin(self._auth(authorization))
        await self.readiness.require()  # the worker / retriever may still be starting
        return await self.retriever.versions.remote(name)

    @router.post("/v1/admin/collections/{name}/refresh")
    async def admin_refresh(
        self,
        name: str,
        body: RefreshBody,
        authorization: Annotated[str | None, Header()] = None,
    ):
        """Admin: build a new version from a source folder/prefix and swap it in atomically."""
        KeyRing.require_admin(self._auth(authorization))
        await self.readiness.require()  # the worker / retriever may still be starting
        roots = self.cfg.admin_sources
        source = allowed_source(body.source, roots)
        captions = allowed_source(body.captions, roots, "captions") if body.captions else None
        return await self.retriever.refresh.remote(name, source, captions)

    @router.post("/v1/admin/collections/{name}/rollback")
    async def admin_rollback(
        self,
        name: str,
        body: RollbackBody,
        authorization: Annotated[str | None, Header()] = None,
    ):
        """Admin: make an earlier version current again."""
        KeyRing.require_admin(self._auth(authorization))
        await self.readiness.require()  # the worker / retriever may still be starting
        return await self.retriever.rollback.remote(name, body.version)
