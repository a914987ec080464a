"""Sequential Temperature Scaling of the confidence head (DESIGN.md §6).

For positions k = 0..γ-1, left to right, with T_0..T_{k-1} fixed, T_k is grid-searched to
minimise the ECE of Π_{i≤k} σ(z_i / T_i) against "positions 0..k all accepted". Dividing a logit by
a positive temperature is monotone, so every position keeps its ranking (AUC unchanged). A position
whose rounds were (nearly) all accepted or all rejected carries no evidence and keeps the previous T.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dspark.decode.step import Round
from dspark.eval.metrics import CALIBRATION_BINS, ece
from dspark.model.target import Target

GRID = torch.logspace(-1.5, 1.5, 241).tolist()  # T from ~0.03 to ~32
MIN_CLASS = 5  # fewer accepted (or rejected) rounds than this at a position: keep the previous T


def fit_sts(rounds: Sequence[Round], positions: int, bins: int = CALIBRATION_BINS) -> list[float]:
    """Per-position temperatures from rounds verified at full length (with confidence logits)."""
    data = [r for r in rounds if r.confidence_logits is not None]
    temps: list[float] = []
    # running log prefix product of calibrated survivals per round, up to position k-1
    log_prefix = torch.zeros(len(data), dtype=torch.float64)
    for k in range(positions):
        rows = [i for i, r in enumerate(data) if r.verified > k and len(r.confidence_logits) > k]
        y = [int(data[i].accepted > k) for i in rows]
        best_t = temps[-1] if temps else 1.0
        if min(sum(y), len(y) - sum(y)) >= MIN_CLASS:  # else no evidence to fit: an ECE of 0 from all-0 scores
            z = torch.tensor([data[i].confidence_logits[k] for i in rows], dtype=torch.float64)
            base = log_prefix[rows]
            best_e = float("inf")
            for t in GRID:
                scores = torch.exp(base + torch.nn.functional.logsigmoid(z / t)).tolist()
                e = ece(scores, y, bins)
                if e < best_e - 1e-12:
                    best_t, best_e = t, e
        temps.append(best_t)
        all_z = torch.tensor([r.confidence_logits[k] if len(r.confidence_logits) > k else 0.0 for r in data],
                             dtype=torch.float64)
        log_prefix = log_prefix + torch.nn.functional.logsigmoid(all_z / best_t)
    return temps


def record_full_rounds(target: Target, drafter, prompts: Sequence[str], max_new_tokens: int, params, seed: int = 0,
                       progress: bool = True) -> list[Round]:
    """Rounds with every draft verified (the labels STS needs), prompt i sampled with seed + i."""
    from tqdm import tqdm

    from dspark.decode.generate import Decoder

    decoder = Decoder(target, drafter)  # default policy: verify every draft
    rounds: list[Round] = []
    for i, text in enumerate(tqdm(prompts, desc="recording rounds", unit="prompt", disable=not progress)):
        rounds += decoder.generate(target.encode_prompt(text), max_new_tokens, params, seed=seed + i).rounds
    return rounds
