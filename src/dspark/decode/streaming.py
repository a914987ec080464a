"""Incremental detokenisation for streaming output."""

from __future__ import annotations

from typing import Callable


class TextStreamer:
    """Turns pushed token ids into printable text deltas.

    Text is held back while it ends in an incomplete UTF-8 sequence, and the last
    `holdback` characters are held until `finish` so a stop string is never half-printed.
    """

    def __init__(self, decode: Callable[[list[int]], str], write: Callable[[str], None], holdback: int = 0):
        self.decode = decode
        self.write = write
        self.holdback = holdback
        self.ids: list[int] = []
        self.printed = 0

    def push(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        upto = len(text) - self.holdback
        if upto > self.printed:
            self.write(text[self.printed : upto])
            self.printed = upto

    def finish(self, final_text: str) -> None:
        if len(final_text) > self.printed:
            self.write(final_text[self.printed :])
        self.printed = len(final_text)
