"""Reads from vLLM's CPU paged cache through the in-block layout learnt from vLLM's own write op
(`paged_cpu.cpu_layout`): what was written reads back bit-exactly for every ISA layout this
host's build accepts, and the corrected attention over the blocks (no dense mirrors) gives the
very numbers of the corrected attention over dense K/V mirrors, in one request and in a batch.
Runs vLLM's CPU ops directly (no engine); skipped where they are not built."""

from types import SimpleNamespace

import pytest
import torch

from mpic.engine.vllm.connector.batched_link import BatchedPagedKV, BatchItem
from mpic.engine.vllm.connector.paged_cpu import CpuPagedOps, cpu_layout
from mpic.engine.vllm.connector.paged_kv import PagedLinkedKV
from mpic.linker.correction import LinkCorrection
from mpic.linker.policies import get_policy
from tests.engine.vllm.connector.cpu_ops import vllm_cpu_op_built

pytestmark = pytest.mark.skipif(
    not vllm_cpu_op_built("cpu_attn_reshape_and_cache"), reason="vLLM's CPU attention ops"
)

BS, HKV, HEADS, DIM = 32, 2, 4, 64


def _layer(isa: str = "vec", dim: int = DIM) -> SimpleNamespace:
    """What `CpuPagedOps` reads of vLLM's `Attention` module."""
    impl = SimpleNamespace(kv_cache_dtype="auto", scale=dim**-0.5, num_kv_heads=HKV)
    return SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0, impl=impl)


