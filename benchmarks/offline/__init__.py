"""`mpic bench offline` (CLI process): TTFT and fidelity per policy and image count.

- `bench`: the command, the rows and the table (and `kl_divergence`, which the fidelity and
  compression benchmarks reuse);
- `engines`: the engines it drives, by name (`BenchEngine`, `register_engine`; the reference
  engine);
- `vllm_engine`: the vLLM engine (`--engine vllm`);
- `timed_prefill`: the record every engine returns from `first_token`;
- `op_counts`: where a prefill's time goes (op counts, syncs, copies, GPU profile).
"""
