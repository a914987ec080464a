"""Distillation losses and acceptance metrics (DESIGN.md §4, §5)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


def position_weights(block_size: int, decay: float) -> torch.Tensor:
    """w_k = exp(-k / λ)."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32) / decay)


def step_weights(steps: int, base: float) -> torch.Tensor:
    """EAGLE-3 training-time-test weights base^k."""
    return base ** torch.arange(steps, dtype=torch.float32)


@dataclasses.dataclass
class LossSums:
    """Weighted sums over supervised slots (divide by the global weight to get means)."""

    total: torch.Tensor
    ce: torch.Tensor
    tv: torch.Tensor
    conf: torch.Tensor


def kd_loss_sums(
    draft_logits: torch.Tensor,
    conf_logits: torch.Tensor | None,
    target_logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    ce_weight: float,
    tv_weight: float,
    conf_weight: float,
    soft_ce_weight: float = 0.0,
) -> LossSums:
    """Supervised slots only: draft/target logits [N, V], confidence logits [N], labels [N],
    weights [N] (w_k of each slot's block position).

    CE on the regenerated token, L1 distance ‖p_d − p_t‖₁ to the target distribution, and BCE of
    the confidence head against c* = 1 − ½‖p_d − p_t‖₁ (detached); EAGLE-3 uses the soft
    cross-entropy −Σ p_t log p_d instead (reported in the `ce` field)."""
    w = weights
    log_pd = F.log_softmax(draft_logits.float(), dim=-1)
    zero = log_pd.new_zeros(())
    tv = conf = zero
    if soft_ce_weight:
        soft = -(F.softmax(target_logits.float(), dim=-1) * log_pd).sum(-1)
        ce = (w * soft).sum()
        return LossSums(soft_ce_weight * ce, ce, tv, conf)
    ce = -log_pd.gather(-1, labels[:, None]).squeeze(-1)
    if tv_weight or conf_weight:
        p_t = F.softmax(target_logits.float(), dim=-1)
        l1 = (log_pd.exp() - p_t).abs().sum(-1)
        tv = (w * l1).sum()
        if conf_logits is not None and conf_weight:
            c_star = (1 - 0.5 * l1.detach()).clamp(0, 1)
            bce = F.binary_cross_entropy_with_logits(conf_logits.float(), c_star, reduction="none")
            conf = (w * bce).sum()
    ce = (w * ce).sum()
    total = ce_weight * ce + tv_weight * tv + conf_weight * conf
    return LossSums(total, ce, tv, conf)


def acceptance_sums(
    draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block position k: (Σ α, count) over supervised slots, α = 1 − ½‖p_d − p_t‖₁ at T=1.

    draft/target logits [N, γ, V], mask [N, γ] -> two [γ] tensors."""
    p_d = F.softmax(draft_logits.float(), dim=-1)
    p_t = F.softmax(target_logits.float(), dim=-1)
    alpha = (1 - 0.5 * (p_d - p_t).abs().sum(-1)).clamp(0, 1)  # clamp: rounding of the L1 sum
    m = mask.float()
    return (alpha * m).sum(0), m.sum(0)


def expected_tau(alpha: list[float]) -> float:
    """τ = 1 + Σ_k Π_{i≤k} α_i (the bonus token included)."""
    tau, run = 1.0, 1.0
    for a in alpha:
        run *= a
        tau += run
    return tau
