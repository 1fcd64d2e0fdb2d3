"""`flex` attention backend: ONE FlexAttention call per layer over all recomputed queries (kernels;
the CUDA default, selectable on CPU).

The mask is the exact causal rule by prompt index, `kv_idx <= q_index[q_idx]`, as a FlexAttention
block mask built once per query set (`prepare`: once per request in an MPIC pass, shared by all
layers) on the indices' device without reading them back (no host sync on CUDA); key blocks past
a query block's last index are skipped by the fused kernel. On CUDA the call is `torch.compile`d
(a fused Triton kernel; head sizes that are not a power of two, e.g. 80, are zero-padded to the
next one, which leaves q.k and the output unchanged). On CPU it runs eager by default
(FlexAttention's reference path materialises the S x N scores: correct, not fast);
`FlexBackend(compile=True)` compiles there too (~11 s on the first call; `compile_backend=
"aot_eager"` where inductor cannot generate the CPU code).

Compiled for good: every mask comes from two rules defined once (`mpic.kernels.block_masks`,
whose block masks are built from per-block index bounds), reading the request's tensors as graph
inputs, and query or key sets that fit one block are padded to two
(`FlexShape`), so serving any mix of prompts and policies keeps a few graphs (4 for 200 varied
prompts under every policy family); a recompile-limit hit is counted, logged and exported
(`mpic.kernels.compiled`).

Shapes: q [S, H, D], keys/values [N, H_kv, D] -> [S, H, D]; GQA through `enable_gqa`. A single
query (decode) is one SDPA call over keys [0, i] (host index) or over all keys with a [1, N]
mask (device index).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

try:  # torch >= 2.9: `return_aux` (`return_lse` warns as deprecated, and dynamo guards on that)
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover - older torch
    AuxRequest = None

from mpic.kernels.attention_backend import AttentionBackend
from mpic.kernels.block_masks import causal_block_mask
from mpic.kernels.compiled import compiled

# Kernel options tried in order when torch.compile lowers FlexAttention. On an H100 with torch
# 2.11 the default configs fail to lower for head size 64 (fp32 and bf16: "NoValidChoicesError:
# No choices to select"), while 64 x 64 tiles compile and match the eager reference (fp32 8e-7,
# bf16 4e-3); the first set that compiles for a (device, dtype, head size) is remembered.
KERNEL_OPTIONS: tuple[dict[str, int] | None, ...] = (
    None,
    {"BLOCK_M": 64, "BLOCK_N": 64},
    {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1},
)
_WORKING_OPTIONS: dict[tuple[str, torch.dtype, int], int] = {}
_UNFUSED: set[str] = set()
"""Device types where the fused corrected attention failed to run (this process)."""


def _call_compiled(
    backend: str, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, **kwargs: Any
) -> Any:
    """The compiled call (`mpic.kernels.compiled`: dynamic shapes, one graph per mask rule and
    call kind; past dynamo's recompile limit the eager call answers, counted and logged) with
    the first `KERNEL_OPTIONS` entry that lowers for this input kind."""
    call = compiled(flex_attention, backend, eager=_eager_flex)
    key = (qh.device.type, qh.dtype, qh.shape[-1])
    start = _WORKING_OPTIONS.get(key, 0)
    for i in range(start, len(KERNEL_OPTIONS)):
        try:
            out = call(qh, kh, vh, kernel_options=KERNEL_OPTIONS[i], **kwargs)
        except Exception:  # inductor lowering errors have no stable public type
            if i == len(KERNEL_OPTIONS) - 1:
                raise
            continue
        _WORKING_OPTIONS[key] = i
        return out
    raise AssertionError("unreachable")


def _eager_flex(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, **kwargs: Any) -> Any:
    """FlexAttention's eager path (its warning about it silenced: chosen on purpose here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*without torch.compile", UserWarning)
        return flex_attention(qh, kh, vh, **kwargs)


@dataclass
class FlexCorrected:
    """What `FlexBackend.prepare_corrected` builds for one query set and one linked set: the
    two groups' block masks of the fused corrected path."""

    linked_mask: BlockMask
    """`kv_idx <= q_index[q_idx]` and the key is linked (group A)."""
    other_mask: BlockMask
    """`kv_idx <= q_index[q_idx]` and the key is not linked (group B)."""
    shape: FlexShape
    """Query rows and keys the masks cover (padded: `FlexShape`)."""
    args: tuple[torch.Tensor, torch.Tensor, int]
    """(q_index, linked, num_keys): to build the unfused state if the fused call fails."""
    fallback: Any = None
    """`mpic.kernels.correction`'s state, once the fused call has failed."""


@dataclass(frozen=True)
class FlexShape:
    """The sizes one query set's FlexAttention calls run at.

    A block mask of ONE query block or ONE key block has size-1 dimensions, which dynamo
    specialises (a graph for 1, another for > 1, then recompiles), so short query sets and
    short key ranges are padded to two blocks: extra query rows repeat the last query's index
    (their output is dropped), extra keys lie past every query's index (masked out)."""

    rows: int
    """Real query rows S."""
    padded_rows: int
    """Rows the kernel runs (S, or two blocks when S fits one)."""
    kv_len: int
    """Keys [0, kv_len) may be visible: max(q_index) + 1 for host indices, all keys for device
    indices (reading the maximum would sync; the mask skips the rest)."""
    padded_kv: int
    """Keys the kernel reads (kv_len, or two blocks when kv_len fits one)."""


@dataclass
class FlexState:
    """What `FlexBackend.prepare` builds for one query set."""

    block_mask: BlockMask | None
    """Mask over the padded [rows, keys] (`shape`); None for a single query."""
    kv_len: int
    """Keys [0, kv_len) are visible to some query (see `FlexShape.kv_len`)."""
    single_mask: torch.Tensor | None = None
    """bool [1, kv_len] for a single query on a device (key j visible iff j <= its index)."""
    shape: FlexShape | None = None
    """The padded sizes of the block mask (None for a single query)."""


class FlexBackend(AttentionBackend):
    """One FlexAttention call per layer (see the module docstring).

    compile: None = compiled on CUDA, eager elsewhere; True/False to force. compile_backend:
    dynamo's backend for the compiled call (`inductor`, the fused Triton kernel on CUDA;
    `aot_eager` runs the compiled path on the CPU, where torch 2.13's inductor cannot generate
    FlexAttention's CPU code: tests). read_indices: None = bound the keys by max(q_index) only
    where the indices are host tensors (reading device indices would sync); False never reads
    them (the sync-free path, also testable on CPU).
    """

    name = "flex"

    def __init__(
        self,
        compile: bool | None = None,
        block_size: int = 128,
        read_indices: bool | None = None,
        fused_correction: bool | None = None,
        compile_backend: str = "inductor",
    ) -> None:
        self.compile = compile
        self.block_size = block_size
        self.read_indices = read_indices
        self.fused_correction = fused_correction
        """The linked-key correction as two FlexAttention calls returning their log-sum-exps:
        None = on CUDA (where the CPU's two fused SDPA calls do not run), True/False to force.
        Off on a device type where a fused call has failed in this process (`_UNFUSED`)."""
        self.compile_backend = compile_backend

    def prepare(self, q_index: torch.Tensor, num_keys: int) -> FlexState:
        """Block mask of `kv_idx <= q_index[q_idx]`, built on q_index's device without a sync."""
        kv_len = self._kv_len(q_index, num_keys)
        if q_index.numel() == 1:
            if self._on_host(q_index):
                return FlexState(None, kv_len)
            keys = torch.arange(kv_len, device=q_index.device)
            return FlexState(None, kv_len, (keys <= q_index)[None])
        shape = self._shape(q_index, kv_len)
        return FlexState(self._block_mask(q_index, None, shape), kv_len, shape=shape)

    def _compiled_for(self, q: torch.Tensor) -> bool:
        """Whether calls on q's device run compiled (`compile`; None: on CUDA)."""
        return q.is_cuda if self.compile is None else self.compile

    def _on_host(self, q_index: torch.Tensor) -> bool:
        """Whether the indices may be read (host tensors, unless `read_indices` says)."""
        return q_index.device.type == "cpu" if self.read_indices is None else self.read_indices

    def _kv_len(self, q_index: torch.Tensor, num_keys: int) -> int:
        """Keys passed to the kernel: max(q_index) + 1 where the indices may be read (one host
        read), else all `num_keys` (the block mask skips the rest; no sync)."""
        return min(int(q_index[-1]) + 1, num_keys) if self._on_host(q_index) else num_keys

    def _shape(self, q_index: torch.Tensor, kv_len: int) -> FlexShape:
        """`FlexShape` of S = len(q_index) queries over kv_len keys."""

        def two_blocks(n: int) -> int:
            return n if n > self.block_size else 2 * self.block_size

        rows = int(q_index.numel())
        return FlexShape(rows, two_blocks(rows), kv_len, two_blocks(kv_len))

    def _block_mask(
        self, q_index: torch.Tensor, keep: torch.Tensor | None, shape: FlexShape
    ) -> BlockMask:
        """FlexAttention block mask of `causal_rule(q_index, keep)` over the padded [rows, keys]
        of `shape` (`mpic.kernels.block_masks`); keep: None or bool [padded_kv] on q_index's
        device."""
        # rows past the real ones see what the last query sees (their output is dropped)
        return causal_block_mask(q_index, keep, shape.padded_rows, shape.padded_kv, self.block_size)

    def prepare_corrected(self, q_index: torch.Tensor, linked: torch.Tensor, num_keys: int) -> Any:
        """The two groups' block masks (`FlexCorrected`) where the correction is fused, else
        the default state (`mpic.kernels.correction.prepare_corrected`). No host sync on CUDA."""
        fused = q_index.is_cuda if self.fused_correction is None else self.fused_correction
        # decoding (one query) and a device where the fused call failed: the default path
        if not fused or q_index.device.type in _UNFUSED or q_index.numel() < 2:
            return super().prepare_corrected(q_index, linked, num_keys)
        shape = self._shape(q_index, self._kv_len(q_index, num_keys))
        link = torch.zeros(shape.padded_kv, dtype=torch.bool, device=q_index.device)
        link[: shape.kv_len] = linked[: shape.kv_len].to(q_index.device)
        return FlexCorrected(
            self._block_mask(q_index, link, shape),
            self._block_mask(q_index, ~link, shape),
            shape,
            (q_index, linked, num_keys),
        )

    def attend_corrected(
        self,
        state: Any,
        q: torch.Tensor,
        q_index: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        linked: torch.Tensor,
        s: float,
        scale: float | None = None,
        corrected_state: Any = None,
    ) -> torch.Tensor:
        """With a `FlexCorrected` state: one FlexAttention call per group (A: linked keys, B:
        the rest), each returning its log-sum-exp, merged by `merge_groups` (the equation of
        `mpic.kernels.correction`). If that call fails (a kernel that does not lower), this
        request falls back to the default path, with a warning. Else the default path."""
        if not isinstance(corrected_state, FlexCorrected):
            return super().attend_corrected(
                state, q, q_index, keys, values, linked, s, scale, corrected_state
            )
        if corrected_state.fallback is None:
            try:
                return self._two_flex_calls(corrected_state, q, keys, values, s, scale)
            except Exception as exc:  # inductor lowering errors have no stable public type
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                warnings.warn(
                    f"fused corrected attention failed ({type(exc).__name__}: {first}); "
                    "unfused path used",
                    stacklevel=2,
                )
                _UNFUSED.add(q.device.type)  # later requests do not retry the lowering
                corrected_state.fallback = super().prepare_corrected(*corrected_state.args)
        return super().attend_corrected(
            state, q, q_index, keys, values, linked, s, scale, corrected_state.fallback
        )

    def _two_flex_calls(
        self,
        prepared: FlexCorrected,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        s: float,
        scale: float | None,
    ) -> torch.Tensor:
        """q [S, H, D], keys/values [N, H_kv, D] -> [S, H, D] in q's dtype."""
        from mpic.kernels.correction import merge_groups

        masks = (prepared.linked_mask, prepared.other_mask)
        # per group: out [H, S, D], lse [H, S] (-inf for a query that sees no key of the group)
        (out_a, lse_a), (out_b, lse_b) = self._flex_calls(
            q, keys, values, prepared.shape, masks, scale, return_lse=True
        )
        merge: Any = merge_groups
        if self._compiled_for(q):  # one fused kernel, not 3
            merge = compiled(merge_groups, self.compile_backend, on_error="eager")
        return merge(out_a, lse_a, out_b, lse_b, s).transpose(0, 1).to(q.dtype)

    def _flex_calls(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        shape: FlexShape,
        masks: Sequence[BlockMask],
        scale: float | None,
        return_lse: bool = False,
    ) -> list[Any]:
        """One FlexAttention call per block mask over the same q [S, H, D] and keys/values
        [N, H_kv, D] (the first `shape.padded_kv` keys; rows and keys zero-padded to `shape`):
        compiled where `compile` says (the head size zero-padded to a power of two, as fused
        kernels want), else eager. Per mask: out [H, S, D], or with `return_lse` (out, lse
        [H, S])."""
        head_dim = q.shape[-1]
        kwargs: dict[str, Any] = {
            "scale": head_dim**-0.5 if scale is None else scale,
            "enable_gqa": q.shape[1] != keys.shape[1],
        }
        if return_lse and AuxRequest is not None:
            kwargs["return_aux"] = AuxRequest(lse=True)
        elif return_lse:
            kwargs["return_lse"] = True
        qh = q.transpose(0, 1)[None]  # [1, H, S, D]
        if shape.padded_kv < keys.shape[0]:  # else all keys: no slice op
            keys, values = keys[: shape.padded_kv], values[: shape.padded_kv]
        # [1, H_kv, <= padded_kv, D]: contiguous (no copy below) when the linked KV is stored
        # heads-major and every key is read (device indices: `DenseLinkedKV(heads_major=True)`)
        kh, vh = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
        compiled = self._compiled_for(q)
        head_pad = (1 << (head_dim - 1).bit_length()) - head_dim if compiled else 0
        row_pad, key_pad = shape.padded_rows - shape.rows, shape.padded_kv - kh.shape[2]
        if head_pad or row_pad:
            qh = F.pad(qh, (0, head_pad, 0, row_pad))
        if head_pad or key_pad:  # keys past the tensor: zeros, masked out
            kh, vh = F.pad(kh, (0, head_pad, 0, key_pad)), F.pad(vh, (0, head_pad, 0, key_pad))
        if compiled:
            qh, kh, vh = qh.contiguous(), kh.contiguous(), vh.contiguous()
        results = []
        for mask in masks:
            if compiled:
                res = _call_compiled(self.compile_backend, qh, kh, vh, block_mask=mask, **kwargs)
            else:
                res = _eager_flex(qh, kh, vh, block_mask=mask, **kwargs)
            if return_lse:
                out, lse = res[0], res[1].lse if AuxRequest is not None else res[1]
                results.append((out[0, :, : shape.rows, :head_dim], lse[0, :, : shape.rows]))
            else:
                results.append(res[0, :, : shape.rows, :head_dim])
        return results

    def attend(
        self,
        state: FlexState,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scale: float | None = None,
    ) -> torch.Tensor:
        """One FlexAttention (or, for one query, SDPA) call -> [S, H, D]."""
        if state.block_mask is None or state.shape is None:
            qh = q.transpose(0, 1)[None]  # [1, H, S, D]
            kh = keys[: state.kv_len].transpose(0, 1)[None]  # [1, H_kv, kv_len, D]
            vh = values[: state.kv_len].transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(
                qh,
                kh,
                vh,
                attn_mask=state.single_mask,
                scale=q.shape[-1] ** -0.5 if scale is None else scale,
                enable_gqa=q.shape[1] != keys.shape[1],
            )
            return out[0].transpose(0, 1)
        (out,) = self._flex_calls(q, keys, values, state.shape, [state.block_mask], scale)
        return out.transpose(0, 1)
