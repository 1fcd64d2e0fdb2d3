"""Where the host time of one policy's prefill goes (`scripts/gpu/run.sh` stage `profile`; any
device): the reference engine's untimed prefill (`prefill_fn`, the one `mpic bench offline`
counts) run warm, timed without a profiler, then under cProfile.

    python scripts/gpu/host_profile.py MODEL_DIR [--policy mpic-32] [--images 1] [--device cuda]

Prints the unprofiled milliseconds per prefill, the top functions by own time (kernel launches
and compiled-call wrappers show here on a GPU) and the project's functions by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from mpic.benchmarks.offline.engines import Driver, prefill_request, reference_engine
from mpic.samples import interleaved_prompt, synthetic_png


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--policy", default="mpic-32")
    parser.add_argument("--images", type=int, default=1)
    parser.add_argument("--attention", default="flex")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    engine = reference_engine(args.model, args.device, args.dtype, args.attention)
    driver = Driver(engine)
    try:
        ids = [driver.add_image(synthetic_png(i, size=336)) for i in range(args.images)]
        request = prefill_request(interleaved_prompt(ids), args.policy, driver.entries)
        prefill = engine.prefill_fn(request)
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
        for _ in range(3):  # compilation and autotuning settle
            prefill()
        sync()
        start = time.perf_counter()
        for _ in range(args.repeats):
            prefill()
        sync()
        ms = (time.perf_counter() - start) / args.repeats * 1000
        print(f"{args.policy}, {args.images} images, {args.attention}: {ms:.1f} ms per prefill")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.repeats):
            prefill()
        sync()
        profile.disable()
        stats = pstats.Stats(profile)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumtime").print_stats("/mpic/", 30)
    finally:
        driver.close()


if __name__ == "__main__":
    main()
