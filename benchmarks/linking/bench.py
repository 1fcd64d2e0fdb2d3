"""`mpic bench linking` (CLI process; vLLM's engine core and worker in child processes): what
linking costs the requests around it on the vLLM worker (issue 22 items 2 and 3).

- Head-of-line: D requests decode (streamed, `ignore_eos`), then M new linked requests arrive
  whose entries live only in an object store that answers every GET `delay_s` late
  (`mpic.benchmarks.delayed_s3`; the worker's memory tier is 0 bytes, so every entry is a GET).
  The decoders' inter-token latency (ITL) while the new requests load and link is compared with
  their ITL in the same run before the arrivals (unloaded), for the connector's load modes
  (`async_loads`): True, reads and linking in the background (the linking thread); "reads",
  reads in the background (vLLM's WAITING_FOR_REMOTE_KVS), linking inside a step; False, both
  inside the step. `link_share` paces the linking thread while requests decode. The window is
  split with the worker's spans (`read_spans`, `link_spans`): gaps while an entry read is in
  flight and no link runs (what the loads cost the step) and gaps that overlap a link pass (what
  the recomputation costs). `exact=True` sends the same new prompts as plain vLLM requests with
  their images (no linking: vLLM's own prefill of them), the cost any prefill of new requests
  puts on the decoders.
- Batching: B linked requests (entries in the worker's memory tier) arrive together; their TTFT
  with the step's requests linked in one selective pass (`batch_links`) vs one pass per request,
  and the connector's counters (`largest_pass`).

Both run on the small random LLaVA of `mpic demo` (or `--model`), float32 on CPU. This module is
the command and its outputs; the parts are `mpic.benchmarks.linking.head_of_line` and
`mpic.benchmarks.linking.batching`, the requests they send `mpic.benchmarks.linking.requests`.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import typer

from mpic.benchmarks.linking.batching import Batching, batching
from mpic.benchmarks.linking.head_of_line import HeadOfLine, head_of_line


def mode_name(async_loads: bool | str, exact: bool = False) -> str:
    """A load mode in words."""
    if exact:
        return "plain vLLM prefill of the same prompts (no linking)"
    if async_loads is True:
        return "reads + linking off the step"
    if async_loads == "reads":
        return "reads off the step, linking in it"
    return "reads + linking in the step"


def write_outputs(hol: list[HeadOfLine], bat: list[Batching], out: Path) -> None:
    """JSON and two PNGs (`linking_hol.png`, `linking_batch.png`) into `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "linking.json").write_text(
        json.dumps(
            {"head_of_line": [asdict(h) for h in hol], "batching": [asdict(b) for b in bat]},
            indent=1,
        )  # fmt: skip
    )
    if hol:
        fig, ax = plt.subplots(figsize=(8, 4))
        for h in hol:
            xs, ys = zip(*h.timeline, strict=False) if h.timeline else ([], [])
            label = f"{mode_name(h.async_loads, h.exact)}: ITL x{h.ratio:.2f}"
            ax.plot(xs, ys, ".-", ms=3, lw=0.8, label=label)
        ax.axvline(0, color="gray", ls="--", lw=0.8)
        for h in hol[:1]:  # the first run's reads and link passes
            for a, b, *_ in h.worker.get("read_spans", []):
                ax.axvspan(a, b, color="tab:green", alpha=0.08, lw=0)
            for a, b, *_ in h.worker.get("link_spans", []):
                ax.axvspan(a, b, color="tab:red", alpha=0.15, lw=0)
        ax.set_xlabel(
            "token time (s) since the new requests arrived (first run: reads green, links red)"
        )
        ax.set_ylabel("decoders' inter-token gap (ms)")
        ax.set_yscale("log")
        delay = hol[0].delay_s * 1e3
        ax.set_title(f"Decoding while new requests' entries load (S3 GET +{delay:.0f} ms)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "linking_hol.png", dpi=120)
        plt.close(fig)
    if bat:
        fig, ax = plt.subplots(figsize=(6, 4))
        for b in bat:
            xs = np.sort(b.ttft_ms)
            label = (
                f"{b.policy}, {'one pass' if b.batch_links else 'one pass per request'} "
                f"(p50 {b.ttft_p50_ms:.0f} ms, largest pass {b.stats['largest_pass']})"
            )
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), "o-", label=label)
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{bat[0].requests} linked requests arriving together")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "linking_batch.png", dpi=120)
        plt.close(fig)


def command(
    model: str = typer.Option(None, "--model", help="Model folder (default: the demo's LLaVA)."),
    delay_ms: float = typer.Option(200.0, "--delay-ms", min=0, help="S3 GET delay."),
    requests: int = typer.Option(8, "--requests", min=1, max=64, help="Batching: requests."),
    link_share: float = typer.Option(
        1.0, "--link-share", min=0.01, max=1.0, help="Linking thread's share while decoding."
    ),
    modes: str = typer.Option(
        "reads,background,step,exact",
        "--modes",
        help="Head-of-line load modes to run (exact: the same prompts as plain vLLM requests).",
    ),
    policies: str = typer.Option(
        "mpic-32,auto",
        "--policies",
        help="Batching: the policies whose requests arrive together, each batched and one pass "
        "per request (every policy joins the batched pass).",
    ),
    out: str = typer.Option("out/linking", "--out", help="Folder for JSON and PNGs."),
) -> None:
    """Head-of-line (async vs sync entry reads) and batched linking on the vLLM worker."""
    from rich.console import Console
    from rich.table import Table

    from mpic.deployments.local import prepare_local
    from mpic.linker.policies import policy_names

    names = {"background": True, "reads": "reads", "step": False, "exact": "reads"}
    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    if unknown := set(chosen) - set(names):
        raise typer.BadParameter(f"unknown mode(s) {sorted(unknown)}; choose from {list(names)}")
    batched = [p.strip() for p in policies.split(",") if p.strip()]
    try:
        policy_names(policies)  # checked before any model is written or engine started
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--policies") from exc
    if model is None:
        from mpic.deployments.config import ServeAppConfig

        model = prepare_local(ServeAppConfig()).engine.model
    hol = [
        head_of_line(
            model, delay_ms / 1e3, names[m], link_share=link_share, exact=m == "exact"
        )  # fmt: skip
        for m in chosen
    ]
    bat = [
        batching(model, requests, batch_links=b, policy=p) for p in batched for b in (True, False)
    ]
    table = Table(title="Linking on the vLLM worker")
    for col in ["run", "figure"]:
        table.add_column(col)
    for h in hol:
        table.add_row(
            f"{mode_name(h.async_loads, h.exact)}, GET +{h.delay_s * 1e3:.0f} ms",
            f"ITL {h.itl_unloaded_ms:.1f} -> {h.itl_loading_ms:.1f} ms (x{h.ratio:.2f}, max "
            f"{h.itl_max_loading_ms:.0f}); while only reads run {h.itl_reads_ms:.1f} ms "
            f"(x{h.reads_ratio:.2f}, max {h.itl_reads_max_ms:.0f}, {h.reads_gaps} gaps); "
            f"over link passes {h.itl_linking_ms:.1f} ms; "
            f"new TTFT p50 {np.median(h.new_ttft_ms):.0f} ms",
        )
    for b in bat:
        table.add_row(
            f"{b.policy}: {'one pass' if b.batch_links else 'one pass per request'}",
            f"TTFT p50 {b.ttft_p50_ms:.0f} ms; {b.stats}",
        )
    Console().print(table)
    write_outputs(hol, bat, Path(out))
