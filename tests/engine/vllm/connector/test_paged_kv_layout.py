"""The paged linked KV over vLLM's CUDA FlashAttention cache layout, checked on CPU tensors laid
out exactly as vLLM lays them out (no vLLM import): slots land where FlashAttention reads them,
and a whole MPIC pass over paged blocks (shuffled block table) equals the dense linked KV for
every policy and both attention backends. The CUDA write op (`reshape_and_cache_flash`) and the
compiled kernel are checked on a GPU (marked gpu)."""

import pytest
import torch

from mpic.engine.vllm.connector.paged_cuda import FlashPagedOps, flash_views
from mpic.engine.vllm.connector.paged_kv import PagedLinkedKV
from mpic.linker.kv.dense import DenseLinkedKV
from mpic.linker.pipeline import link_and_prefill
from mpic.linker.plan import build_plan, resolve_entries, unique_entries
from mpic.linker.policies import scout as scout_module
from mpic.linker.recipe import with_policy
from tests.linker.toy_model import CONTEXT, IMAGE_ID, ToyAdapter, toy_entries, toy_spec

BLOCK = 16


def vllm_cache(layout: str, num_blocks: int, heads: int, dim: int, device="cpu", dtype=None):
    """One layer's cache as vLLM allocates it for FlashAttention.

    "nhd": vLLM >= 0.32, logical [B, H_kv, bs, 2*D] over physical [B, bs, H_kv, 2*D] (stride
    order LBNHC, the FlashAttention default); "hnd": the identity stride order; "legacy":
    [2, B, bs, H_kv, D] of older vLLM."""
    dtype = dtype or torch.float32
    if layout == "legacy":
        return torch.zeros(2, num_blocks, BLOCK, heads, dim, device=device, dtype=dtype)
    if layout == "nhd":
        raw = torch.zeros(num_blocks, BLOCK, heads, 2 * dim, device=device, dtype=dtype)
        return raw.permute(0, 2, 1, 3)
    return torch.zeros(num_blocks, heads, BLOCK, 2 * dim, device=device, dtype=dtype)


