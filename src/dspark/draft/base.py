"""The drafter interface the decoding loops talk to."""

from __future__ import annotations

import abc
import dataclasses

import torch

from dspark.decode.sampling import SamplingParams, argmax_rows, probs_from_logits, sample


@dataclasses.dataclass
class DraftBlock:
    tokens: list[int]
    # Exact probabilities each token was sampled from, [len(tokens), V]; None when the tokens were
    # proposed deterministically (p_d is one-hot on the proposed token).
    probs: torch.Tensor | None = None
    # Raw confidence-head logits, [len(tokens)], for drafters that have one.
    confidence_logits: torch.Tensor | None = None


class Drafter(abc.ABC):
    """Proposes blocks of draft tokens for one request at a time.

    Call order per request: `begin(prompt)`, `observe(prompt tokens, taps)`, then per round
    `propose(anchor, ...)` followed by `observe(committed tokens, taps)`. Committed tokens are
    those whose target K/V stayed in the cache: the anchor plus the accepted drafts.
    """

    #: target decoder layers whose outputs `observe` needs (empty: none).
    tap_layers: tuple[int, ...] = ()

    @abc.abstractmethod
    def begin(self, prompt_ids: list[int]) -> None: ...

    @abc.abstractmethod
    def observe(self, tokens: list[int], taps: torch.Tensor | None) -> None:
        """`tokens` were committed; `taps` [len(tokens), m, H] are their tapped target features."""

    @abc.abstractmethod
    def propose(
        self, anchor: int, max_tokens: int, params: SamplingParams, generator: torch.Generator
    ) -> DraftBlock:
        """Draft up to `max_tokens` tokens following `anchor` (the last sampled, uncommitted token)."""


def token_picker(params: SamplingParams, generator: torch.Generator):
    """`pick(logits [k, V]) -> k tokens`: argmax when greedy, else sampled from the processed
    distribution, whose rows are appended to the returned list (the exact p_d for verification)."""
    probs: list[torch.Tensor] = []

    def pick(logits: torch.Tensor) -> list[int]:
        if params.greedy:
            return argmax_rows(logits)
        p = probs_from_logits(logits, params)
        probs.append(p)
        return sample(p, torch.rand(p.shape[0], generator=generator)).tolist()

    return pick, probs
