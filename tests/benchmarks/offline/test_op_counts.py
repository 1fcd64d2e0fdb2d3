"""`mpic.benchmarks.offline.op_counts`: the sync/copy classification on synthetic devices (no GPU
needed), op counts of small known functions, compiled code counted as it runs, the union of
kernel intervals; on a CUDA machine also real syncs, copies and one profiled call."""

import pytest
import torch

from mpic.benchmarks.offline.op_counts import busy_us, classify_op, count_ops, profile_gpu

CPU, GPU, GPU1 = torch.device("cpu"), torch.device("cuda"), torch.device("cuda", 1)
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    ("name", "inputs", "output", "kind"),
    [
        # reading device data back on the host
        ("aten._local_scalar_dense.default", [GPU], None, "sync"),
        ("aten.item.default", [GPU1], None, "sync"),
        ("aten.nonzero.default", [GPU], GPU, "sync"),
        ("aten.is_nonzero.default", [GPU], None, "sync"),
        ("aten.equal.default", [GPU, GPU], None, "sync"),
        ("aten.masked_select.default", [GPU, GPU], GPU, "sync"),
        ("aten._unique2.default", [GPU], GPU, "sync"),
        ("aten.unique_consecutive.default", [GPU], GPU, "sync"),
        ("aten.where.default", [GPU], GPU, "sync"),
        ("aten.where.self", [GPU, GPU, GPU], GPU, None),
        ("aten.repeat_interleave.Tensor", [GPU], GPU, "sync"),
        ("aten.repeat_interleave.self_int", [GPU], GPU, None),
        # the same ops on the host: nothing to wait for
        ("aten._local_scalar_dense.default", [CPU], None, None),
        ("aten.nonzero.default", [CPU], CPU, None),
        # copies, by the device types on either side
        ("aten._to_copy.default", [GPU], CPU, "sync"),
        ("aten._to_copy.default", [CPU], GPU1, "h2d"),
        ("aten._to_copy.default", [GPU], GPU1, None),
        ("aten._to_copy.default", [CPU], CPU, None),
        ("aten.copy_.default", [CPU, GPU], CPU, "sync"),  # (destination, source)
        ("aten.copy_.default", [GPU, CPU], GPU, "h2d"),
        ("aten.copy_.default", [GPU, GPU], GPU, None),
        ("aten.to.dtype_layout", [CPU], GPU, "h2d"),
        ("aten.to.dtype_layout", [GPU], CPU, "sync"),
        ("aten.lift_fresh.default", [GPU], GPU, "h2d"),  # torch.tensor(data, device="cuda")
        ("aten.lift_fresh.default", [CPU], CPU, None),
        # plain device work
        ("aten.mm.default", [GPU, GPU], GPU, None),
        ("aten.add.Tensor", [GPU, CPU], GPU, None),  # a 0-dim CPU operand is no copy
    ],
)
def test_classify_by_device_type(name, inputs, output, kind):
    assert classify_op(name, inputs, output) == kind


def test_classify_needs_the_call_for_masks_and_sizes():
    assert classify_op("aten.index.Tensor", [GPU, GPU], GPU, bool_index=True) == "sync"
    assert classify_op("aten.index.Tensor", [GPU, GPU], GPU) is None  # integer positions
    assert classify_op("aten.index_put_.default", [GPU, GPU, GPU], GPU, bool_index=True) == "sync"
    assert classify_op("aten.index.Tensor", [CPU, CPU], CPU, bool_index=True) is None
    sized = classify_op("aten.repeat_interleave.Tensor", [GPU], GPU, output_size=True)
    assert sized is None


def test_count_ops_of_a_known_function():
    x = torch.arange(6.0)
    counts = count_ops(lambda: (x + 1).mul(2).sum())
    assert counts.total == 3
    assert counts.by_op == {"aten.add.Tensor": 1, "aten.mul.Tensor": 1, "aten.sum.default": 1}
    # no CUDA tensor seen: unknowable, not 0
    assert counts.syncs is None and counts.h2d_copies is None and not counts.sync_ops


def test_count_ops_counts_host_reads_and_masks_on_the_cpu():
    x = torch.arange(6.0)

    def reads() -> None:
        int(x.argmax())
        x[x > 2]

    with torch.inference_mode():  # as prefills run: `item` is not expanded there
        counts = count_ops(reads)
    assert counts.by_op["aten.item.default"] == 1 and counts.by_op["aten.index.Tensor"] == 1
    assert counts.total == 4 and counts.syncs is None


def test_compiled_code_runs_compiled_while_counted():
    runs: list[int] = []

    def backend(gm, example_inputs):  # noqa: ANN001, ANN202 - a dynamo backend
        def compiled(*args):  # noqa: ANN002, ANN202
            runs.append(1)
            return gm.forward(*args)

        return compiled

    f = torch.compile(lambda t: (t.sin() + 1).cos(), backend=backend, dynamic=False)
    x = torch.randn(4)
    f(x)
    counts = count_ops(lambda: f(x))
    assert len(runs) == 2  # not an eager fallback under the counting mode
    assert counts.total == 3


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_an_eager_flex_attention_call_is_one_higher_order_op():
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 2, 8, 16)
    with torch.inference_mode():
        counts = count_ops(lambda: flex_attention(q, q, q))
    assert counts.by_op["higher_order.flex_attention"] == 1
    assert not any("bmm" in op or "softmax" in op for op in counts.by_op)  # its insides


@pytest.mark.parametrize(
    ("intervals", "busy"),
    [
        ([], 0.0),
        ([(0.0, 10.0), (5.0, 15.0), (20.0, 25.0)], 20.0),  # overlap counted once
        ([(2.0, 3.0), (0.0, 10.0)], 10.0),  # nested, unsorted
        ([(0.0, 1.0), (1.0, 2.0)], 2.0),  # touching
    ],
)
def test_busy_time_is_the_union_of_intervals(intervals, busy):
    assert busy_us(intervals) == busy


@cuda_only
def test_count_ops_on_cuda_sees_syncs_and_copies():
    x = torch.arange(8.0, device="cuda")

    def work() -> None:
        torch.tensor([1.0, 2.0], device="cuda")  # built on the host
        torch.ones(3).to("cuda")
        int(x.sum())
        x.nonzero()
        x.cpu()

    counts = count_ops(work)
    assert counts.syncs == 3 and counts.h2d_copies == 2
    assert counts.sync_ops["aten.nonzero.default"] == 1


@cuda_only
def test_profile_gpu_counts_kernels_within_the_wall_time():
    a = torch.randn(512, 512, device="cuda")
    prof = profile_gpu(lambda: (a @ a).relu(), top=5)
    assert prof.kernels >= 2
    assert 0 < prof.busy_ms <= prof.wall_ms and 0 < prof.busy_share <= 1
    assert prof.table and "Self CUDA" in prof.table
