"""`mpic-admin` (CLI process): the administrator's view of the dynamic library (MPIC section 3.1,
component 3) - refresh a collection from a folder or S3 prefix of images and .txt/.md text
passages, list collections, show versions and items, roll back, and search. Works on the object
store directly (`--store URL` or MPIC_STORE_URL; default: the embedded filesystem store under
`.mpic/store`) or, for refresh, list, show and rollback, through a running server's admin routes
(`--server URL` + `--api-key`, or MPIC_SERVER_URL / MPIC_ADMIN_KEY; the server then computes the
entries with its own engine and SOURCE must be readable by the server). Search has no HTTP route:
it always reads the store.

Bad input (missing folder, unreadable image, a passage that is not UTF-8 text, unknown collection
or version) prints
`error: ...` on stderr and exits with status 2; nothing is written in that case.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from mpic.errors import MPICError

T = TypeVar("T")
app = typer.Typer(no_args_is_help=True, help="MPIC administration: dynamic library, file sweeper.")
library_app = typer.Typer(no_args_is_help=True, help="Dynamic-library collections (MRAG).")
app.add_typer(library_app, name="library")

StoreOpt = Annotated[
    str | None,
    typer.Option(
        "--store",
        envvar="MPIC_STORE_URL",
        help="file:///abs/path or s3://bucket/prefix?endpoint=host:port (default: .mpic/store).",
    ),
]
ServerOpt = Annotated[
    str | None,
    typer.Option("--server", envvar="MPIC_SERVER_URL", help="Serving app base URL (admin routes)."),
]
KeyOpt = Annotated[
    str | None,
    typer.Option("--api-key", envvar="MPIC_ADMIN_KEY", help="Admin API key for --server."),
]
CollectionOpt = Annotated[str, typer.Option("--collection", "-c", help="Collection name.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


def _run(fn: Callable[[], T]) -> T:
    """Run `fn`, turning typed errors and bad values into a message and exit status 2."""
    try:
        return fn()
    except (MPICError, ValueError, FileNotFoundError) as exc:
        raise _fail(getattr(exc, "message", None) or str(exc)) from exc


def _retriever(store: str | None, **cfgs):
    from mpic.retriever.service import RetrievalService
    from mpic.storage.factory import make_object_store

    return RetrievalService(make_object_store(store), **cfgs)


def _client(server: str, api_key: str | None):
    from mpic.retriever.admin_client import AdminClient

    return AdminClient(server, api_key)


def _engine(
    model_dir: Path | None, system_prompt: str | None
) -> tuple[Callable[[bytes], object], Callable[[str], object], str]:
    """(compute_entry of an image, compute_document of a text passage, fingerprint of model +
    canonical context) of the HF model folder (reference runner, CPU f32: `cache_image` and
    `cache_document`, the recipes of uploaded files); entries are cached after `system_prompt`
    (None: the template's).

    Default: the serving app's default model (`VllmServeEngineConfig().model`, the embedded
    tiny LLaVA), written on first use, so the entries match what the default server links.
    """
    from mpic.addressing import library_fingerprint
    from mpic.deployments.config import VllmServeEngineConfig
    from mpic.engine.hf.adapters import make_adapter
    from mpic.engine.hf.entries import cache_document, cache_image
    from mpic.engine.hf.loader import load_hf_model

    if model_dir is None:
        from mpic.engine.tiny.models import make_tiny

        default = VllmServeEngineConfig()
        model_dir = Path(default.model)
        if not model_dir.exists():
            make_tiny(default.family, "tiny", model_dir)
    elif not model_dir.is_dir():
        raise _fail(f"model folder not found: {model_dir}")
    model, processor, spec = load_hf_model(model_dir)
    adapter = make_adapter(model)
    fingerprint = library_fingerprint(spec.fingerprint, system_prompt)
    return (
        lambda media: cache_image(model, processor, adapter, spec, media, system_prompt),
        lambda text: cache_document(processor, adapter, spec, text, system_prompt),
        fingerprint,
    )


@library_app.command("refresh")
def refresh(
    source: Annotated[
        str,
        typer.Argument(
            help="Folder or s3://bucket/prefix?endpoint=... of images and .txt/.md passages."
        ),
    ],
    collection: CollectionOpt,
    captions: Annotated[Path | None, typer.Option(help="JSONL of {file, caption}.")] = None,
    model: Annotated[Path | None, typer.Option(help="HF model folder computing the KV.")] = None,
    system_prompt: Annotated[
        str | None,
        typer.Option(
            help="System prompt of the canonical context (as the server's engine.system_prompt)."
        ),
    ] = None,
    index: Annotated[str, typer.Option(help="flat | ivf | hnsw")] = "flat",
    clip_model: Annotated[str, typer.Option(help="open_clip model name.")] = "mpic-tiny-clip",
    clip_weights: Annotated[Path | None, typer.Option(help="CLIP weights file.")] = None,
    store: StoreOpt = None,
    server: ServerOpt = None,
    api_key: KeyOpt = None,
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
) -> None:
    """Build a new version of COLLECTION from SOURCE and make it current (incremental)."""
    from mpic.retriever.embedder import EmbedderConfig
    from mpic.retriever.index import IndexConfig
    from mpic.retriever.sources import open_source, read_captions

    if server:
        report = _run(
            lambda: _client(server, api_key).refresh(collection, source, captions and str(captions))
        )
        typer.echo(json.dumps(report, indent=1))
        return

    def go():
        src = open_source(source)
        caps = read_captions(captions)
        cfgs = {
            "embedder_cfg": EmbedderConfig(
                model=clip_model, weights=clip_weights and str(clip_weights)
            ),
            "index_cfg": IndexConfig(kind=index),
        }
        retriever = _retriever(store, **cfgs)
        retriever.library(collection)  # validate the name before loading a model
        compute_entry, compute_document, fingerprint = _engine(model, system_prompt)
        return retriever.refresh(
            collection,
            src,
            compute_entry,
            model_fingerprint=fingerprint,
            captions=caps,
            progress=progress,
            compute_document=compute_document,
        )

    report = _run(go)
    typer.echo(json.dumps(dataclasses.asdict(report), indent=1))


@library_app.command("list")
def list_collections(
    store: StoreOpt = None,
    server: ServerOpt = None,
    api_key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Collections with their current version and item count."""

    def go():
        if server:
            return _client(server, api_key).collections()
        retriever = _retriever(store)
        rows = []
        for name in retriever.collections():
            man = retriever.library(name).current()
            rows.append({"collection": name, "current": man.version, "items": len(man.items)})
        return rows

    rows = _run(go)
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        return
    for r in rows:
        typer.echo(f"{r['collection']}\t{r['current']}\t{r.get('items', '?')} items")


