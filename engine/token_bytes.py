"""The raw bytes of one token id, for OpenAI's `logprobs.content[].bytes` (any process that
streams logprobs: the reference and vLLM engines in an LLM-worker replica).

Decoding a single token to text loses bytes: a byte-level BPE token that holds one byte of a
multi-byte character (the tiny Qwen2-VL tokenizer's id 130 is byte 0xBE) decodes to U+FFFD,
whose UTF-8 is [239, 191, 189], while a client that rebuilds characters from `bytes` needs
[190]. `TokenBytes` maps an id to its bytes from the vocabulary itself:

- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2: the tokenizer's decoder is `ByteLevel`): every
  character of the token string stands for one byte through GPT-2's `bytes_to_unicode` table;
- SentencePiece byte fallback (`<0xBE>`): that byte;
- SentencePiece pieces (`▁word`, Metaspace decoder): the piece's text with `▁` as a space;
- anything else (special tokens, added tokens): the UTF-8 of `tokenizer.decode([id])`.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's `bytes_to_unicode` table inverted: printable character -> the byte it stands
    for (printable bytes stand for themselves; the other 68 are shifted to U+0100 and up)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_kind(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = repr(getattr(backend, "decoder", None)) if backend is not None else ""
    if "ByteLevel" in text:
        return "byte-level"
    if "Metaspace" in text or "ByteFallback" in text or getattr(tokenizer, "sp_model", None):
        return "sentencepiece"
    return "text"


class TokenBytes:
    """`token_bytes(id) -> bytes` for one tokenizer (cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.kind = _decoder_kind(tokenizer)
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        out = self._cache.get(token_id)
        if out is None:
            out = self._cache[token_id] = self._bytes(token_id)
        return out

    def _text(self, token_id: int) -> bytes:
        return self.tokenizer.decode([token_id]).encode("utf-8")

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self.special:
            return self._text(token_id)
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str) or not piece:
            return self._text(token_id)
        if (m := _BYTE_FALLBACK.match(piece)) is not None:
            return bytes([int(m[1], 16)])
        if self.kind == "byte-level":
            table = byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return self._text(token_id)  # an added token spelled outside the byte table
        if self.kind == "sentencepiece":
            return piece.replace("\u2581", " ").encode("utf-8")
        return self._text(token_id)
