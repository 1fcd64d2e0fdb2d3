"""`mpic bench offline` (CLI process): TTFT and fidelity per policy and image count.

- `bench`: the command, the rows and the table (and `kl_divergence`, which the fidelity and
  compression benchmarks reuse);
- `engines`: the engines it drives, by name (`get_engine`, `register_engine`: any
  `mpic.engine.protocol.Engine`; `reference` and `vllm`), and `Driver`, its requests to one
  through the protocol;
- `op_counts`: where a prefill's time goes (op counts, syncs, copies, GPU profile).
"""
