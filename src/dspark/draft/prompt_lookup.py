"""Prompt-lookup (n-gram) drafting: copy what followed the longest earlier match of the suffix."""

from __future__ import annotations

import torch

from dspark.draft.base import DraftBlock, Drafter
from dspark.errors import DsparkError
from dspark.sampling import SamplingParams


class PromptLookupDrafter(Drafter):
    def __init__(self, num_draft_tokens: int = 4, max_ngram: int = 3, min_ngram: int = 1):
        if num_draft_tokens < 1 or not (1 <= min_ngram <= max_ngram):
            raise DsparkError("prompt lookup needs num_draft_tokens >= 1 and 1 <= min_ngram <= max_ngram")
        self.num_draft_tokens = self.max_drafts = num_draft_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.history: list[int] = []

    def begin(self, prompt_ids: list[int]) -> None:
        self.history = []

    def observe(self, tokens: list[int], taps: torch.Tensor | None) -> None:
        self.history.extend(tokens)

    def propose(self, anchor: int, max_tokens: int, params: SamplingParams, generator: torch.Generator) -> DraftBlock:
        return DraftBlock(tokens=self.continuation(anchor, min(max_tokens, self.num_draft_tokens)))

    def continuation(self, anchor: int, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the most recent earlier occurrence of the longest
        matching suffix of the context and `anchor` (empty without a match)."""
        seq = self.history + [anchor]
        if limit <= 0:
            return []
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            suffix = seq[-n:]
            # most recent earlier occurrence wins; it must leave at least one token to copy
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start : start + n] == suffix:
                    return seq[start + n : start + n + limit]
        return []