def key_at(cache, layout, block, offset):
    """Where FlashAttention reads a token's keys [H_kv, D] (vLLM: (B, H, N, 2*D), K first)."""
    if layout == "legacy":
        return cache[0, block, offset]
    return cache[block, :, offset, : cache.shape[-1] // 2]


@pytest.mark.parametrize("layout", ["nhd", "hnd", "legacy"])
def test_writes_land_where_flash_attention_reads(layout):
    heads, dim = 2, 8
    cache = vllm_cache(layout, 6, heads, dim)
    blocks = torch.tensor([4, 1, 3])
    ops = FlashPagedOps([cache], blocks, BLOCK, dim, backend="sdpa_runs")
    kv = PagedLinkedKV([], [cache], blocks.tolist(), BLOCK, ops=ops)
    index = torch.tensor([0, 15, 16, 33])
    k = torch.randn(4, heads, dim)
    v = torch.randn(4, heads, dim)
    kv.write(0, index, k, v)
    for row, p in enumerate(index.tolist()):
        block, offset = int(blocks[p // BLOCK]), p % BLOCK
        assert torch.equal(key_at(cache, layout, block, offset), k[row])
    assert torch.equal(kv.read_keys(0, index), k)
    key, value = flash_views(cache, dim)
    assert torch.equal(value[1, 0], v[2])  # index 16: block_ids[1] = 1, offset 0
    assert int((cache != 0).sum()) == 2 * k.numel()
    kv.clear()
    assert not cache.any()


def _setup(mrope):
    adapter = ToyAdapter(mrope=mrope)
    items = resolve_entries(["img-a", "img-b", "img-a"], toy_entries(adapter))
    prompt = CONTEXT + [10, 11, IMAGE_ID, 12, IMAGE_ID, 13, IMAGE_ID, 14, 15]
    plan = build_plan(toy_spec(adapter), prompt, items)
    return adapter, plan, unique_entries(plan, items)


@pytest.mark.parametrize("mrope", [False, True])
@pytest.mark.parametrize("backend", ["sdpa_runs", "flex"])
@pytest.mark.parametrize(
    "name", ["full", "mpic-2", "vlcache-0.5:0.34:0", "cacheblend-15", "scout-0.6:s0.8"]
)
def test_pass_over_paged_blocks_equals_dense(mrope, backend, name):
    adapter, plan, entries = _setup(mrope)
    planned = with_policy(plan, entries, name, adapter.num_layers)
    dense = DenseLinkedKV(adapter.num_layers, plan.num_tokens, 2, 8, backend="sdpa_runs")
    ref = link_and_prefill(adapter, planned, dense)
    caches = [vllm_cache("nhd", 8, 2, 8) for _ in range(adapter.num_layers)]
    caches[0].fill_(7.0)  # stale data of another request: must be cleared
    block_ids = [5, 2]  # 25 prompt tokens over two blocks of 16, out of order
    ops = FlashPagedOps(caches, torch.tensor(block_ids), BLOCK, 8, backend=backend)
    paged = PagedLinkedKV([], caches, block_ids, BLOCK, ops=ops)
    paged.clear()
    out = link_and_prefill(adapter, planned, paged)
    assert torch.equal(out.result.recompute_depth, ref.result.recompute_depth)
    torch.testing.assert_close(out.result.logits, ref.result.logits, rtol=1e-5, atol=1e-5)
    index = torch.arange(plan.num_tokens)
    for layer in range(adapter.num_layers):
        torch.testing.assert_close(paged.read_keys(layer, index), dense.keys[layer])


@pytest.fixture
def items_as_documents(monkeypatch):
    """The toy's items (images) take the documents' S (`:s`, per half of the layers)."""
    monkeypatch.setattr(scout_module, "mostly_images", lambda plan, entries: False)


@pytest.mark.parametrize("mrope", [False, True])
@pytest.mark.parametrize("name", ["scout-0.6:s0.7", "scout-0.6:s0.9/0.7"])
def test_scout_with_the_correction_over_mirrors_equals_dense(mrope, name, items_as_documents):
    """The opaque-layout path (vLLM's CPU cache): the scout and the corrected attention read the
    dense K/V mirrors; same selection and logits as the dense linked KV (one S, or one S per
    half of the layers)."""
    adapter, plan, entries = _setup(mrope)
    planned = with_policy(plan, entries, name, adapter.num_layers)
    dense = DenseLinkedKV(adapter.num_layers, plan.num_tokens, 2, 8, backend="sdpa_runs")
    ref = link_and_prefill(adapter, planned, dense)
    caches = [vllm_cache("nhd", 8, 2, 8) for _ in range(adapter.num_layers)]
    block_ids = [3, 6]
    ops = FlashPagedOps(caches, torch.tensor(block_ids), BLOCK, 8)
    shape = (adapter.num_layers, len(block_ids) * BLOCK, 2, 8)
    mirrors = torch.zeros(shape), torch.zeros(shape)
    paged = PagedLinkedKV([], caches, block_ids, BLOCK, keys=mirrors[0], ops=ops, values=mirrors[1])
    paged.clear()
    out = link_and_prefill(adapter, planned, paged)
    assert torch.equal(out.plan.recompute_depth, ref.plan.recompute_depth)
    torch.testing.assert_close(out.result.logits, ref.result.logits, rtol=1e-5, atol=1e-5)
    bare = PagedLinkedKV([], caches, block_ids, BLOCK, ops=_Opaque())
    with pytest.raises(RuntimeError, match="mirrors"):
        bare.set_correction(out.plan and dense.correction)


@pytest.mark.parametrize("mirrored", [True, False])
@pytest.mark.parametrize("name", ["scout-0.6:s0.7", "scout-0.6:s1/0.7"])
def test_shifted_linked_keys_give_the_corrected_last_token_under_plain_attention(
    name, mirrored, items_as_documents
):
    """vLLM's forward attends token N-1 plainly: after `shift_for_last_query` that plain
    attention equals the corrected one, and `restore` puts the true keys back. With S = 1 in
    the first half of the layers only the second half is corrected and shifted. Without
    mirrors the keys are shifted in place in the cache (`FlashPagedOps.shift_keys`), the
    values untouched."""
    adapter, plan, entries = _setup(False)
    planned = with_policy(plan, entries, name, adapter.num_layers)
    layers = adapter.num_layers
    shifted = layers if name.endswith(":s0.7") else layers - layers // 2
    caches = [vllm_cache("nhd", 8, 2, 8) for _ in range(adapter.num_layers)]
    block_ids = [4, 1]
    ops = FlashPagedOps(caches, torch.tensor(block_ids), BLOCK, 8)
    shape = (adapter.num_layers, len(block_ids) * BLOCK, 2, 8)
    mirrors = (torch.zeros(shape), torch.zeros(shape)) if mirrored else (None, None)
    paged = PagedLinkedKV([], caches, block_ids, BLOCK, keys=mirrors[0], ops=ops, values=mirrors[1])
    paged.clear()
    out = link_and_prefill(adapter, planned, paged)
    last = plan.num_tokens - 1
    index = torch.arange(plan.num_tokens)
    true = [ops.read(layer, paged.slots(index)) for layer in range(adapter.num_layers)]
    queries = {layer: q for layer, (i, q, _) in paged._last_q.items() if i == last}
    assert len(queries) == shifted
    corrected = {
        layer: paged.attend(layer, q[None], torch.tensor([last])) for layer, q in queries.items()
    }
    assert paged.shift_for_last_query(last) == shifted
    for layer, q in queries.items():
        plain = ops.attend(layer, q[None], torch.tensor([last]))
        torch.testing.assert_close(plain, corrected[layer], rtol=1e-4, atol=1e-5)
        keys, values = ops.read(layer, paged.slots(index))
        assert not torch.allclose(keys, true[layer][0]) and torch.equal(values, true[layer][1])
    paged.restore()
    for layer in range(adapter.num_layers):
        keys, values = ops.read(layer, paged.slots(index))
        assert torch.equal(keys, true[layer][0]) and torch.equal(values, true[layer][1])
        if mirrored:
            assert torch.equal(keys, mirrors[0][layer, : plan.num_tokens])
    assert out.result.logits is not None
    if shifted < adapter.num_layers:  # plain layers: keys never moved, attention unchanged
        assert set(queries) == set(range(adapter.num_layers // 2, adapter.num_layers))


class _Opaque(FlashPagedOps):
    readable = False

    def __init__(self):
        pass


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 80, 128])
def test_cuda_paged_flex_equals_dense_oracle(dtype, dim):
    """The CUDA path: vLLM's layout on the GPU, vLLM's write op when installed, compiled flex."""
    heads, kv_heads, n = 32, 8, 700
    g = torch.Generator().manual_seed(0)
    k = torch.randn(n, kv_heads, dim, generator=g).to("cuda", dtype)
    v = torch.randn(n, kv_heads, dim, generator=g).to("cuda", dtype)
    index = torch.cat([torch.arange(0, 20), torch.arange(300, 340), torch.arange(n - 30, n)])
    q = torch.randn(index.numel(), heads, dim, generator=g).to("cuda", dtype)
    blocks = torch.randperm(64, generator=g)[: -(-n // BLOCK)]
    cache = vllm_cache("nhd", 64, kv_heads, dim, device="cuda", dtype=dtype)
    ops = FlashPagedOps([cache], blocks, BLOCK, dim)
    kv = PagedLinkedKV([], [cache], blocks.tolist(), BLOCK, ops=ops)
    kv.write_layers(torch.arange(n, device="cuda"), k[None], v[None])
    out = kv.attend(0, q, index.cuda())
    dense = DenseLinkedKV(1, n, kv_heads, dim, dtype, "cuda", backend="sdpa_runs")
    dense.write_layers(torch.arange(n), k[None], v[None])
    ref = dense.attend(0, q, index.cuda())
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
