"""`mpic bench linking` (CLI process; vLLM's engine core and worker in child processes): what
linking costs the requests around it on the vLLM worker.

- `bench`: the command, its JSON and PNGs;
- `head_of_line`: decoders' ITL while new linked requests load from a slow store;
- `batching`: linked requests in one selective pass or one pass each;
- `requests`: what both parts send (images, the in-process engine, linked requests, streams).
"""
