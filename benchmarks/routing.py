"""`mpic bench routing` (CLI process): cache-aware routing vs Serve's power-of-two router.

Starts a local Ray Serve application with 2 LLM-worker replicas (reference engine on the demo's
small random model, filesystem object store, or with `--object-delay-ms` an S3 store whose every
GET answers that late (`mpic.benchmarks.delayed_s3`: a remote store's misses), no disk tier),
once per router
(`llm_router: power-of-two`, then `cache-aware`, each with a fresh store). Workload: U users each
upload K images of their own, then C concurrent clients send R chats in total; each chat is from
a random user and links 2 of that user's images (users revisit their own images). Each replica's
memory tier holds `memory_fraction` of all entries, so the two tiers together hold more than the
working set only if they do not duplicate it: where a chat lands decides whether its entries
come from memory or from the object store.

Per router: memory-tier hit rate (entries served from the serving replica's memory tier over
all linked entries, from each answer's `mpic.tier_hits`), TTFT p50/p99 (client latency of a
1-token answer) over all chats, and p99 over the chats after each client's first (`steady`:
the first chats meet fresh replicas, whose first forward is slow whatever the router; at 120
chats p99 falls within those first 4). Prints a table, writes JSON and a PNG.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
import typer

from mpic.benchmarks.load.bench import make_png

ROUTERS = ("power-of-two", "cache-aware")


@dataclass
class RoutingResult:
    """Figures of one router on the workload."""

    router: str
    requests: int
    entries_linked: int
    tier_hits: dict[str, int]
    hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_p99_steady_s: float
    ttfts: list[float] = field(default_factory=list)


def entry_bytes(model: Path) -> int:
    """Decoded size of one image's entry on `model` (sizes the memory tiers), cached by the
    reference engine through the `Engine` protocol (`Engine.cache_image`)."""
    from mpic.benchmarks.offline.engines import get_engine
    from mpic.storage.tiers.memory import entry_nbytes

    return entry_nbytes(get_engine("reference", str(model)).cache_image(make_png(0)))


def app_config(model: Path, store: Path | str, router: str, memory_bytes: int):
    """The benchmark's ServeAppConfig: 2 fixed LLM-worker replicas, `router`; `store`: a folder
    (filesystem store) or a store URL."""
    from mpic.deployments.config import ServeAppConfig

    small = {"num_cpus": 0.1, "autoscaling": {"min_replicas": 1, "max_replicas": 1}}
    two = {"min_replicas": 2, "max_replicas": 2, "target_ongoing_requests": 2}
    return ServeAppConfig.model_validate(
        {
            "name": f"routing-{router}",
            "route_prefix": f"/{router}",
            "engine": {"kind": "reference", "model": str(model), "max_tokens_default": 1},
            "store": {
                "url": store if isinstance(store, str) else store.as_uri(),
                "fsync": False,
                "memory_bytes": memory_bytes,
            },
            "auth": {"mode": "dev"},
            "ingress": small,
            "encoder": small,
            "retriever": small,
            "resolver": small,
            "llm_worker": {"num_cpus": 0.1, "max_ongoing_requests": 4, "autoscaling": two},
            "llm_router": router,
        }
    )


def run_workload(
    url: str, users: int, images: int, requests: int, clients: int, seed: int
) -> tuple[list[dict], list[float]]:
    """Uploads, then the chats; returns each answer's `mpic` info and its latency."""
    rng = random.Random(seed)
    owned: dict[int, tuple[str, list[str]]] = {}
    for u in range(users):
        key = f"mpic-dev-{['alice', 'bob'][u % 2]}"
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as http:
            ids = []
            for k in range(images):
                resp = http.post(
                    "/v1/files",
                    files={"file": (f"u{u}-{k}.png", make_png(1000 * u + k), "image/png")},
                    data={"purpose": "vision"},
                    timeout=300,
                )
                resp.raise_for_status()
                ids.append(resp.json()["id"])
        owned[u] = (key, ids)
    time.sleep(3)  # let the replicas' routing stats report the uploaded entries
    plan = [
        (u, rng.sample(owned[u][1], 2)) for u in (rng.randrange(users) for _ in range(requests))
    ]

    def one(item: tuple[int, list[str]]) -> tuple[dict, float]:
        u, ids = item
        content = [
            {"type": "text", "text": f"User {u} compares"},
            {"type": "file", "file": {"file_id": ids[0]}},
            {"type": "text", "text": "with"},
            {"type": "file", "file": {"file_id": ids[1]}},
        ]
        body = {
            "model": "mpic",
            "max_tokens": 1,
            "mpic": {"policy": "mpic-32"},
            "messages": [{"role": "user", "content": content}],
        }
        t0 = time.perf_counter()
        resp = httpx.post(
            f"{url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {owned[u][0]}"},
            timeout=300,
        )
        resp.raise_for_status()
        return resp.json()["mpic"], time.perf_counter() - t0

    with ThreadPoolExecutor(clients) as pool:
        out = list(pool.map(one, plan))
    return [m for m, _ in out], [t for _, t in out]


def summarize(router: str, infos: list[dict], ttfts: list[float], clients: int) -> RoutingResult:
    """Hit rate and TTFT percentiles of one run (`ttfts` in the order the chats were sent; the
    steady p99 leaves out the first `clients` chats)."""
    hits: dict[str, int] = {}
    for info in infos:
        for tier, n in info["tier_hits"].items():
            hits[tier] = hits.get(tier, 0) + n
        hits["computed"] = hits.get("computed", 0) + info.get("fallbacks", 0)
    linked = sum(hits.values())
    return RoutingResult(
        router,
        len(infos),
        linked,
        hits,
        hits.get("memory", 0) / linked if linked else 0.0,
        float(np.percentile(ttfts, 50)),
        float(np.percentile(ttfts, 99)),
        float(np.percentile(ttfts[clients:] or ttfts, 99)),
        ttfts=ttfts,
    )


