"""The APE-style correction of linked keys (kernels/correction.py) against a naive per-query,
per-head two-group attention written from the equation, on every backend."""

import math
import warnings

import pytest
import torch

from mpic.kernels import correction
from mpic.kernels.attention import SelectiveAttention, selected_attention
from mpic.kernels.correction import corrected_attention, linked_mask, merge_groups


def _naive(q, q_index, keys, values, linked, s):
    """O = (exp(S lse_A) O_A + exp(lse_B) O_B) / (exp(S lse_A) + exp(lse_B)), per query/head."""
    num_q, heads, dim = q.shape
    group = heads // keys.shape[1]
    out = torch.zeros(num_q, heads, dim, dtype=torch.float64)
    for i, qi in enumerate(q_index.tolist()):
        for h in range(heads):
            k = keys[: qi + 1, h // group].double()
            v = values[: qi + 1, h // group].double()
            sc = k @ q[i, h].double() / math.sqrt(dim)
            a = linked[: qi + 1]
            lse_b = torch.logsumexp(sc[~a], 0)
            o_b = torch.softmax(sc[~a], 0) @ v[~a]
            if a.any():
                lse_a = torch.logsumexp(sc[a], 0)
                o_a = torch.softmax(sc[a], 0) @ v[a]
                wa, wb = torch.exp(s * lse_a), torch.exp(lse_b)
                out[i, h] = (wa * o_a + wb * o_b) / (wa + wb)
            else:
                out[i, h] = o_b
    return out.float()


def _case(num_keys=300, num_q=150, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_index = torch.sort(torch.randperm(num_keys, generator=g)[:num_q]).values
    q = torch.randn(num_q, 6, 16, generator=g)
    keys = torch.randn(num_keys, 2, 16, generator=g) * 2
    values = torch.randn(num_keys, 2, 16, generator=g)
    linked = torch.rand(num_keys, generator=g) < 0.6
    linked[q_index] = False  # a query is recomputed: its own key is fresh
    return q, q_index, keys, values, linked


@pytest.fixture(params=["two-calls", "chunks"])
def path(request, monkeypatch):
    """Both implementations on the CPU: the two fused calls (the CPU default) and the chunked
    torch path (what CUDA runs), forced by hiding the CPU flash op."""
    if request.param == "chunks":
        monkeypatch.setattr(correction, "_flash_with_lse", lambda: None)
    return request.param


@pytest.mark.parametrize("s", [0.5, 0.8, 1.2])
def test_corrected_attention_equals_the_equation(s, path):
    q, q_index, keys, values, linked = _case()
    state = correction.prepare_corrected(q_index, linked, int(keys.shape[0]))
    assert (state.groups is not None) == (path == "two-calls")
    got = corrected_attention(q, q_index, keys, values, linked, s)
    torch.testing.assert_close(
        got, _naive(q, q_index, keys, values, linked, s), atol=2e-5, rtol=1e-4
    )


def test_scale_one_is_plain_selective_attention_and_empty_group_is_plain(path):
    q, q_index, keys, values, linked = _case(seed=1)
    plain = selected_attention(q, q_index, keys, values)
    torch.testing.assert_close(corrected_attention(q, q_index, keys, values, linked, 1.0), plain)
    none = torch.zeros_like(linked)
    torch.testing.assert_close(corrected_attention(q, q_index, keys, values, none, 0.7), plain)


@pytest.mark.parametrize("backend", ["sdpa_runs", "flex"])
def test_every_backend_applies_it_through_selective_attention(backend, path):
    q, q_index, keys, values, linked = _case(seed=2)
    attn = SelectiveAttention(backend)
    want = _naive(q, q_index, keys, values, linked, 0.8)
    for _ in range(2):  # the prepared masks are reused by the second call
        got = attn(q, q_index, keys, values, linked=linked, s=0.8)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # a decode query past the prompt: its slot is not linked
    one = attn(q[-1:], torch.tensor([299]), keys, values, linked=linked, s=0.8)
    torch.testing.assert_close(
        one, _naive(q[-1:], torch.tensor([299]), keys, values, linked, 0.8), atol=2e-5, rtol=1e-4
    )


def test_merge_groups_and_linked_mask():
    out_a, out_b = torch.randn(3, 4), torch.randn(3, 4)
    lse_a, lse_b = torch.tensor([1.0, -math.inf, 3.0]), torch.tensor([2.0, 0.5, -1.0])
    got = merge_groups(out_a, lse_a, out_b, lse_b, 0.8)
    wa, wb = torch.exp(0.8 * lse_a), torch.exp(lse_b)
    want = (wa[:, None] * out_a + wb[:, None] * out_b) / (wa + wb)[:, None]
    torch.testing.assert_close(got, want)
    depth = torch.tensor([0, 3, 0, 1, 3])
    is_item = torch.tensor([True, False, True, True, True])
    assert linked_mask(is_item, depth, 0, 7).tolist() == [True, False, True, False] + [False] * 3
    assert linked_mask(is_item, depth, 2, 7).tolist() == [True, False, True, True] + [False] * 3


def test_queries_that_see_no_linked_key_get_plain_attention(path):
    """Queries before the first linked key (text ahead of every item): the CPU kernel reports
    lse 0 for their empty linked row, which must count as an empty group."""
    q, q_index, keys, values, linked = _case(seed=3)
    linked[:150] = False
    assert bool((q_index < 150).any())
    got = corrected_attention(q, q_index, keys, values, linked, 0.6)
    want = _naive(q, q_index, keys, values, linked, 0.6)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("s", [0.6, 1.3])
def test_fused_flex_correction_equals_the_equation(s):
    """The CUDA default (two FlexAttention calls returning log-sum-exps, merged), forced on the
    CPU with the eager kernel; queries before any linked key included; decode falls back."""
    from mpic.kernels.flex import FlexBackend, FlexCorrected

    q, q_index, keys, values, linked = _case(seed=4)
    linked[:120] = False
    backend = FlexBackend(compile=False, fused_correction=True)
    attn = SelectiveAttention(backend)
    got = attn(q, q_index, keys, values, linked=linked, s=s)
    assert isinstance(attn._corrected[3], FlexCorrected)
    want = _naive(q, q_index, keys, values, linked, s)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    one = attn(q[-1:], torch.tensor([299]), keys, values, linked=linked, s=s)
    want_one = _naive(q[-1:], torch.tensor([299]), keys, values, linked, s)
    torch.testing.assert_close(one, want_one, atol=2e-5, rtol=1e-4)


def test_fused_flex_correction_falls_back_when_the_kernel_fails(monkeypatch):
    from mpic.kernels.flex import FlexBackend

    def broken(*args, **kwargs):
        raise RuntimeError("NoValidChoicesError")

    from mpic.kernels import flex

    monkeypatch.setattr(flex, "_UNFUSED", set())  # this test's failure stays in this test
    q, q_index, keys, values, linked = _case(seed=5)
    backend = FlexBackend(compile=False, fused_correction=True)
    monkeypatch.setattr(backend, "_two_flex_calls", broken)
    attn = SelectiveAttention(backend)
    with pytest.warns(UserWarning, match="unfused path"):
        got = attn(q, q_index, keys, values, linked=linked, s=0.8)
    torch.testing.assert_close(
        got, _naive(q, q_index, keys, values, linked, 0.8), atol=2e-5, rtol=1e-4
    )
    again = attn(q, q_index, keys, values, linked=linked, s=0.8)  # no second try, no warning
    torch.testing.assert_close(again, got)
    later = FlexBackend(compile=False, fused_correction=True)  # a later request's backend
    state = later.prepare_corrected(q_index, linked, int(keys.shape[0]))
    assert isinstance(state, correction.CorrectedState)  # the failed lowering is not retried


@pytest.mark.slow
def test_compiled_fused_flex_correction_on_cpu_is_right_either_way(monkeypatch):
    """The compiled call as on CUDA, compiled by inductor for the CPU: torch 2.13's CPU inductor
    cannot lower `return_lse` (a real lowering error), so this exercises the fallback; a torch
    that can would run the fused kernel. Either way the answer is the equation's."""
    from mpic.kernels import flex
    from mpic.kernels.flex import FlexBackend

    monkeypatch.setattr(flex, "_UNFUSED", set())  # the CPU's failure stays in this test

    q, q_index, keys, values, linked = _case(seed=6)
    attn = SelectiveAttention(FlexBackend(compile=True, fused_correction=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = attn(q, q_index, keys, values, linked=linked, s=0.8)
    torch.testing.assert_close(
        got, _naive(q, q_index, keys, values, linked, 0.8), atol=2e-5, rtol=1e-4
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 80, 128])
def test_fused_flex_correction_on_cuda(dtype, dim):
    """The CUDA default: compiled FlexAttention with `return_lse`, no fallback taken."""
    from mpic.kernels.flex import FlexBackend

    n, heads, kv_heads = 1500, 32, 8
    g = torch.Generator().manual_seed(7)
    q_index = torch.cat([torch.arange(0, 30), torch.arange(600, 632), torch.arange(n - 40, n)])
    q = torch.randn(q_index.numel(), heads, dim, generator=g)
    keys = torch.randn(n, kv_heads, dim, generator=g)
    values = torch.randn(n, kv_heads, dim, generator=g)
    linked = torch.ones(n, dtype=torch.bool)
    linked[q_index] = False
    linked[:10] = False
    want = corrected_attention(q, q_index, keys, values, linked, 0.8)  # CPU, float32
    attn = SelectiveAttention(FlexBackend())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a fallback would warn
        got = attn(
            q.to("cuda", dtype),
            q_index.cuda(),
            keys.to("cuda", dtype),
            values.to("cuda", dtype),
            linked=linked.cuda(),
            s=0.8,
        )
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol)


def test_attend_groups_over_pre_gathered_groups_is_the_two_call_path():
    # a caller that reads each group's rows itself (the vLLM worker, from its paged cache) gets
    # the very numbers of `corrected_attention` over the full K/V
    if correction._flash_with_lse() is None:
        pytest.skip("no CPU flash kernel with log-sum-exps")
    g = torch.Generator().manual_seed(3)
    n, heads, kv_heads, dim = 40, 4, 2, 16
    keys, values = (
        torch.randn(n, kv_heads, dim, generator=g),
        torch.randn(n, kv_heads, dim, generator=g),
    )
    q_index = torch.tensor([3, 4, 17, 30, 31, 39])
    q = torch.randn(q_index.numel(), heads, dim, generator=g)
    linked = torch.zeros(n, dtype=torch.bool)
    linked[5:28] = True
    state = correction.prepare_corrected(q_index, linked, n)
    groups = state.groups
    assert groups is not None
    split = [(keys[i], values[i]) for i in (groups.index_a, groups.index_b)]
    got = correction.attend_groups(q, split[0], split[1], 0.8, dim**-0.5, groups)
    want = corrected_attention(q, q_index, keys, values, linked, 0.8, dim**-0.5, state)
    assert torch.equal(got, want)


def test_attend_groups_runs_bfloat16_as_is_within_its_rounding():
    # bfloat16 K/V (a bf16 vLLM cache) run through the kernel in bfloat16, not cast to float32:
    # the output is bfloat16 and within bf16 rounding of the float32 equation, a linked group
    # that no query sees (-inf lse) included
    if correction._flash_with_lse() is None:
        pytest.skip("no CPU flash kernel with log-sum-exps")
    g = torch.Generator().manual_seed(4)
    n, heads, kv_heads, dim = 96, 6, 2, 32
    keys, values = (torch.randn(n, kv_heads, dim, generator=g) for _ in range(2))
    q_index = torch.tensor([0, 1, 2, 50, 51, 90, 95])
    q = torch.randn(q_index.numel(), heads, dim, generator=g)
    linked = torch.zeros(n, dtype=torch.bool)
    linked[10:80] = True
    state = correction.prepare_corrected(q_index, linked, n)
    groups = state.groups
    assert groups is not None and not bool(groups.sees_a[0, 0])
    split = [(keys[i].bfloat16(), values[i].bfloat16()) for i in (groups.index_a, groups.index_b)]
    got = correction.attend_groups(q.bfloat16(), split[0], split[1], 0.8, dim**-0.5, groups)
    assert got.dtype == torch.bfloat16
    want = _naive(q, q_index, keys, values, linked, 0.8)  # scale 1 / sqrt(dim)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
