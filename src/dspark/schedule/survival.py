"""Prefix survivals a_k = P(drafts 0..k all accepted): what every verification policy reads.

From a confidence head: the product of its calibrated per-position confidences. Without one: a running
per-position estimate of the conditional acceptance, updated from the rounds already verified.
"""

from __future__ import annotations

import math
from typing import Sequence


def prefix_survival(logits: Sequence[float], temperatures: Sequence[float] | None = None) -> list[float]:
    """a_k = Π_{i≤k} σ(z_i / T_i) from raw confidence logits (T_i = 1 when not calibrated)."""
    out, run = [], 1.0
    for i, z in enumerate(logits):
        t = temperatures[i] if temperatures and i < len(temperatures) else 1.0
        x = z / t
        run *= 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
        out.append(run)
    return out


class AcceptanceEstimate:
    """Running per-position conditional acceptance: the survivals of drafters without a confidence head."""

    def __init__(self, positions: int, prior: float = 0.5, weight: float = 0.02):
        self.alpha = [prior] * positions
        self.weight = weight

    def survivals(self, n: int) -> list[float]:
        out, run = [], 1.0
        for k in range(n):
            run *= self.alpha[min(k, len(self.alpha) - 1)]
            out.append(run)
        return out

    def update(self, verified: int, accepted: int) -> None:
        for k in range(min(verified, accepted + 1, len(self.alpha))):
            self.alpha[k] += self.weight * (float(k < accepted) - self.alpha[k])
