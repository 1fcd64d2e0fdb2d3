"""Entry codec: exact round trips, safetensors compatibility, corruption always detected."""

from __future__ import annotations

import io

import pytest
import safetensors.torch
import torch

from mpic.addressing import entry_key
from mpic.errors import CorruptEntryError
from mpic.storage.entry_codec import decode, encode, read_entry
from tests.storage.synthetic import assert_same, make_entry


class _Stream:
    def __init__(self, data: bytes, size: int | None = None) -> None:
        self._f, self.size = io.BytesIO(data), len(data) if size is None else size

    def readinto(self, buf: memoryview) -> int:
        return self._f.readinto(buf)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mrope", [False, True])
def test_round_trip_exact(dtype: torch.dtype, mrope: bool) -> None:
    e = make_entry(1, dtype=dtype, mrope=mrope)
    blob = encode(e)
    assert_same(decode(blob), e)
    entry, buf = read_entry(_Stream(blob))
    assert_same(entry, e)
    assert bytes(buf) == blob
    assert decode(blob).positions.shape == ((3, 16) if mrope else (16,))


def test_blob_is_plain_safetensors() -> None:
    e = make_entry(2)
    loaded = safetensors.torch.load(encode(e))
    assert torch.equal(loaded["keys"], e.keys) and torch.equal(
        loaded["input_embeds"], e.input_embeds
    )


def test_empty_extra_tokens_zero() -> None:
    e = make_entry(3, tokens=0)
    assert decode(encode(e)).num_tokens == 0


@pytest.mark.parametrize("check", ["blake3", "xxh3_128"])
@pytest.mark.parametrize("where", ["header", "data_first", "data_last"])
def test_bit_flip_detected(where: str, check: str) -> None:
    blob = bytearray(encode(make_entry(4)))
    assert_same(decode(blob, check=check), make_entry(4))
    n = int.from_bytes(blob[:8], "little")
    pos = {"header": 8 + n // 2, "data_first": 8 + n, "data_last": len(blob) - 1}[where]
    blob[pos] ^= 0x10
    with pytest.raises(CorruptEntryError):
        decode(blob, check=check)
    with pytest.raises(CorruptEntryError):
        read_entry(_Stream(bytes(blob)))


@pytest.mark.parametrize("cut", [0, 5, 20, -1, -100])
def test_truncation_detected(cut: int) -> None:
    blob = encode(make_entry(5))
    short = blob[:cut] if cut >= 0 else blob[:cut]
    with pytest.raises(CorruptEntryError):
        decode(short)
    with pytest.raises(CorruptEntryError):
        read_entry(_Stream(short))
    with pytest.raises(CorruptEntryError):  # stream shorter than its announced size
        read_entry(_Stream(short, size=len(blob)))


@pytest.mark.parametrize("garbage", [b"", b"\x00" * 64, b"\xff" * 64, b"not an entry at all!"])
def test_garbage_rejected(garbage: bytes) -> None:
    with pytest.raises(CorruptEntryError):
        decode(garbage)


def test_other_safetensors_file_rejected() -> None:
    with pytest.raises(CorruptEntryError):
        decode(safetensors.torch.save({"keys": torch.zeros(2)}))


def test_entry_key_is_content_address() -> None:
    k = entry_key("fp", "ctx", b"img")
    assert len(k) == 64 and int(k, 16) >= 0
    assert k == entry_key("fp", "ctx", b"img")
    assert (
        len(
            {
                k,
                entry_key("fp2", "ctx", b"img"),
                entry_key("fp", "ctx2", b"img"),
                entry_key("fp", "ctx", b"img2"),
                entry_key("fpc", "tx", b"img"),
            }
        )
        == 5
    )


@pytest.mark.parametrize("check", ["blake3", "xxh3_128"])
def test_metadata_tampering_detected(check: str) -> None:
    """Valid JSON with other metadata (id, extra, layout) never decodes as a different entry."""
    e = make_entry(6, mrope=True)
    blob = encode(e)
    for old, new in (
        (e.entry_id[:12].encode(), b"0" * 12),
        (b"[1, 4, 4]", b"[1, 4, 5]"),
        (b'"shape":[2,16,2,8]', b'"shape":[2,16,8,2]'),
    ):
        assert blob.count(old) >= 1, old
        with pytest.raises(CorruptEntryError):
            decode(blob.replace(old, new, 1), check=check)
