"""CLIP embedder on open_clip: images, text passages and text queries to L2-normalised vectors
in CLIP's shared image-text space (MPIC section 3.1, component 4, the retriever's "relocation
table" keys), so one index holds images and passages and a text query finds both.

Runs in the CLI process (`mpic-admin library refresh/search`) and in the Serve replica that
answers retrieval. Weights come from a local file or an object-store key; with neither, the model
is built with random weights from a fixed seed, so two processes building the same config get the
same embedder (tests and the embedded default use the tiny `mpic-tiny-clip` config shipped in
`retriever/configs/`; nothing is downloaded).
"""

from __future__ import annotations

import hashlib
import io
import logging
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from mpic.errors import InvalidRequestError, UnreadableMediaError

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).parent / "configs"
"""open_clip model configs shipped with the package (registered on first use)."""


class EmbedderConfig(BaseModel):
    """Which CLIP model to build and where its weights come from."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("mpic-tiny-clip", description="open_clip model name (built-in or shipped).")
    weights: str | None = Field(
        None, description="Local weights file (open_clip checkpoint); None: random weights."
    )
    weights_key: str | None = Field(
        None, description="Object-store key of the weights file (instead of `weights`)."
    )
    seed: int = Field(0, description="Seed of the random init used when no weights are given.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when present.")
    batch_size: int = Field(32, ge=1, description="Images/texts per forward pass.")


def _register_shipped_configs() -> None:
    import open_clip

    if "mpic-tiny-clip" not in open_clip.list_models():
        open_clip.add_model_config(CONFIG_DIR)


class _IntendedRandomInit(logging.Filter):
    """Drops open_clip's root-logger warning about random weights when they are intended."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "No pretrained weights loaded" not in record.getMessage()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class ClipEmbedder:
    """A loaded open_clip model with its preprocessing and tokenizer.

    `fingerprint` identifies model + weights: vectors from embedders with different fingerprints
    are not comparable, so a refresh re-embeds everything when it changes.
    """

    def __init__(self, cfg: EmbedderConfig, get_bytes: Callable[[str], bytes] | None = None):
        """Build the model. `get_bytes(key)` reads `cfg.weights_key` from the object store."""
        import open_clip

        _register_shipped_configs()
        if cfg.model not in open_clip.list_models():
            raise InvalidRequestError(f"unknown open_clip model {cfg.model!r}", param="model")
        if cfg.weights and cfg.weights_key:
            raise InvalidRequestError("give `weights` or `weights_key`, not both", param="weights")
        self.cfg = cfg
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
        )
        with tempfile.TemporaryDirectory() as tmp:
            weights = self._weights_file(cfg, get_bytes, Path(tmp))
            source = f"sha256:{_file_sha256(weights)}" if weights else f"random:{cfg.seed}"
            quiet = _IntendedRandomInit()
            logging.getLogger().addFilter(quiet)
            try:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(cfg.seed)
                    model, _, preprocess = open_clip.create_model_and_transforms(
                        cfg.model, pretrained=str(weights) if weights else None, device=self.device
                    )
            finally:
                logging.getLogger().removeFilter(quiet)
        self.fingerprint = hashlib.sha256(f"{cfg.model}|{source}".encode()).hexdigest()[:16]
        self.model = model.eval()
        self.preprocess = preprocess
        self.tokenizer = open_clip.get_tokenizer(cfg.model)
        self.dim = int(open_clip.get_model_config(cfg.model)["embed_dim"])
        logger.info("CLIP %s on %s (dim %d, %s)", cfg.model, self.device, self.dim, source)

    @staticmethod
    def _weights_file(
        cfg: EmbedderConfig, get_bytes: Callable[[str], bytes] | None, tmp: Path
    ) -> Path | None:
        if cfg.weights:
            path = Path(cfg.weights)
            if not path.is_file():
                raise InvalidRequestError(f"CLIP weights file not found: {path}", param="weights")
            return path
        if cfg.weights_key:
            if get_bytes is None:
                raise InvalidRequestError("`weights_key` needs an object store", param="weights")
            path = tmp / "clip_weights.pt"
            path.write_bytes(get_bytes(cfg.weights_key))
            return path
        return None

    @torch.inference_mode()
    def _encode(self, items: Sequence, to_batch: Callable, encode: Callable) -> np.ndarray:
        """Run `encode` over batches of `items`; rows are L2-normalised. Returns float32 [n, d]."""
        out = []
        for start in range(0, len(items), self.cfg.batch_size):
            batch = to_batch(items[start : start + self.cfg.batch_size]).to(self.device)
            out.append(torch.nn.functional.normalize(encode(batch).float(), dim=-1).cpu())
        if not out:
            return np.zeros((0, self.dim), dtype=np.float32)
        return torch.cat(out).numpy()

    def embed_images(
        self, images: Sequence[bytes], names: Sequence[str] | None = None
    ) -> np.ndarray:
        """Encoded image files (PNG, JPEG...) -> float32 [n, d], unit rows.

        Raises UnreadableMediaError naming (by `names`, else index) the first that does not decode.
        """
        names = names or [str(i) for i in range(len(images))]
        pixels = [
            self.preprocess(decode_image(data, name))
            for data, name in zip(images, names, strict=True)
        ]
        return self._encode(pixels, torch.stack, self.model.encode_image)

    def embed_texts(self, texts: Sequence[str]) -> np.ndarray:
        """Strings -> float32 [n, d], unit rows (queries: the tokenizer truncates each to the
        text tower's context, 77 tokens for CLIP)."""
        return self._encode(list(texts), self.tokenizer, self.model.encode_text)

    def embed_passages(
        self, texts: Sequence[str], names: Sequence[str] | None = None
    ) -> np.ndarray:
        """Text passages of any length -> float32 [n, d], unit rows (library passages).

        The text tower reads at most C tokens (C = context_length: 77 for CLIP, 32 for
        mpic-tiny-clip), so a passage's BPE tokens are cut into windows of C - 2 (between the
        start and end tokens), every window is encoded, and the passage's vector is the
        normalised mean of its windows' unit vectors: v = normalize(sum_w u_w / W). A passage
        that fits in one window gets exactly `embed_texts`' vector. Tokenizers without
        open_clip's BPE interface (HF, SigLIP) embed the first window only (their own
        truncation). InvalidRequestError naming (by `names`, else index) a passage with no
        tokens.
        """
        names = names or [str(i) for i in range(len(texts))]
        tok = self.tokenizer
        bpe = hasattr(tok, "encode") and getattr(tok, "reduction_fn", None) is None
        tokens = [tok.encode(t) if bpe else t.strip() for t in texts]
        for got, name in zip(tokens, names, strict=True):
            if not got:
                raise InvalidRequestError(f"{name}: the passage has no text", param="source")
        if not bpe:
            return self.embed_texts(texts)
        ctx = tok.context_length
        windows: list[torch.Tensor] = []
        owner: list[int] = []
        for i, ids in enumerate(tokens):
            for start in range(0, len(ids), ctx - 2):
                row = torch.zeros(ctx, dtype=torch.long)
                chunk = [tok.sot_token_id, *ids[start : start + ctx - 2], tok.eot_token_id]
                row[: len(chunk)] = torch.tensor(chunk)
                windows.append(row)
                owner.append(i)
        units = self._encode(windows, torch.stack, self.model.encode_text)  # [windows, d]
        sums = np.zeros((len(texts), self.dim), dtype=np.float32)
        np.add.at(sums, np.asarray(owner, dtype=np.int64), units)
        return sums / np.linalg.norm(sums, axis=1, keepdims=True)


def decode_image(data: bytes, name: str = "image"):
    """Bytes -> RGB PIL image; UnreadableMediaError if they are not a decodable image."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.convert("RGB")
    except Exception as exc:  # PIL raises several types for bad data
        raise UnreadableMediaError(f"{name}: not a decodable image ({exc})") from exc
