"""Generated token ids -> streamed text, for both engines (the process that streams a
generation: LLM-worker replica, CLI): incremental detokenizing (`Detokenizer`) and OpenAI `stop`
strings over the streamed text (`StopMatcher`). `mpic.engine.request_flow.TextStream` puts them
together for one request.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from mpic.engine.protocol import TokenEvent


class StopMatcher:
    """OpenAI `stop` strings over streamed text: `push(piece)` gives the text that is safe to
    send (a suffix that may begin a stop string is held back) and whether a stop string
    matched (the text from it on is dropped; with `include`, from its end on); `flush()` gives
    what was held back."""

    def __init__(self, stops: list[str], include: bool = False) -> None:
        self.stops, self.held, self.stopped = [s for s in stops if s], "", False
        self.include = include
        """Keep the matched stop string in the text (vLLM's `include_stop_str_in_output`)."""

    def push(self, piece: str) -> tuple[str, bool]:
        """(text to emit, stopped)."""
        if self.stopped:
            return "", True
        text = self.held + piece
        hits = [(i, len(s)) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            at, size = min(hits)
            self.held, self.stopped = "", True
            return text[: at + size if self.include else at], True
        keep = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    keep = max(keep, k)
                    break
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back text (no stop string matched)."""
        rest, self.held = self.held, ""
        return "" if self.stopped else rest


class Detokenizer:
    """Incremental detokenization: `push(tokens)` gives the text the new tokens add, holding
    back text that ends in an incomplete character (U+FFFD until its bytes are all decoded);
    `flush()` gives the rest. The pieces join to the decoded text of all tokens."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.text, self.tokens = tokenizer, "", []

    def push(self, tokens: Iterable[int]) -> TokenEvent:
        """The TokenEvent of `tokens` (text may be empty while a character is incomplete)."""
        self.tokens.extend(tokens)
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return TokenEvent("")
        piece, self.text = full[len(self.text) :], full
        return TokenEvent(piece)

    def flush(self) -> TokenEvent:
        """The text held back so far."""
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        piece, self.text = full[len(self.text) :], full
        return TokenEvent(piece)


def token_events(tokenizer, tokens: Iterable[int]) -> Iterator[TokenEvent]:
    """One TokenEvent per token as it arrives (`Detokenizer`), then any held-back text."""
    detok = Detokenizer(tokenizer)
    for token in tokens:
        yield detok.push([token])
    if (rest := detok.flush()).text:
        yield rest
