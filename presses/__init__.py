"""KV presses: compress a request's prompt KV after the linked prefill, before decoding
(docs/presses.md). Floor 2: imports only mpic core and kernels."""

PRESS_NAMES = ("elastic", "mm-shiftkv", "meda", "window", "snapkv")
"""Registered press names (torch-free, for request validation; `registry.PRESSES` has them)."""
