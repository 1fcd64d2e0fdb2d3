"""HTTP client of the serving app's dynamic-library admin routes (CLI process: `mpic-admin library
... --server URL`). The routes live on the Ingress (`/v1/admin/collections...`, admin key
required) and run on the Retriever replica, so a refresh computes entries with the serving
engine. The server has no search route: `search` works on the store only.
"""

from __future__ import annotations

from typing import Any

import httpx

from mpic.errors import InvalidRequestError, MPICError


class AdminClient:
    """list / versions / refresh / rollback over HTTP; errors come back as MPICError."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float = 600.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        try:
            resp = self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise InvalidRequestError(f"cannot reach {self._http.base_url}: {exc}") from exc
        if resp.is_success:
            return resp.json()
        try:
            detail = resp.json()["error"]
            message, code = detail["message"], detail.get("code")
        except (ValueError, KeyError, TypeError):
            message, code = resp.text[:200], None
        err = MPICError(f"server answered {resp.status_code}: {message}")
        err.status, err.code = resp.status_code, code or err.code
        raise err

    def collections(self) -> list[dict[str, Any]]:
        """[{"collection", "current", "items"}] of every collection."""
        return self._call("GET", "/v1/admin/collections")["data"]

    def versions(self, collection: str) -> dict[str, Any]:
        """{"collection", "versions" (oldest first), "current"}."""
        return self._call("GET", f"/v1/admin/collections/{collection}/versions")

    def refresh(self, collection: str, source: str, captions: str | None) -> dict[str, Any]:
        """New version from a folder or S3 prefix the SERVER can read; returns its report."""
        return self._call(
            "POST",
            f"/v1/admin/collections/{collection}/refresh",
            {"source": source, "captions": captions},
        )

    def rollback(self, collection: str, version: str) -> dict[str, Any]:
        """{"collection", "current"} after making `version` current again."""
        return self._call(
            "POST", f"/v1/admin/collections/{collection}/rollback", {"version": version}
        )

    def sweep(self, grace_s: float | None = None) -> dict[str, Any]:
        """Run the server's file sweeper now (`grace_s`: this sweep's grace, 0 honoured; None:
        the server's); its report (expired ids, blobs deleted)."""
        body = {} if grace_s is None else {"grace_s": grace_s}
        return self._call("POST", "/v1/admin/sweep", body)
