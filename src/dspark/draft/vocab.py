"""A drafter's reduced vocabulary: it drafts over K of the target's V tokens (EAGLE-3's `d2t`).

Checkpoints store the mapping as EAGLE-3 does: `d2t` [K] int64 offsets, draft index i being target
token i + d2t[i] (indices sorted by target id), and `t2d` [V] bool, which target tokens the drafter
can propose. The drafter's LM head is the target's rows for those K tokens, gathered once when the
drafter is loaded and never stored; the Markov head's W2 has K rows. A draft distribution that is
zero outside the K tokens is still exact under rejection sampling, so verification stays lossless;
acceptance falls only where the target puts mass on tokens outside (the coverage).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

import torch

from dspark.errors import DsparkError
from dspark.model.target import Target


def most_frequent(token_lists: Iterable[list[int]], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent token ids of `token_lists` (ties: lower id first), sorted by id.
    Tokens never seen fill up the rest in id order, so that any size up to `vocab_size` works."""
    if not 0 < size <= vocab_size:
        raise DsparkError(f"a draft vocabulary needs 1..{vocab_size} tokens, got {size}")
    counts = Counter(t for tokens in token_lists for t in tokens)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    if len(ranked) < size:
        seen = set(ranked)
        ranked += [t for t in range(vocab_size) if t not in seen][: size - len(ranked)]
    return torch.tensor(sorted(ranked), dtype=torch.long)


def coverage(token_lists: Iterable[list[int]], ids: torch.Tensor | None) -> float:
    """Share of the tokens of `token_lists` inside the draft vocabulary `ids` (None: all of them)."""
    allowed = None if ids is None else set(ids.tolist())
    total = inside = 0
    for tokens in token_lists:
        total += len(tokens)
        inside += len(tokens) if allowed is None else sum(t in allowed for t in tokens)
    return inside / total if total else 1.0


def to_d2t(ids: torch.Tensor) -> torch.Tensor:
    """Sorted target ids [K] -> EAGLE-3's offsets d2t[i] = ids[i] - i."""
    return ids - torch.arange(ids.numel(), dtype=ids.dtype, device=ids.device)


def to_t2d(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=ids.device)
    mask[ids] = True
    return mask


def from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    return d2t + torch.arange(d2t.numel(), dtype=d2t.dtype, device=d2t.device)


def check_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """Refuse a mapping that is not K distinct, increasing target ids."""
    if ids.ndim != 1 or ids.numel() == 0:
        raise DsparkError("a draft vocabulary is a non-empty list of target token ids")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or bool((ids[1:] <= ids[:-1]).any()):
        raise DsparkError(f"the draft vocabulary (d2t) is not {ids.numel()} distinct, increasing token ids "
                          f"in 0..{vocab_size - 1}; the checkpoint is damaged")


class DraftHead:
    """Inference side: the drafter's LM head over its vocabulary and the map back to target ids."""

    def __init__(self, ids: torch.Tensor | None, target: Target):
        self.ids = ids  # None: the full target vocabulary
        self.vocab_size = target.cfg.vocab_size
        self._target_logits = target.model.logits
        if ids is not None:
            from dspark.model.kernels import dense_kernel

            self._rows = dense_kernel(target.model.lm_head.detach()[ids].contiguous())
            self._id_list = ids.tolist()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [..., K] (or [..., V] for the full vocabulary)."""
        return self._target_logits(h) if self.ids is None else self._rows(h).float()

    def to_target(self, index: torch.Tensor) -> torch.Tensor:
        """Draft indices -> target token ids."""
        return index if self.ids is None else self.ids[index]

    def tokens(self, index: list[int]) -> list[int]:
        """Draft indices -> target token ids, as lists."""
        return index if self.ids is None else [self._id_list[i] for i in index]

    def full_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """Draft probabilities [n, K] -> [n, V], zero outside the draft vocabulary."""
        if self.ids is None:
            return probs
        out = probs.new_zeros(probs.shape[0], self.vocab_size)
        out[:, self.ids] = probs
        return out
