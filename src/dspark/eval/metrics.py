"""Metrics over recorded verification rounds (definitions: DESIGN.md §5).

A round verified `drafted` draft tokens and accepted the first `accepted` of them; it commits
`accepted + 1` tokens (the bonus / replacement included) for `drafted + 1` tokens sent to the target.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from dspark.decode.step import Round
from dspark.schedule.survival import prefix_survival


def tau(rounds: Sequence[Round]) -> float:
    """Committed tokens per round, bonus token included."""
    return sum(r.accepted + 1 for r in rounds) / len(rounds) if rounds else 0.0


def verify_efficiency(rounds: Sequence[Round]) -> float:
    """Committed tokens / tokens verified by the target (a tree round verifies all its nodes)."""
    verified = sum(r.computed + 1 for r in rounds)
    return sum(r.accepted + 1 for r in rounds) / verified if verified else 0.0


def conditional_acceptance(rounds: Sequence[Round], positions: int) -> list[float | None]:
    """P(draft k accepted | drafts 0..k-1 accepted), over rounds that verified position k."""
    out = []
    for k in range(positions):
        reached = [r for r in rounds if r.verified > k and r.accepted >= k]
        out.append(sum(r.accepted > k for r in reached) / len(reached) if reached else None)
    return out


def survival_samples(
    rounds: Iterable[Round], positions: int, temperatures: Sequence[float] | None = None
) -> list[tuple[list[float], list[int]]]:
    """Per block position k: (prefix-survival scores, binary labels 'positions 0..k all accepted')
    over rounds that verified position k and carry confidence logits."""
    per = [([], []) for _ in range(positions)]
    for r in rounds:
        if r.confidence_logits is None:
            continue
        a = prefix_survival(r.confidence_logits, temperatures)
        for k in range(min(r.verified, positions, len(a))):
            per[k][0].append(a[k])
            per[k][1].append(int(r.accepted > k))
    return per


CALIBRATION_BINS = 20  # equal-width score bins of ECE and the reliability diagrams


def ece(scores: Sequence[float], labels: Sequence[int], bins: int = CALIBRATION_BINS) -> float:
    """Expected calibration error with equal-width bins."""
    if not scores:
        return float("nan")
    s = torch.tensor(scores, dtype=torch.float64)
    y = torch.tensor(labels, dtype=torch.float64)
    idx = (s * bins).long().clamp(0, bins - 1)
    total = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            total += float(m.sum()) * abs(float(s[m].mean()) - float(y[m].mean()))
    return total / len(scores)


def reliability_bins(scores: Sequence[float], labels: Sequence[int], bins: int = CALIBRATION_BINS) -> list[dict]:
    """Non-empty equal-width bins: mean score, observed accept rate, count (a reliability diagram)."""
    s = torch.tensor(scores, dtype=torch.float64)
    y = torch.tensor(labels, dtype=torch.float64)
    idx = (s * bins).long().clamp(0, bins - 1)
    out = []
    for b in range(bins):
        m = idx == b
        if m.any():
            out.append({"score": float(s[m].mean()), "accept": float(y[m].mean()), "count": int(m.sum())})
    return out


def roc_auc(scores: Sequence[float], labels: Sequence[int]) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half); NaN with a single class."""
    s = torch.tensor(scores, dtype=torch.float64)
    y = torch.tensor(labels, dtype=torch.bool)
    pos, neg = s[y], s[~y]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    ranks = _average_ranks(s)
    return float((ranks[y].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def _average_ranks(x: torch.Tensor) -> torch.Tensor:
    order = torch.argsort(x, stable=True)
    sorted_x = x[order]
    ranks = torch.empty_like(x)
    i, n = 0, len(x)
    while i < n:
        j = i
        while j + 1 < n and sorted_x[j + 1] == sorted_x[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def brier(scores: Sequence[float], labels: Sequence[int]) -> float:
    if not scores:
        return float("nan")
    s = torch.tensor(scores, dtype=torch.float64)
    y = torch.tensor(labels, dtype=torch.float64)
    return float(((s - y) ** 2).mean())


def calibration_report(rounds: Sequence[Round], positions: int, temperatures=None) -> dict | None:
    """Per-position ECE / AUC / Brier of the prefix-survival product, and their means over the
    positions that have data. None when no round carries confidence logits."""
    per = survival_samples(rounds, positions, temperatures)
    if not any(s for s, _ in per):
        return None
    rows = [dict(position=k, count=len(s), ece=ece(s, y), auc=roc_auc(s, y), brier=brier(s, y),
                 mean_score=sum(s) / len(s) if s else float("nan"),
                 accept_rate=sum(y) / len(y) if y else float("nan"), bins=reliability_bins(s, y))
            for k, (s, y) in enumerate(per)]

    def mean(key):
        vals = [r[key] for r in rows if r["count"] and not math.isnan(r[key])]
        return sum(vals) / len(vals) if vals else float("nan")

    return {"per_position": rows, "ece": mean("ece"), "auc": mean("auc"), "brier": mean("brier")}


def threshold_sweep(rounds: Sequence[Round], thresholds: Sequence[float], temperatures=None) -> list[dict]:
    """What a static confidence threshold would have done on rounds verified at full length:
    verify while a_k ≥ C; tokens committed per step and acceptance rate of the verified drafts."""
    out = []
    for c in thresholds:
        committed = verified = accepted = steps = 0
        for r in rounds:
            if r.confidence_logits is None:
                continue
            a = prefix_survival(r.confidence_logits[: r.verified], temperatures)
            ell = next((k for k, v in enumerate(a) if v < c), len(a))
            acc = min(r.accepted, ell)
            committed += acc + 1
            verified += ell
            accepted += acc
            steps += 1
        if steps:
            out.append(dict(threshold=c, tokens_per_step=committed / steps,
                            acceptance_rate=accepted / verified if verified else float("nan"),
                            drafts_per_step=verified / steps))
    return out
