"""`mpic demo`'s answer table (CLI process): a question whose answer is in the cached documents,
asked with each policy over HTTP (`http_answers`) or in-process through the `Engine` protocol
(`offline_answers`: the reference engine).

The documents are the first four standard-library passages of `mpic bench fidelity`
(`mpic.benchmarks.fidelity.prompts.passages`, ~700 characters each: json, heapq, difflib, argparse),
cached as text documents. "The secret code is 4821." is planted at the middle paragraph
boundary of document 2 (`task.plant`) and the question is `mpic bench fidelity --task
needle`'s ("What is the secret code? Answer with the number only.", `needle_parts`), answered in
at most 12 greedy tokens. The prompt without the documents cannot know the code, so a right
answer comes from the cached documents. The trained SmolLM2-135M-Instruct answers "The secret
code is 4821." under full recomputation on this prompt, and so do `auto` and `mpic-32`, while
`full-reuse` (the documents' stored KV as it is, none of their tokens recomputed) loses it.
That holds for this one fixed prompt. `mpic bench fidelity --task needle` measures accuracy
over many trials (docs/fidelity.md).

Per policy the table shows the answer, the TTFT, the speed-up over `full`, whether the answer
equals full's (leading and trailing whitespace ignored), whether it contains the code, and the
cached share: `usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens`, i.e. the prompt
tokens linked from the stored documents and not recomputed (`mpic.engine.request_flow.
stored_linked_tokens`; the linked template prefix does not count).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mpic.benchmarks.chat_client import StreamedAnswer, streaming_chat_body
from mpic.linker.prompt import tokenizer_of

if TYPE_CHECKING:
    import httpx

    from mpic.engine.protocol import Engine, Prefill
    from mpic.prompt_parts import PromptPart

ANSWER_POLICIES = "full,auto,mpic-32,full-reuse"
"""The answer table's policies: full recomputation, the default (`auto`), MPIC-32, and
`full-reuse` (no recomputation) for contrast."""
DOCUMENTS = 4
CODE = 4821
TARGET = 1
"""The document (0-based) that holds the code: "Document 2"."""
DEPTH = "middle"
ANSWER_TOKENS = 12
COLUMNS = ("policy", "TTFT ms", "vs full", "cached share", "same as full", "has code", "answer")


@dataclass
class AnswerRow:
    """One policy's answer to the question."""

    policy: str
    answer: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int

    @property
    def cached_share(self) -> float:
        """Fraction of the prompt's tokens linked from stored entries (not recomputed)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def has_code(self) -> bool:
        """Whether the answer contains the planted code."""
        return str(CODE) in self.answer


def documents() -> list[tuple[str, str]]:
    """(module name, text) of the cached documents, the code planted in document `TARGET`."""
    from mpic.benchmarks.fidelity.prompts import passages
    from mpic.benchmarks.fidelity.task import plant

    docs = [(p.name, p.text) for p in passages(DOCUMENTS)]
    name, text = docs[TARGET]
    docs[TARGET] = (name, plant(text, CODE, DEPTH))
    return docs


def question(entry_ids: Sequence[str]) -> list[PromptPart]:
    """The prompt parts over the cached documents `entry_ids` (in `documents()`'s order)."""
    from mpic.benchmarks.fidelity.task import needle_parts

    return needle_parts([name for name, _ in documents()], list(entry_ids))


def same_answer(row: AnswerRow, full: AnswerRow | None) -> bool | None:
    """Whether `row` answers as `full` did (whitespace at either end ignored); None without
    full."""
    return None if full is None else row.answer.strip() == full.answer.strip()


def http_answers(
    http: httpx.Client,
    policies: Sequence[str],
    max_tokens: int = ANSWER_TOKENS,
    repeats: int = 1,
) -> list[AnswerRow]:
    """Upload the documents (`purpose: user_data`, text/plain) through `http` (base URL and key
    set) and ask the question with every policy, streamed; TTFT is the first content chunk the
    client sees. One warm-up request first (first-request costs).

    vLLM's prefix cache would answer a prompt it has seen from its cache, so no prompt is sent
    twice: the warm-up's starts with "Warm-up. ", and with `repeats` > 1 the policies are asked
    again in turn (round-robin, so a busy spell on the host spreads over all of them) with the
    question starting "Request r. "; a row's TTFT is then the median over the repeats and its
    answer and token counts are those of the question itself (the first round)."""
    ids = []
    for i, (name, text) in enumerate(documents(), start=1):
        resp = http.post(
            "/v1/files",
            files={"file": (f"doc-{i}-{name}.txt", text.encode(), "text/plain")},
            data={"purpose": "user_data", "ttl_seconds": "3600"},
        )
        resp.raise_for_status()
        ids.append(resp.json()["id"])
    content = [
        {"type": "text", "text": p}
        if isinstance(p, str)
        else {"type": "file", "file": {"file_id": p.entry_id}}
        for p in question(ids)
    ]

    def starting(lead: str) -> list[dict[str, Any]]:
        return [{"type": "text", "text": lead + content[0]["text"]}, *content[1:]]

    _ask(http, starting("Warm-up. "), policies[0], 1)
    rows = [_ask(http, content, p, max_tokens) for p in policies]
    ttfts = [[r.ttft_s] for r in rows]
    for r in range(2, repeats + 1):
        for times, policy in zip(ttfts, policies, strict=True):
            times.append(_ask(http, starting(f"Request {r}. "), policy, max_tokens).ttft_s)
    for row, times in zip(rows, ttfts, strict=True):
        row.ttft_s = statistics.median(times)
    return rows


def _ask(
    http: httpx.Client, content: list[dict[str, Any]], policy: str, max_tokens: int
) -> AnswerRow:
    body = streaming_chat_body(content, policy, max_tokens)
    answer = StreamedAnswer()
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{policy}: HTTP {resp.status_code} {resp.read().decode()}")
        for line in resp.iter_lines():
            answer.feed(line)
    return AnswerRow(policy, answer.text, answer.ttft_s, answer.prompt_tokens, answer.cached_tokens)


def offline_answers(
    engine: Engine,
    policies: Sequence[str],
    max_tokens: int = ANSWER_TOKENS,
    repeats: int = 1,
) -> list[AnswerRow]:
    """The same question on an engine in this process through the `Engine` protocol (the
    reference engine: documents cached in its memory); each answer is a greedy request that
    stops at an end id (`decoded_ids`), its TTFT the engine's `Prefill.ttft_s`, the median of
    `repeats` (the others 1-token requests: the reference runner has no prefix cache, the same
    prompt is timed again). One warm-up 1-token request first."""
    import asyncio

    from mpic.engine.protocol import GenerateRequest
    from mpic.engine.request_flow import decoded_ids

    cached = [engine.cache_document(text) for _, text in documents()]
    entries = {entry.entry_id: entry for entry in cached}
    parts = question([entry.entry_id for entry in cached])

    def ask(policy: str, tokens: int) -> tuple[list[int], Prefill]:
        request = GenerateRequest(parts, entries, policy, max_tokens=tokens)  # greedy
        return asyncio.run(decoded_ids(engine, request))

    tokenizer = tokenizer_of(engine.processor)
    ask(policies[0], 1)
    rows = []
    for policy in policies:
        ids, pre = ask(policy, max_tokens)
        times = [pre.ttft_s] + [ask(policy, 1)[1].ttft_s for _ in range(repeats - 1)]
        rows.append(
            AnswerRow(
                policy,
                tokenizer.decode(ids, skip_special_tokens=True),
                statistics.median(times),
                pre.prompt_tokens,
                pre.cached_tokens,
            )
        )
    return rows


def answer_table(rows: Sequence[AnswerRow], title: str) -> Any:
    """The rows as a rich Table (`COLUMNS`)."""
    from rich.table import Table

    full = next((r for r in rows if r.policy == "full"), None)
    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("policy", "answer") else "right")
    for r in rows:
        same = same_answer(r, full)
        table.add_row(
            r.policy,
            f"{r.ttft_s * 1e3:.0f}",
            f"{full.ttft_s / r.ttft_s:.2f}x" if full else "-",
            f"{r.cached_share:.0%}",
            "-" if same is None else ("yes" if same else "no"),
            "yes" if r.has_code else "no",
            repr(r.answer),
        )
    return table


def print_answers(rows: Sequence[AnswerRow], model: str) -> None:
    """The answer table on stdout, titled with the question and `model`."""
    from rich.console import Console

    title = (
        f"Policy answers from {DOCUMENTS} cached documents (code {CODE} planted in document "
        f"{TARGET + 1}; model: {model})"
    )
    Console(width=max(120, Console().width)).print(answer_table(rows, title))
