"""Per-model calibrations of the selection policies (linker): Scout's correction scale per
budget (`scout`) and VLCache's per-layer recompute ratios (`vlcache`)."""
