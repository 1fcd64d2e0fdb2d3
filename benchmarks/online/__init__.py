"""`mpic bench online` (CLI process; vLLM's engine core and worker in child processes): the
MPIC workload served online on one vLLM engine against vLLM's prefix caching and full
recomputation.

- `bench`: the command and the open loop (Poisson arrivals);
- `results`: the open loop's results and outputs;
- `closed`: the closed loop (`--closed-loop`: N concurrent clients);
- `closed_results`: the closed loop's results and outputs;
- `workload`: what both loops share (users, items, chats, the engine session, token timing).
"""
