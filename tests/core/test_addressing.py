"""Content addresses: one entry-address recipe, a model fingerprint from the checkpoint's own
file hashes (Hugging Face cache blobs, download metadata) or one remembered hash per file."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from mpic import addressing
from mpic.addressing import entry_address, entry_key, library_fingerprint, model_fingerprint


def test_entry_address_is_the_key_of_the_context_ids() -> None:
    assert entry_address("fp", [1, 2, 3], b"img") == entry_key("fp", "ids:1,2,3", b"img")
    assert entry_address("fp", [1, 2, 3], b"img") != entry_address("fp", [1, 2], b"img")
    assert entry_address("fp", [12, 3], b"img") != entry_address("fp", [1, 23], b"img")


def test_library_fingerprint_follows_the_system_prompt() -> None:
    assert library_fingerprint("fp", None) == "fp"
    assert library_fingerprint("fp", "a") != library_fingerprint("fp", "b")


def _folder(root: Path, weights: bytes) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model.safetensors").write_bytes(weights)
    return root


def test_fingerprint_uses_hf_cache_blob_names_without_reading_weights(tmp_path: Path) -> None:
    data = b"w" * 1000
    sha = hashlib.sha256(data).hexdigest()
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / sha).write_bytes(data)
    snap = tmp_path / "snapshots" / "rev"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text('{"model_type": "llama"}')
    os.symlink(blobs / sha, snap / "model.safetensors")
    plain = _folder(tmp_path / "plain", data)
    assert addressing.file_sha256(snap / "model.safetensors") == sha
    assert model_fingerprint(snap) == model_fingerprint(plain)


def test_fingerprint_uses_download_metadata(tmp_path: Path) -> None:
    data = b"v" * 100
    root = _folder(tmp_path / "m", data)
    meta = root / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    recorded = "a" * 64  # the checkpoint's own record wins: the bytes are not read
    (meta / "model.safetensors.metadata").write_text(f"rev\n{recorded}\n123.0\n")
    assert addressing.file_sha256(root / "model.safetensors") == recorded


def test_computed_hash_is_remembered_and_follows_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MPIC_CACHE_DIR", str(tmp_path / "cache"))
    addressing._remembered_sha256.cache_clear()
    root = _folder(tmp_path / "m", b"x" * 4096)
    first = model_fingerprint(root)
    assert len(list((tmp_path / "cache" / "sha256").iterdir())) == 1
    addressing._remembered_sha256.cache_clear()
    assert model_fingerprint(root) == first  # from the remembered record
    (root / "model.safetensors").write_bytes(b"x" * 4095 + b"y")
    assert model_fingerprint(root) != first