@library_app.command("show")
def show(
    collection: CollectionOpt,
    version: Annotated[str | None, typer.Option(help="Version (default: current).")] = None,
    store: StoreOpt = None,
    server: ServerOpt = None,
    api_key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Versions of COLLECTION and the items of one version (versions only with --server)."""

    def go():
        if server:
            return {**_client(server, api_key).versions(collection), "items": []}
        retriever = _retriever(store)
        versions, current = retriever.versions(collection)
        man = retriever.library(collection).manifest(version or current)
        return {
            "collection": collection,
            "current": current,
            "versions": versions,
            "version": man.version,
            "parent": man.parent,
            "extra": man.extra,
            "items": [it.model_dump() for it in man.items],
        }

    info = _run(go)
    if as_json:
        typer.echo(json.dumps(info, indent=1))
        return
    for v in info["versions"]:
        typer.echo(f"{'*' if v == info['current'] else ' '} {v}")
    if "version" not in info:
        return
    typer.echo(f"items of {info['version']}:")
    for it in info["items"]:
        name = it["extra"].get("name", "")
        typer.echo(f"  {it['item_id']}  {it['media_type']:8}  {name}  {it['caption']}")


@library_app.command("rollback")
def rollback(
    version: Annotated[str, typer.Argument(help="A kept version (see `show`).")],
    collection: CollectionOpt,
    store: StoreOpt = None,
    server: ServerOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Make an earlier version of COLLECTION current again."""
    if server:
        current = _run(lambda: _client(server, api_key).rollback(collection, version))["current"]
    else:
        current = _run(lambda: _retriever(store).rollback(collection, version)).version
    typer.echo(f"{collection}: current version is now {current}")


@library_app.command("prune")
def prune(
    collection: CollectionOpt,
    keep: Annotated[int, typer.Option(min=1, help="Newest versions to keep.")] = 3,
    store: StoreOpt = None,
) -> None:
    """Release all but the newest KEEP versions of COLLECTION (the current one is always kept)."""
    released = _run(lambda: _retriever(store).prune(collection, keep))
    typer.echo(f"{collection}: released {len(released)} version(s) {' '.join(released)}".rstrip())


@library_app.command("search")
def search(
    collection: CollectionOpt,
    image: Annotated[Path | None, typer.Option(help="Query image file.")] = None,
    text: Annotated[str | None, typer.Option(help="Query text.")] = None,
    top_k: Annotated[int, typer.Option(min=1, help="Hits to return.")] = 5,
    min_score: Annotated[float | None, typer.Option(help="Drop lower scores.")] = None,
    store: StoreOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Search the current version of COLLECTION (images and text passages) with an image or a
    text; each hit says its media type."""
    if (image is None) == (text is None):
        raise _fail("give exactly one of --image PATH or --text STR")
    if image is not None and not image.is_file():
        raise _fail(f"query image not found: {image}")

    def go():
        query = {"image": image.read_bytes()} if image is not None else {"text": text}
        return _retriever(store).search(collection, top_k=top_k, min_score=min_score, **query)

    result = _run(go)
    if as_json:
        typer.echo(result.model_dump_json(indent=1))
        return
    typer.echo(f"{result.collection}@{result.version}")
    for h in result.hits:
        typer.echo(f"{h.score:+.4f}  {h.item_id}  {h.media_type:8}  {h.name}  {h.caption}")


@app.command("sweep")
def sweep(
    store: StoreOpt = None,
    server: ServerOpt = None,
    api_key: KeyOpt = None,
    grace_s: Annotated[
        float | None,
        typer.Option("--grace-s", min=0, help="Unreferenced blobs younger than this stay."),
    ] = None,
) -> None:
    """Expire uploaded files past their TTL and delete the entries and media no live file or
    library version references, from the object store (and, with --server, from the LLM
    worker's memory and disk tiers too). Prints the sweep report as JSON."""

    def go():
        if server:
            return _client(server, api_key).sweep(grace_s)
        from mpic.deployments.serve.files import open_library
        from mpic.storage.config import StorageConfig

        cfg = StorageConfig(url=store) if store else StorageConfig()
        if grace_s is not None:
            cfg = cfg.model_copy(update={"sweep_grace_s": grace_s})
        if cfg.url is None and cfg.s3 is None:
            from mpic.config import MPICHome

            cfg = cfg.model_copy(update={"url": MPICHome().store_dir.resolve().as_uri()})
        return open_library(cfg).sweep().model_dump()

    typer.echo(json.dumps(_run(go), indent=1))


def main() -> None:
    """Entry point of the `mpic-admin` console script."""
    logging.basicConfig(level=logging.WARNING)
    app()
