"""Attention backends (`mpic.kernels.attention`): the fused `flex` path equals the per-run SDPA
oracle `sdpa_runs` at the dtype's tolerance (GQA, head sizes 64/80/128, fp32/bf16/fp16, sparse,
contiguous and decode-like query sets); a prepared mask is reused while the query set is the
same object; backend selection by device and environment."""

import pytest
import torch

from mpic.kernels.attention import (
    BACKENDS,
    SelectiveAttention,
    default_backend_name,
    get_backend,
    selected_attention,
)
from mpic.kernels.flex import FlexBackend

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _case(n, h, hkv, d, index, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, hkv, d, generator=g)
    v = torch.randn(n, hkv, d, generator=g)
    q = torch.randn(index.numel(), h, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _mpic_like_index(n: int) -> torch.Tensor:
    """Text runs, the first tokens of items, and the last token: what mpic-k recomputes."""
    return torch.cat(
        [torch.arange(0, 7), torch.arange(40, 46), torch.arange(150, 160), torch.arange(n - 9, n)]
    )


@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_flex_equals_sdpa_runs_oracle(d, dtype):
    n, h, hkv = 300, 8, 2
    index = _mpic_like_index(n)
    q, k, v = _case(n, h, hkv, d, index, dtype)
    oracle = selected_attention(q, index, k, v, backend="sdpa_runs")
    fused = selected_attention(q, index, k, v, backend="flex")
    assert fused.dtype == dtype and fused.shape == q.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(fused.float(), oracle.float(), rtol=tol, atol=tol)
    exact = selected_attention(q.double(), index, k.double(), v.double(), backend="sdpa_runs")
    torch.testing.assert_close(fused.double(), exact, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "index",
    [
        torch.arange(37),
        torch.tensor([0, 3, 4, 9, 20, 21, 30]),
        torch.arange(25, 31),
        torch.tensor([17]),
    ],
    ids=["prefill", "sparse", "tail", "decode"],
)
def test_backends_match_naive_softmax(backend, index):
    n, h, hkv, d = 37, 4, 4, 16  # no GQA here: both paths without enable_gqa
    q, k, v = _case(n, h, hkv, d, index, torch.float64)
    ref = torch.empty_like(q)
    for row, i in enumerate(index.tolist()):
        scores = torch.einsum("hd,khd->hk", q[row], k[: i + 1]) / d**0.5
        ref[row] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[: i + 1])
    torch.testing.assert_close(selected_attention(q, index, k, v, backend=backend), ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_keys_after_the_last_query_are_never_seen(backend):
    q, k, v = _case(64, 4, 2, 32, torch.tensor([2, 5, 6, 7]), torch.float32)
    index = torch.tensor([2, 5, 6, 7])
    before = selected_attention(q, index, k, v, backend=backend)
    k[8:], v[8:] = 1e4, 1e4
    torch.testing.assert_close(selected_attention(q, index, k, v, backend=backend), before)


@pytest.mark.parametrize(
    "index", [_mpic_like_index(300), torch.tensor([123])], ids=["runs", "decode"]
)
def test_flex_without_reading_the_indices_equals_oracle(index):
    """The CUDA path never reads q_index back (no sync): all keys go in, the mask bounds them."""
    q, k, v = _case(300, 8, 2, 64, index, torch.float32)
    impl = FlexBackend(read_indices=False)
    state = impl.prepare(index, 300)
    assert state.kv_len == 300
    out = impl.attend(state, q, k, v)
    torch.testing.assert_close(out, selected_attention(q, index, k, v), rtol=1e-5, atol=1e-5)


def test_mask_prepared_once_per_query_set():
    calls = []

    class Counting(FlexBackend):
        def prepare(self, q_index, num_keys):
            calls.append(num_keys)
            return super().prepare(q_index, num_keys)

    attention = SelectiveAttention(Counting())
    index = _mpic_like_index(200)
    q, k, v = _case(200, 4, 2, 64, index, torch.float32)
    outs = [attention(q, index, k, v) for _ in range(3)]  # three "layers"
    assert len(calls) == 1
    attention(q[:5], index[:5].clone(), k, v)  # a new query set (tokens dropped)
    assert len(calls) == 2
    torch.testing.assert_close(outs[0], selected_attention(q, index, k, v))


def test_corrected_layers_prepare_no_plain_mask():
    """A query set whose layers are all corrected builds only the corrected state; a plain
    layer later builds the plain mask once."""
    calls = []

    class Counting(FlexBackend):
        def prepare(self, q_index, num_keys):
            calls.append("plain")
            return super().prepare(q_index, num_keys)

        def prepare_corrected(self, q_index, linked, num_keys):
            calls.append("corrected")
            return super().prepare_corrected(q_index, linked, num_keys)

    attention = SelectiveAttention(Counting())
    index = _mpic_like_index(200)
    q, k, v = _case(200, 4, 2, 64, index, torch.float32)
    linked = torch.zeros(k.shape[0], dtype=torch.bool)
    linked[1::3] = True
    linked[index] = False
    for _ in range(3):
        attention(q, index, k, v, linked=linked, s=0.8)
    assert calls == ["corrected"]
    plain = [attention(q, index, k, v) for _ in range(2)]
    assert calls == ["corrected", "plain"]
    torch.testing.assert_close(plain[0], selected_attention(q, index, k, v))


def test_default_backend_by_device_and_environment(monkeypatch):
    monkeypatch.delenv("MPIC_ATTENTION_BACKEND", raising=False)
    assert default_backend_name("cpu") == "sdpa_runs"
    assert default_backend_name("cuda") == "flex"
    monkeypatch.setenv("MPIC_ATTENTION_BACKEND", "flex")
    assert default_backend_name("cpu") == "flex"
    monkeypatch.setenv("MPIC_ATTENTION_BACKEND", "nope")
    with pytest.raises(ValueError, match="sdpa_runs"):
        default_backend_name("cpu")
    with pytest.raises(ValueError, match="valid"):
        get_backend("triton")


@pytest.mark.slow
def test_compiled_flex_on_cpu_equals_oracle():
    """The fused (torch.compile) kernel also runs on CPU; ~10-20 s of compilation."""
    index = _mpic_like_index(300)
    q, k, v = _case(300, 8, 2, 80, index, torch.float32)
    impl = FlexBackend(compile=True)
    out = impl.attend(impl.prepare(index, 300), q, k, v)
    torch.testing.assert_close(out, selected_attention(q, index, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_flex_on_cuda_equals_oracle(d, dtype):
    n = 1500
    index = torch.cat([torch.arange(0, 30), torch.arange(600, 632), torch.arange(n - 40, n)])
    q, k, v = (t.cuda() for t in _case(n, 32, 8, d, index, dtype))
    index = index.cuda()
    impl = FlexBackend()
    fused = impl.attend(impl.prepare(index, n), q, k, v)
    oracle = selected_attention(q, index, k, v, backend="sdpa_runs")
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(fused.float(), oracle.float(), rtol=tol, atol=tol)
