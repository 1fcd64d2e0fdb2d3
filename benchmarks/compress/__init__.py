"""`mpic bench compress` (CLI process): KV presses per budget on one engine.

- `bench`: the command (options, table, JSON, plot) and the engine it measures (`get_engine`);
- `rows`: the measuring code, the same for both engines (`CompressBench` through the `Engine`
  protocol, `run_compress`) and the table's rows;
- `vllm_bench`: what vLLM measures differently (`--engine vllm`; vLLM's processes are its
  children).
"""
