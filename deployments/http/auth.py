"""Bearer API keys -> users (Ingress replica).

Keys come from `MPIC_API_KEYS` (JSON object key -> user id), `MPIC_ADMIN_KEYS` (JSON list of keys,
which must also be in the key map or are mapped to user "admin"), and an optional keys file
(`{"api_keys": {...}, "admin_keys": [...]}`, YAML or JSON). Closed by default: production mode has
no built-in keys (no key configured: every request 401); dev mode (the embedded default started by
`mpic serve` with no config) adds the documented `DEV_KEYS` ONLY when no key is configured at all,
with a loud WARNING at start, so `mpic demo` works out of the box but a server given real keys
never accepts the public ones.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from mpic.deployments.config import AuthConfig
from mpic.errors import AuthenticationError, InvalidRequestError, PermissionDeniedError

logger = logging.getLogger(__name__)

DEV_KEYS: dict[str, str] = {"mpic-dev-alice": "alice", "mpic-dev-bob": "bob"}
"""Dev-mode user keys (documented in docs/serving.md; never active in production mode)."""
DEV_ADMIN_KEY = "mpic-dev-admin"
"""Dev-mode admin key (user "admin")."""


@dataclass(frozen=True)
class Principal:
    """The caller behind a key."""

    user: str
    is_admin: bool


class KeyRing:
    """The key table of one ingress replica; lookups compare in constant time."""

    def __init__(self, api_keys: Mapping[str, str], admin_keys: set[str]) -> None:
        self._users = dict(api_keys)
        for key in admin_keys:
            self._users.setdefault(key, "admin")
        self._admin = set(admin_keys)

    @classmethod
    def from_config(cls, cfg: AuthConfig, env: Mapping[str, str] | None = None) -> KeyRing:
        """Merge environment, keys file and (dev mode only) the dev keys."""
        env = os.environ if env is None else env
        keys: dict[str, str] = {}
        admin: set[str] = set()
        if cfg.keys_file:
            data = _load_keys_file(Path(cfg.keys_file))
            keys.update(_as_key_map(data.get("api_keys", {}), "keys file api_keys"))
            admin.update(_as_key_list(data.get("admin_keys", []), "keys file admin_keys"))
        if env.get("MPIC_API_KEYS"):
            keys.update(_as_key_map(_json(env["MPIC_API_KEYS"], "MPIC_API_KEYS"), "MPIC_API_KEYS"))
        if env.get("MPIC_ADMIN_KEYS"):
            raw = _json(env["MPIC_ADMIN_KEYS"], "MPIC_ADMIN_KEYS")
            admin.update(_as_key_list(raw, "MPIC_ADMIN_KEYS"))
        if cfg.mode == "dev":
            if keys or admin:
                logger.warning(
                    "auth: API keys are configured, so the public dev keys are DISABLED "
                    "(auth.mode dev only applies when no key is configured)"
                )
            else:
                logger.warning(
                    "auth: NO API KEYS CONFIGURED - the PUBLIC dev keys %s and the dev ADMIN key "
                    "are active. Anyone who can reach this server can use them. Set "
                    "MPIC_API_KEYS / MPIC_ADMIN_KEYS or auth.keys_file before exposing it.",
                    ", ".join(sorted(DEV_KEYS)),
                )
                keys.update(DEV_KEYS)
                admin.add(DEV_ADMIN_KEY)
        return cls(keys, admin)

    def __len__(self) -> int:
        return len(self._users)

    def authenticate(self, authorization: str | None) -> Principal:
        """`Authorization: Bearer <key>` -> Principal; AuthenticationError (401) otherwise."""
        if not authorization or not authorization.lower().startswith("bearer "):
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
        # only HTTP's own whitespace (space, tab) around the token is dropped: str.strip() would
        # also drop U+00A0 / U+0085 and let "key\xa0" authenticate as "key"
        presented = _wire_bytes(authorization[7:].strip(" \t"))
        found: Principal | None = None
        for key, user in self._users.items():  # every key compared: time does not tell which
            if hmac.compare_digest(_exact_bytes(key), presented) and found is None:
                found = Principal(user=user, is_admin=key in self._admin)
        if found is None:
            raise AuthenticationError("unknown API key")
        return found

    @staticmethod
    def require_admin(principal: Principal) -> None:
        """PermissionDeniedError (403) unless the key is an admin key."""
        if not principal.is_admin:
            raise PermissionDeniedError("this route needs an admin key")


def _exact_bytes(text: str) -> bytes:
    """A configured key's bytes as compared (UTF-8; a lone surrogate kept as its own bytes)."""
    return text.encode("utf-8", "surrogatepass")


def _wire_bytes(text: str) -> bytes:
    """The presented key's bytes as they came on the wire (ASGI servers decode header bytes as
    latin-1), so a UTF-8 key matches only its own UTF-8 bytes."""
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:  # not from an HTTP header (a direct call)
        return _exact_bytes(text)


def _json(text: str, what: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{what} is not valid JSON: {exc}") from exc


def _load_keys_file(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidRequestError(f"cannot read keys file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequestError(f"keys file {path} must hold a mapping")
    return data


def _as_key_map(raw: object, what: str) -> dict[str, str]:
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and k and isinstance(v, str) and v for k, v in raw.items()
    ):
        raise InvalidRequestError(f"{what} must be a JSON object of non-empty key -> user strings")
    return dict(raw)


def _as_key_list(raw: object, what: str) -> set[str]:
    if not isinstance(raw, list) or not all(isinstance(k, str) and k for k in raw):
        raise InvalidRequestError(f"{what} must be a JSON list of non-empty key strings")
    return set(raw)