@pytest.mark.parametrize(
    ("isa", "bs", "dim", "dtype"),
    [
        ("vec", 32, 64, torch.float32),
        ("vec", 32, 128, torch.bfloat16),
        ("vec16", 16, 80, torch.float32),
        ("amx", 32, 64, torch.bfloat16),
    ],
)
def test_learnt_layout_reads_back_what_vllm_wrote(isa, bs, dim, dtype):
    if cpu_layout(isa, dtype, HKV, bs, dim) is None:
        pytest.skip(f"vLLM's write op refuses {isa} / {dtype} here")
    caches = [torch.zeros(6, HKV, bs, 2 * dim, dtype=dtype)]
    blocks = torch.tensor([4, 1, 3])
    ops = CpuPagedOps([_layer(isa, dim)], caches, blocks, bs)
    assert ops.readable
    n = 3 * bs - 5
    k, v = torch.randn(n, HKV, dim).to(dtype), torch.randn(n, HKV, dim).to(dtype)
    p = torch.arange(n)
    slots = blocks[p // bs] * bs + p % bs
    ops.write(0, slots, k, v)
    keys, values = ops.gather(0, n)
    assert torch.equal(keys, k) and torch.equal(values, v)
    some = torch.tensor([0, 5, bs, n - 1])
    assert torch.equal(ops.read_keys(0, slots[some]), k[some])
    assert torch.equal(ops.read(0, slots[some])[1], v[some])


def _request(num_tokens: int, layers: int, seed: int):
    """Fresh K/V of every layer, a plan's items and depths, the rows recomputed at every layer."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, num_tokens, HKV, DIM, generator=g)
    v = torch.randn(layers, num_tokens, HKV, DIM, generator=g)
    is_item = torch.zeros(num_tokens, dtype=torch.bool)
    is_item[8 : num_tokens - 6] = True
    depth = torch.where(is_item, 0, layers)
    depth[torch.arange(10, num_tokens - 6, 4)] = layers  # some item tokens recomputed
    depth[12] = 1  # one recomputed up to layer 1 only: linked from layer 1 on
    active = torch.nonzero(depth > 0).flatten()
    q = torch.randn(layers, active.numel(), HEADS, DIM, generator=g)
    return k, v, LinkCorrection(0.7, is_item, depth, late_scale=0.9, split_layer=2), active, q


def _paged(caches, block_ids, layers, mirrors: bool) -> PagedLinkedKV:
    shape = (layers, len(block_ids) * BS, HKV, DIM)
    keys = torch.zeros(shape) if mirrors else None
    values = torch.zeros(shape) if mirrors else None
    return PagedLinkedKV([_layer()] * layers, caches, block_ids, BS, keys=keys, values=values)


def test_corrected_attention_over_the_blocks_equals_it_over_mirrors():
    layers, n = 3, 70
    k, v, corr, active, q = _request(n, layers, 0)
    out = {}
    for mirrors, blocks in ((True, [2, 5, 0]), (False, [6, 1, 3])):
        caches = [torch.zeros(8, HKV, BS, 2 * DIM) for _ in range(layers)]
        kv = _paged(caches, blocks, layers, mirrors)
        assert kv.mirrored is mirrors and kv._ops.readable
        kv.write_layers(torch.arange(n), k, v)
        kv.set_correction(corr)
        out[mirrors] = [kv.attend(layer, q[layer], active) for layer in range(layers)]
        assert kv.corrects_at(0) and kv.corrects_at(2)
        if not mirrors:  # the shift for vLLM's last token, undone from the kept keys
            last = n - 1
            queries = {layer: q for layer, (i, q, _) in kv._last_q.items() if int(i) == last}
            corrected = {
                layer: kv.attend(layer, q[None], torch.tensor([last]))
                for layer, q in queries.items()
            }
            assert kv.shift_for_last_query(last) == layers
            for layer, qq in queries.items():
                plain = kv._ops.attend(layer, qq[None], torch.tensor([last]))
                torch.testing.assert_close(plain, corrected[layer], rtol=1e-4, atol=1e-4)
            kv.restore()
            for layer in range(layers):
                keys, values = kv._ops.gather(layer, n)
                assert torch.equal(keys, k[layer]) and torch.equal(values, v[layer])
    for with_mirrors, over_blocks in zip(out[True], out[False], strict=True):
        assert torch.equal(with_mirrors, over_blocks)


def test_a_batch_attends_corrected_rows_over_their_blocks_and_the_rest_in_one_call():
    layers = 3
    sizes, corrects = [70, 40, 50], [True, False, True]
    caches = [torch.zeros(12, HKV, BS, 2 * DIM) for _ in range(layers)]
    policy = get_policy("mpic-32")
    items, alone, reqs, offset = [], [], [], 0
    for r, (n, corrected) in enumerate(zip(sizes, corrects, strict=True)):
        blocks = [3 * r + 2, 3 * r + 1, 3 * r]
        k, v, corr, active, q = _request(n, layers, r + 1)
        kv = _paged(caches, blocks, layers, mirrors=False)
        kv.write_layers(torch.arange(n), k, v)
        kv.set_correction(corr if corrected else None)
        items.append(BatchItem(SimpleNamespace(num_tokens=n), [], kv, blocks, policy))
        alone.append([kv.attend(layer, q[layer], active) for layer in range(layers)])
        reqs.append((active + offset, q))
        offset += n
    batch = BatchedPagedKV(items, [_layer()] * layers, caches, BS)
    assert batch._cpu  # no request keeps mirrors: one write call, one plain attention call
    index = torch.cat([a for a, _ in reqs])
    for layer in range(layers):
        out = batch.attend(layer, torch.cat([q[layer] for _, q in reqs]), index)
        rows = 0
        for r, (active, _) in enumerate(reqs):
            got, want = out[rows : rows + active.numel()], alone[r][layer]
            if corrects[r]:  # the same corrected kernel on the same rows: the same numbers
                assert torch.equal(got, want)
            else:  # vLLM's op, in one call with the other plain rows
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            rows += active.numel()


def test_the_shift_reads_the_pass_log_sum_exps():
    """After a pass whose corrected layers attended over the blocks (`attend_groups`), the shift
    for vLLM's last token takes each layer's linked log-sum-exp from that pass (none computed
    again): vLLM's plain attention of the last query then equals the pass's corrected output
    for it, in every layer (two linked sets: layer 0's, and layers 1-2's with token 12 linked),
    and `restore` puts back the true keys and values; the shift moved the linked keys alone."""
    layers, n = 3, 70
    k, v, corr, active, q = _request(n, layers, 1)
    caches = [torch.zeros(8, HKV, BS, 2 * DIM) for _ in range(layers)]
    kv = _paged(caches, [6, 1, 3], layers, False)
    kv.write_layers(torch.arange(n), k, v)
    kv.set_correction(corr)
    outs = [kv.attend(layer, q[layer], active) for layer in range(layers)]
    last = int(active[-1])
    assert all(lse is not None and lse.shape == (HEADS,) for _, _, lse in kv._last_q.values())
    assert kv.shift_for_last_query(last) == layers
    for layer in range(layers):
        plain = kv._ops.attend(layer, q[layer][-1:], torch.tensor([last]))
        torch.testing.assert_close(plain, outs[layer][-1:], rtol=1e-4, atol=1e-4)
        moved, values = kv._ops.gather(layer, n)
        assert not torch.equal(moved, k[layer])
        linked = corr.linked(layer, n, moved.device)  # only the linked keys moved
        assert torch.equal(moved[~linked], k[layer][~linked]) and torch.equal(values, v[layer])
        assert not torch.equal(moved[linked], k[layer][linked])
    kv.restore()
    for layer in range(layers):
        keys, values = kv._ops.gather(layer, n)
        assert torch.equal(keys, k[layer]) and torch.equal(values, v[layer])