def print_table(results: list[RoutingResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="LLM-worker routing, 2 replicas, users revisit their own images")
    for col in [
        "router",
        "requests",
        "memory hit rate",
        "tier hits",
        "TTFT p50 ms",
        "p99 ms",
        "steady p99 ms",
    ]:
        table.add_column(col)
    for r in results:
        table.add_row(
            r.router,
            str(r.requests),
            f"{r.hit_rate:.1%}",
            json.dumps(r.tier_hits, sort_keys=True),
            f"{r.ttft_p50_s * 1e3:.0f}",
            f"{r.ttft_p99_s * 1e3:.0f}",
            f"{r.ttft_p99_steady_s * 1e3:.0f}",
        )
    Console().print(table)


def write_outputs(results: list[RoutingResult], meta: dict, json_out: str, plot: str) -> None:
    """JSON with every latency, and a PNG: hit rate bars and TTFT distributions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Path(json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(json_out).write_text(
        json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=1)
    )
    Path(plot).parent.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r.router for r in results]
    ax1.bar(names, [100 * r.hit_rate for r in results], color=["tab:gray", "tab:blue"])
    ax1.set_ylabel("memory-tier hit rate (%)")
    ax1.set_ylim(0, 100)
    for r in results:
        xs = np.sort(np.array(r.ttfts) * 1e3)
        ax2.plot(xs, np.linspace(0, 1, len(xs)), label=r.router)
    ax2.set_xlabel("TTFT (ms, 1-token answers)")
    ax2.set_ylabel("fraction of requests")
    ax2.legend()
    fig.suptitle(
        f"{meta['users']} users x {meta['images']} images, {meta['requests']} chats, "
        f"{meta['clients']} clients, 2 replicas"
        + (
            f", object store GET +{meta['object_delay_ms']:.0f} ms"
            if meta["object_delay_ms"]
            else ""
        )
    )
    fig.tight_layout()
    fig.savefig(plot, dpi=120)
    plt.close(fig)


def command(
    users: int = typer.Option(8, "--users", min=1, max=256),
    images: int = typer.Option(3, "--images", min=2, max=32, help="Images per user."),
    requests: int = typer.Option(120, "--requests", min=1, max=100000),
    clients: int = typer.Option(4, "--clients", min=1, max=64),
    memory_fraction: float = typer.Option(
        0.6, "--memory-fraction", min=0.01, max=10, help="Memory tier per replica / all entries."
    ),
    routers: str = typer.Option(",".join(ROUTERS), "--routers"),
    port: int = typer.Option(8000, "--port"),
    seed: int = typer.Option(0, "--seed"),
    object_delay_ms: float = typer.Option(
        0.0,
        "--object-delay-ms",
        min=0,
        max=10000,
        help="Serve entries from an S3 store (moto) whose every GET answers this late: slow "
        "misses. 0: a local filesystem store.",
    ),
    json_out: str = typer.Option("out/routing.json", "--json"),
    plot: str = typer.Option("out/routing.png", "--plot"),
) -> None:
    """Cache-aware vs power-of-two routing at 2 LLM-worker replicas: hit rate, TTFT p50/p99."""
    import contextlib
    import tempfile

    from ray import serve

    from mpic.benchmarks.delayed_s3 import delayed_s3
    from mpic.config import MPICHome
    from mpic.deployments.app import build_app
    from mpic.deployments.local import prepare_local, start_local, stop_local, wait_healthy

    names = [r for r in routers.split(",") if r]
    if bad := set(names) - set(ROUTERS):
        typer.echo(f"error: unknown routers {sorted(bad)}; expected {ROUTERS}", err=True)
        raise typer.Exit(code=2)
    model = MPICHome().models_dir / "llava-small"
    first = prepare_local(app_config(model, Path(tempfile.mkdtemp()), names[0], 1 << 20))
    per_entry = entry_bytes(Path(first.engine.model))
    memory = int(memory_fraction * per_entry * users * images)
    meta = {
        "users": users,
        "images": images,
        "requests": requests,
        "clients": clients,
        "memory_fraction": memory_fraction,
        "entry_bytes": per_entry,
        "memory_bytes_per_replica": memory,
        "replicas": 2,
        "seed": seed,
        "object_delay_ms": object_delay_ms,
    }
    results = []
    warm = first.model_copy(update={"name": "warm", "route_prefix": "/"})
    base = start_local(warm, port, log_to_driver=False)
    try:
        serve.delete("warm")
        for router in names:
            with contextlib.ExitStack() as stack:
                store: Path | str = Path(tempfile.mkdtemp())
                if object_delay_ms > 0:  # a fresh slow store per router
                    store = stack.enter_context(delayed_s3(object_delay_ms / 1e3)).url
                cfg = prepare_local(app_config(model, store, router, memory))
                serve.run(build_app(cfg), name=cfg.name, route_prefix=cfg.route_prefix)
                url = f"{base}{cfg.route_prefix}"
                wait_healthy(url)
                infos, ttfts = run_workload(url, users, images, requests, clients, seed)
                results.append(summarize(router, infos, ttfts, clients))
                serve.delete(cfg.name)
    finally:
        stop_local()
    print_table(results)
    write_outputs(results, meta, json_out, plot)
