"""docs/serving.md's table of chat request fields covers the request model exactly (fast, no Ray):
every field of `ChatCompletionRequest` (and of its `stream_options` and `mpic` objects, and the
message-level `name` and `image_url` fields) is named in the table with a verdict, "honoured"
(with how) or a restriction/rejection with its 400, and the table names no field the model
lacks; the message-level rejections are checked on the request model itself."""

from __future__ import annotations

import re
from pathlib import Path

from mpic.deployments.chat_request import REJECTED_FIELDS, ChatCompletionRequest, MPICOptions

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
SECTION = "### Chat request fields"


def field_table() -> dict[str, tuple[str, str]]:
    """field name -> (verdict, how) of every row of the table under SECTION. A row may name
    several fields (`a`, `b`) and sub-fields (`stream_options.include_usage`)."""
    text = DOC.read_text(encoding="utf-8")
    assert SECTION in text, f"{DOC} has no {SECTION!r} section"
    rows: dict[str, tuple[str, str]] = {}
    started = False
    for line in text.split(SECTION, 1)[1].splitlines():
        if not line.startswith("|"):
            if started:
                break
            continue
        started = True
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or set(cells[0]) <= {"-", " "} or cells[0] == "field":
            continue
        for name in re.findall(r"`([A-Za-z_][\w.]*)`", cells[0]):
            rows[name] = (cells[1], cells[2])
    return rows


def test_every_request_field_is_in_the_table_with_a_verdict() -> None:
    rows = field_table()
    top = {name.split(".")[0] for name in rows}
    fields = set(ChatCompletionRequest.model_fields)
    assert fields - top == set(), f"fields missing from docs/serving.md: {sorted(fields - top)}"
    assert top - fields == set(), f"table rows naming no request field: {sorted(top - fields)}"
    for name, (verdict, how) in rows.items():
        assert verdict and how, f"{name}: no verdict or no how"
        honoured = verdict == "honoured"
        assert honoured or "400" in how, f"{name}: neither honoured nor a 400 ({verdict}, {how})"
    for name in REJECTED_FIELDS:  # the schema rejects these: the table must say so
        verdict, how = rows[name]
        assert verdict == "rejected" and "400" in how, name


def test_nested_objects_are_covered() -> None:
    rows = field_table()
    assert "stream_options.include_usage" in rows
    mpic_how = rows["mpic"][1]
    for name in MPICOptions.model_fields:
        assert f"`{name}`" in mpic_how, f"mpic.{name} is not described in the mpic row"


def test_message_level_fields_are_honoured_or_rejected() -> None:
    import pytest

    from mpic.errors import InvalidRequestError

    rows = field_table()
    for name in ("messages.name", "messages.content.image_url.detail"):
        assert name in rows and "400" in rows[name][1], name
    assert rows["messages.content.image_url.url"][0] == "honoured"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    for detail in (None, "auto"):
        part = {**image, "image_url": {**image["image_url"], "detail": detail}}
        msgs = [{"role": "user", "content": [part]}]
        ChatCompletionRequest.model_validate({"model": "m", "messages": msgs})
    bad = [
        ({"role": "user", "content": "hi", "name": "ann"}, "messages.0.name"),
        (
            {"role": "user", "content": [{**image, "image_url": {"url": "x", "detail": "high"}}]},
            "messages.0.content.0.image_url.detail",
        ),
    ]
    for message, param in bad:
        with pytest.raises(InvalidRequestError) as exc:
            ChatCompletionRequest.model_validate({"model": "m", "messages": [message]})
        assert exc.value.param == param and exc.value.status == 400
