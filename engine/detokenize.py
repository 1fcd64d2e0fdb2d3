"""Generated token ids -> streamed text, for both engines (the process that streams a
generation: LLM-worker replica, CLI): incremental detokenizing (`Detokenizer`, constant work per
token, under the request's decode options) and OpenAI `stop` strings over the streamed text
(`StopMatcher`). `mpic.engine.request_flow.TextStream` puts them
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
    """Incremental detokenization in constant work per token (vLLM's prefix and read offsets):
    `push(tokens)` gives the text the new tokens add, `flush()` the text held back; the pieces
    join to `tokenizer.decode(tokens, **options)`. A push decodes a short window only: the
    tokens of the last piece given (their text, `said`, begins the window's text) and those
    since. Text ending in U+FFFD (a character whose bytes are not all decoded) is held back;
    tokens that add nothing while nothing is held (skipped special tokens) leave the window."""

    def __init__(
        self,
        tokenizer,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool | None = None,
    ) -> None:
        self.tokenizer, self.tokens = tokenizer, []
        self.options: dict[str, bool] = {"skip_special_tokens": skip_special_tokens}
        """The decode options; `spaces_between_special_tokens` only when set (None: the
        tokenizer's own default; HF fast tokenizers ignore it)."""
        if spaces_between_special_tokens is not None:
            self.options["spaces_between_special_tokens"] = spaces_between_special_tokens
        self.window: list[int] = []
        """The tokens of the last piece said (the first `self.read`), then those held back."""
        self.read, self.said = 0, ""

    def _decode(self, ids: list[int]) -> str:
        """The text of `ids` under the options."""
        return self.tokenizer.decode(ids, **self.options) if ids else ""

    def push(self, tokens: Iterable[int]) -> TokenEvent:
        """The TokenEvent of `tokens` (text may be empty while a character is incomplete)."""
        tokens = list(tokens)
        self.tokens.extend(tokens)
        window = self.window + tokens
        text = self._decode(window)
        # tokens that add nothing while nothing is held leave the window; before the first
        # piece, skipped special tokens only (a decoder may strip a leading space until text)
        if text == self.said and len(self.window) == self.read:
            if self.read or self._skipped(tokens):
                return TokenEvent("")
        self.window = window
        if text.endswith("\ufffd") or len(text) <= len(self.said):
            return TokenEvent("")
        return TokenEvent(self._said(text))

    def flush(self) -> TokenEvent:
        """The text held back so far."""
        if len(self.window) == self.read:
            return TokenEvent("")
        return TokenEvent(self._said(self._decode(self.window)))

    def _skipped(self, tokens: list[int]) -> bool:
        """Whether the options skip each of `tokens` (its text, unskipped, is not empty)."""
        said = {**self.options, "skip_special_tokens": False}
        return all(self.tokenizer.decode([t], **said) for t in tokens)

    def _said(self, text: str) -> str:
        """The new part of `text` (the window's); the window moves on to the held tokens."""
        piece = text[len(self.said) :]
        if self.read:
            self.window = self.window[self.read :]
            text = self._decode(self.window)
        self.read, self.said = len(self.window), text
        return piece


def token_events(tokenizer, tokens: Iterable[int], **options: bool) -> Iterator[TokenEvent]:
    """One TokenEvent per token as it arrives (`Detokenizer`, with its decode `options`), then
    any held-back text."""
    detok = Detokenizer(tokenizer, **options)
    for token in tokens:
        yield detok.push([token])
    if (rest := detok.flush()).text:
        yield rest
