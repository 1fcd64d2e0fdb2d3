"""Process-wide defaults (all processes): where the embedded set-up keeps its files.

Subsystems keep their own config objects beside their code (e.g. `mpic.storage.config`); this
module only holds what they share. Environment variables use the `MPIC_` prefix.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class MPICHome(BaseSettings):
    """Locations of the embedded default set-up (small model, local filesystem store)."""

    model_config = SettingsConfigDict(env_prefix="MPIC_", extra="ignore")

    home: Path = Field(Path(".mpic"), description="Root folder for models, store and logs.")

    @property
    def models_dir(self) -> Path:
        """Folder holding models written by `mpic model make-tiny`."""
        return self.home / "models"

    @property
    def store_dir(self) -> Path:
        """Root of the filesystem object store (the embedded default backend)."""
        return self.home / "store"
