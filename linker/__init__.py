"""Linking cached KV into prompts: link plans, token-selection policies, RoPE re-positioning and
the one-pass selective prefill (MPIC paper sections 4.1-4.2). Imports no vLLM."""
