"""`mpic bench fidelity` (CLI process): how close each policy's answers come to exact
recomputation on a trained language model, with cached documents as the items.

- `bench`: the command and the fidelity rows (`run_fidelity`);
- `answers`: the greedy answers, asked of the reference engine through the `Engine` protocol;
- `prompts`: the standard-library passages and the prompts built from them (other benchmarks,
  the demo and the scout calibration reuse them);
- `report`: the table and the PNG;
- `task`: the needle task (`--task needle`);
- `noise_floor`: the noise floors (`--noise-floor`).
"""
