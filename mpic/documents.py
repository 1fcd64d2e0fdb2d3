"""Text documents as media (every process; torch-free): which file names are text documents
(.txt/.md uploads and dynamic-library passages) and how their bytes become text. Shared by the
HTTP upload path (`mpic.deployments.serve.files`) and the dynamic-library refresh
(`mpic.retriever.refresh`), so both accept and reject exactly the same files.
"""

from __future__ import annotations

from mpic.errors import UnreadableMediaError

DOCUMENT_SUFFIXES = {".txt": "text/plain", ".md": "text/markdown", ".markdown": "text/markdown"}
"""File suffixes of text documents -> their MIME type."""


def document_suffix_type(name: str) -> str | None:
    """The MIME type of a file name with a text-document suffix (case-insensitive), else None."""
    base = name.rsplit("/", 1)[-1]
    suffix = "." + base.rsplit(".", 1)[-1].lower() if "." in base else ""
    return DOCUMENT_SUFFIXES.get(suffix)


def decode_document(data: bytes, name: str | None = None) -> str:
    """A document's text: UTF-8 (a BOM is dropped). UnreadableMediaError (HTTP 415) for other
    bytes, naming `name` when given."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        what = name or "the text file"
        raise UnreadableMediaError(
            f"{what} is not UTF-8 ({exc.reason} at byte {exc.start})", param="file"
        ) from None
