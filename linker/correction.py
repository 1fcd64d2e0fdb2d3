"""Which keys the APE-style attention correction applies to, per layer, for one prompt (linker;
reference runner and vLLM worker).

The equation (`mpic.kernels.correction`): per query, the log-sum-exp of its attention over the
keys that are LINKED at a layer (item tokens whose cached, rotated K/V is used there: recompute
depth <= layer) is multiplied by S before it is merged with the rest. S may differ between the
first and the second half of the layers (`late_scale`: on SmolLM2 a gentler S in the first
half, 0.9, and 0.8 in the second beat one S everywhere at 20-30% recomputed; docs/fidelity.md).
A policy that wants it (`scout-*`) returns a `LinkCorrection` from `Policy.correction`;
`link_and_prefill` hands it to the linked KV (`LinkedKV.set_correction`) before the selective
prefill. Decoding is plain attention on both engines by default (the reference runner drops
the correction after the prefill unless `ReferenceRunner(decode_correction=True)`: then decode
tokens are fresh keys and the prompt's linked keys stay linked).
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field

import torch

from mpic.kernels.correction import linked_mask


@dataclass
class LinkCorrection:
    """S and the plan's linked-key layout; `linked(layer, capacity)` gives the mask."""

    scale: float
    """S: the linked group's log-sum-exp is multiplied by it (1 = plain attention); the S of
    layers below `split_layer` when `late_scale` is set."""
    is_item: torch.Tensor
    """bool [N]: item tokens (text has no cached KV and is never linked)."""
    depth: torch.Tensor
    """int64 [N]: the recompute depths actually run (a token is linked at layers >= depth)."""
    late_scale: float | None = None
    """S of layers >= `split_layer` (None: `scale` at every layer)."""
    split_layer: int = 0
    """First layer of `late_scale`."""
    _masks: dict[tuple[int, int, str], torch.Tensor] = field(default_factory=dict, repr=False)
    _levels: dict[str, list[int]] = field(default_factory=dict, repr=False)

    @property
    def active(self) -> bool:
        """False when S == 1 at every layer (nothing to do)."""
        return self.scale != 1.0 or (self.late_scale is not None and self.late_scale != 1.0)

    def scale_at(self, layer: int) -> float:
        """S of `layer` (1 = plain attention there)."""
        if self.late_scale is not None and layer >= self.split_layer:
            return self.late_scale
        return self.scale

    def linked(self, layer: int, capacity: int, device: torch.device) -> torch.Tensor:
        """bool [capacity] on `device`: keys linked at `layer` (cached per layer and device;
        layers with the same depth threshold share one tensor object)."""
        # the mask changes only at layers equal to a depth value: key it by how many distinct
        # depths are <= layer, so layers with the same linked set share ONE tensor object (the
        # attention backend keeps its prepared masks while it is handed the same object)
        if "depths" not in self._levels:
            self._levels["depths"] = torch.unique(self.depth.cpu()).tolist()
        level = bisect.bisect_right(self._levels["depths"], layer)  # host ints: no tensor op
        key = (level, capacity, str(device))
        if key not in self._masks:
            mask = linked_mask(self.is_item.cpu(), self.depth.cpu(), layer, capacity)
            self._masks[key] = mask.to(device)
        return self._masks[key]

    def with_depth(self, depth: torch.Tensor) -> LinkCorrection:
        """The same S over other depths (after an in-pass selection)."""
        return dataclasses.replace(self, depth=depth, _masks={}, _levels={})
