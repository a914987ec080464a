"""Incremental detokenisation for streaming output."""

from __future__ import annotations

from typing import Callable, Iterable


class TextStreamer:
    """Turns pushed token ids into printable text deltas.

    Text is held back while it ends in an incomplete UTF-8 sequence, the last characters that could
    begin a stop string are held until `finish`, and nothing from a matched stop string on is ever
    written (the token that completes a stop string may carry text past it)."""

    def __init__(self, decode: Callable[[list[int]], str], write: Callable[[str], None], stop: Iterable[str] = ()):
        self.decode = decode
        self.write = write
        self.stop = tuple(s for s in stop if s)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.printed = 0

    def push(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        upto = min([len(text) - self.holdback] + [i for i in (text.find(s) for s in self.stop) if i >= 0])
        if upto > self.printed:
            self.write(text[self.printed : upto])
            self.printed = upto

    def finish(self, final_text: str) -> None:
        if len(final_text) > self.printed:
            self.write(final_text[self.printed :])
        self.printed = len(final_text)
