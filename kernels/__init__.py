"""Selective attention over linked keys (`attention`: the backend seam; `sdpa_runs`, `flex`: the
backends) and RoPE delta rotation (`rope`). Pure torch: CPU and CUDA."""
