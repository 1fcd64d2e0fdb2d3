"""KV presses: compress a request's prompt KV after the linked prefill, before decoding
(docs/presses.md). Floor 2: imports only mpic core and kernels."""
