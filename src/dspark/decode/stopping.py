"""When generation ends: EOS, max_new_tokens, stop strings. Shared by every decoding loop so that
the same token stream always ends at the same place, speculative or not."""

from __future__ import annotations

from typing import Callable, Iterable


class StopChecker:
    def __init__(
        self,
        eos_token_ids: Iterable[int],
        max_new_tokens: int,
        stop_strings: Iterable[str] = (),
        decode: Callable[[list[int]], str] | None = None,
    ):
        self.eos = frozenset(eos_token_ids)
        self.max_new_tokens = max_new_tokens
        self.stop_strings = tuple(s for s in stop_strings if s)
        if self.stop_strings and decode is None:
            raise ValueError("stop strings need a decode function")
        self.decode = decode
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_at: int | None = None  # character offset of the matched stop string

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int) -> bool:
        """Append one generated token; True once generation has ended (this token is kept)."""
        assert not self.done, "push after the end of generation"
        self.token_ids.append(token)
        if token in self.eos:
            self.finish_reason = "stop"
        elif self.stop_strings and self._find_stop() is not None:
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
        return self.done

    def push_many(self, tokens: list[int]) -> list[int]:
        """Push tokens until generation ends; return the ones kept."""
        kept = []
        for t in tokens:
            kept.append(t)
            if self.push(t):
                break
        return kept

    def _find_stop(self) -> int | None:
        text = self.decode(self.token_ids)
        hits = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
        if hits:
            self.stop_at = min(hits)
        return self.stop_at

    def text(self) -> str:
        """Final text: special tokens skipped, cut before a matched stop string."""
        text = self.decode(self.token_ids) if self.decode else ""
        return text if self.stop_at is None else text[: self.stop_at]
