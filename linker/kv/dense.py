"""Dense linked KV over [L, N, H_kv, D] tensors (reference runner process).

The `LinkedKV` implementation of the reference runner and of the two-step baselines' text pass:
slots start as the dummy (zero) cache (paper section 4.1), `mpic.linker.link` fills item slots
of all layers at once (`write_layers`) with rotated cached KV, and the selective prefill
overwrites recomputed slots layer by layer. Extra capacity beyond the prompt holds decoded tokens
(`attend` never looks past the query). Attention goes through one `mpic.kernels.attention`
backend (`flex` on CUDA, `sdpa_runs` on CPU by default), whose mask is prepared once per query
set and shared by all layers.

Per layer the pass costs two index writes and one attention call: the layer views are taken
once (`unbind`), not per write and per attend, and no-op `.to` calls are skipped. With
`heads_major` (the reference runner's prompt KV) the storage is [L, H_kv, capacity, D] and
`keys` / `values` are its [L, capacity, H_kv, D] views: a layer's keys as the kernels read them
([H_kv, N, D]) are then contiguous, so a compiled FlexAttention call over all keys (CUDA) no
longer copies the layer's whole K and V into that layout per layer.
"""

from __future__ import annotations

import torch

from mpic.kernels.attention import SelectiveAttention, default_backend_name
from mpic.kernels.attention_backend import AttentionBackend
from mpic.linker.correction import LinkCorrection


class DenseLinkedKV:
    """Linked KV of one sequence; indices are prompt (then decode) indices.

    backend: an attention backend name (`mpic.kernels.attention.BACKENDS`) or instance (e.g.
    a configured `FlexBackend`), default by device. heads_major: store K/V as [L, H_kv,
    capacity, D] (module docstring; `keys` / `values` keep their [L, capacity, H_kv, D] shape).
    """

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        backend: str | AttentionBackend | None = None,
        heads_major: bool = False,
    ) -> None:
        def zeros() -> torch.Tensor:
            if heads_major:  # stored [L, H_kv, capacity, D], seen as [L, capacity, H_kv, D]
                shape = (num_layers, num_kv_heads, capacity, head_dim)
                return torch.zeros(shape, dtype=dtype, device=device).transpose(1, 2)
            shape = (num_layers, capacity, num_kv_heads, head_dim)
            return torch.zeros(shape, dtype=dtype, device=device)

        self.keys = zeros()
        """[L, capacity, H_kv, D] post-RoPE keys (with `heads_major` a view of [L, H_kv,
        capacity, D] storage)."""
        self.values = zeros()
        """[L, capacity, H_kv, D], laid out as `keys`."""
        self._layer_keys = self.keys.unbind(0)
        """Per-layer views [capacity, H_kv, D] of `keys`, taken once (one op, not one per use)."""
        self._layer_values = self.values.unbind(0)
        self.attention = SelectiveAttention(backend or default_backend_name(self.keys.device))
        self.correction: LinkCorrection | None = None
        """APE-style correction of linked keys (`set_correction`), applied by `attend`."""

    @property
    def capacity(self) -> int:
        """Number of slots."""
        return int(self.keys.shape[1])

    def write(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite slots `index` (int64 [S]) of `layer` with k, v [S, H_kv, D]: one index
        write each (`index` on the KV's device, as the pass hands it: no copy per layer)."""
        index, k, v = self._here(index), self._here(k, True), self._here(v, True)
        self._layer_keys[layer][index] = k
        self._layer_values[layer][index] = v

    def write_layers(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite slots `index` (int64 [S]) of every layer with k, v [L, S, H_kv, D]."""
        index, k, v = self._here(index), self._here(k, True), self._here(v, True)
        self.keys[:, index] = k
        self.values[:, index] = v

    def _here(self, t: torch.Tensor, kv: bool = False) -> torch.Tensor:
        """`t` on the KV's device (and, for K/V rows, in its dtype); no op when it already is."""
        dtype = self.keys.dtype if kv else t.dtype
        if t.device != self.keys.device or t.dtype != dtype:
            return t.to(self.keys.device, dtype)
        return t

    def read_keys(self, layer: int, index: torch.Tensor) -> torch.Tensor:
        """Keys linked at `index` of `layer`: [S, H_kv, D]."""
        return self._layer_keys[layer][self._here(index)]

    def set_correction(self, correction: LinkCorrection | None) -> None:
        """Apply (or, with None, stop applying) the APE-style correction in `attend`."""
        self.correction = correction

    def attend(self, layer: int, q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Queries q [S, H, D] at `index` over keys at prompt indices <= the query -> [S, H, D].

        Pass the same `index` tensor object to every layer: the backend's mask is built for the
        first and reused (a new object rebuilds it). With a correction set, the linked keys'
        log-sum-exp is scaled (`mpic.kernels.correction`)."""
        index = self._here(index)
        keys, values = self._layer_keys[layer], self._layer_values[layer]
        corr = self.correction
        if corr is not None and corr.active and corr.scale_at(layer) != 1.0:
            linked = corr.linked(layer, self.capacity, self.keys.device)
            return self.attention(q, index, keys, values, linked=linked, s=corr.scale_at(layer))
        return self.attention(q, index, keys, values)
