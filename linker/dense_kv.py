"""Dense linked KV over [L, N, H_kv, D] tensors (reference runner process).

The `LinkedKV` implementation of the reference runner and of the two-step baselines' text pass:
slots start as the dummy (zero) cache (paper section 4.1), `mpic.linker.link` fills item slots
of all layers at once (`write_layers`) with rotated cached KV, and the selective prefill
overwrites recomputed slots layer by layer. Extra capacity beyond the prompt holds decoded tokens
(`attend` never looks past the query). Attention goes through one `mpic.kernels.attention`
backend (`flex` on CUDA, `sdpa_runs` on CPU by default), whose mask is prepared once per query
set and shared by all layers.
"""

from __future__ import annotations

import torch

from mpic.kernels.attention import SelectiveAttention, default_backend_name
from mpic.kernels.attention_backend import AttentionBackend
from mpic.linker.correction import LinkCorrection


class DenseLinkedKV:
    """Linked KV of one sequence; indices are prompt (then decode) indices.

    backend: an attention backend name (`mpic.kernels.attention.BACKENDS`) or instance (e.g.
    a configured `FlexBackend`), default by device.
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
    ) -> None:
        shape = (num_layers, capacity, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        """[L, capacity, H_kv, D] post-RoPE keys."""
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        """[L, capacity, H_kv, D]."""
        self.attention = SelectiveAttention(backend or default_backend_name(self.keys.device))
        self.correction: LinkCorrection | None = None
        """APE-style correction of linked keys (`set_correction`), applied by `attend`."""

    @property
    def capacity(self) -> int:
        """Number of slots."""
        return int(self.keys.shape[1])

    def write(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite slots `index` (int64 [S]) of `layer` with k, v [S, H_kv, D]."""
        index = index.to(self.keys.device)
        self.keys[layer, index] = k.to(self.keys.device, self.keys.dtype)
        self.values[layer, index] = v.to(self.values.device, self.values.dtype)

    def write_layers(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite slots `index` (int64 [S]) of every layer with k, v [L, S, H_kv, D]."""
        index = index.to(self.keys.device)
        self.keys[:, index] = k.to(self.keys.device, self.keys.dtype)
        self.values[:, index] = v.to(self.values.device, self.values.dtype)

    def read_keys(self, layer: int, index: torch.Tensor) -> torch.Tensor:
        """Keys linked at `index` of `layer`: [S, H_kv, D]."""
        return self.keys[layer, index.to(self.keys.device)]

    def set_correction(self, correction: LinkCorrection | None) -> None:
        """Apply (or, with None, stop applying) the APE-style correction in `attend`."""
        self.correction = correction

    def attend(self, layer: int, q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Queries q [S, H, D] at `index` over keys at prompt indices <= the query -> [S, H, D].

        Pass the same `index` tensor object to every layer: the backend's mask is built for the
        first and reused (a new object rebuilds it). With a correction set, the linked keys'
        log-sum-exp is scaled (`mpic.kernels.correction`)."""
        if index.device != self.keys.device:
            index = index.to(self.keys.device)
        corr = self.correction
        if corr is not None and corr.active and corr.scale_at(layer) != 1.0:
            linked = corr.linked(layer, self.capacity, self.keys.device)
            keys, values = self.keys[layer], self.values[layer]
            return self.attention(q, index, keys, values, linked=linked, s=corr.scale_at(layer))
        return self.attention(q, index, self.keys[layer], self.values[layer])
