"""`mpic bench compress` (CLI process): KV presses per budget on one engine.

- `bench`: the command and the reference engine's run;
- `vllm_bench`: the run on vLLM (`--engine vllm`; vLLM's processes are its children);
- `rows`: the table's rows, shared by both runs.
"""
