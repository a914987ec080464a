"""Distillation losses and acceptance metrics (DESIGN.md §4, §5)."""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("dspark.train")


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


@dataclasses.dataclass
class TargetDist:
    """The target's distribution at supervised slots, as the losses need it: its probabilities on
    the draft vocabulary `p` [..., K] (all V tokens without a reduced vocabulary), the mass
    outside it `outside` [...], and its greedy token `top` [...] (a target id)."""

    p: torch.Tensor
    outside: torch.Tensor
    top: torch.Tensor

    @classmethod
    def from_logits(cls, target_logits: torch.Tensor, draft_ids: torch.Tensor | None) -> "TargetDist":
        p_t = F.softmax(target_logits.float(), dim=-1)
        top = target_logits.argmax(-1)
        if draft_ids is None:
            return cls(p_t, p_t.new_zeros(p_t.shape[:-1]), top)
        inside = p_t[..., draft_ids]
        return cls(inside, (1 - inside.sum(-1)).clamp(min=0), top)

    @classmethod
    def cat(cls, parts: list["TargetDist"]) -> "TargetDist":
        return cls(*(torch.cat([getattr(d, f.name) for d in parts]) for f in dataclasses.fields(cls)))

    def __getitem__(self, index) -> "TargetDist":
        return TargetDist(self.p[index], self.outside[index], self.top[index])


def _dist(target: "TargetDist | torch.Tensor", draft_ids: torch.Tensor | None) -> TargetDist:
    return target if isinstance(target, TargetDist) else TargetDist.from_logits(target, draft_ids)


def l1_to_target(log_pd: torch.Tensor, p_t: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
    """‖p_d − p_t‖₁ over the full vocabulary, p_d [..., K] being zero outside the draft vocabulary:
    Σ_K |p_d − p_t| + the target's mass `outside` it (which no draft distribution can cover)."""
    return (log_pd.exp() - p_t).abs().sum(-1) + outside


def draft_index(labels: torch.Tensor, draft_ids: torch.Tensor | None, vocab_size: int | None = None) -> torch.Tensor:
    """Target token ids -> draft-vocabulary indices, -1 for tokens outside it."""
    if draft_ids is None:
        return labels
    size = max(int(labels.max()) + 1 if labels.numel() else 0, int(draft_ids.max()) + 1, vocab_size or 0)
    index = torch.full((size,), -1, dtype=torch.long, device=labels.device)
    index[draft_ids] = torch.arange(draft_ids.numel(), device=labels.device)
    return index[labels]


def kd_loss_sums(
    draft_logits: torch.Tensor,
    conf_logits: torch.Tensor | None,
    target: TargetDist | torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    ce_weight: float,
    tv_weight: float,
    conf_weight: float,
    soft_ce_weight: float = 0.0,
    draft_ids: torch.Tensor | None = None,
    dense=None,
) -> LossSums:
    """Supervised slots only: draft logits [N, K] over the draft vocabulary `draft_ids` (None: the
    full vocabulary, K = V), the target's distribution (a `TargetDist`, or its logits [N, V]),
    confidence logits [N], labels [N] (target ids), weights [N] (w_k of each slot's block position).

    CE on the regenerated token, L1 distance ‖p_d − p_t‖₁ to the target distribution, and BCE of
    the confidence head against c* = 1 − ½‖p_d − p_t‖₁ (detached); `soft_ce_weight` > 0 puts the soft
    cross-entropy −Σ p_t log p_d (EAGLE-3's loss; forward KL up to a constant) in place of the CE on the
    token, with that weight (reported in the `ce` field). With a reduced vocabulary
    the L1 (and so c*) is exact over the full vocabulary: the target's mass outside counts as
    distance. The cross-entropies cover the draft vocabulary only: a label outside it, or target
    mass outside it, would be an infinite loss with no gradient, and is left out.
    `dense`: `dense_loss_sums` or a compiled copy of it (`compiled_dense_loss`)."""
    vocab_size = target.shape[-1] if isinstance(target, torch.Tensor) else None
    target = _dist(target, draft_ids)
    index = None if soft_ce_weight else draft_index(labels, draft_ids, vocab_size)
    sums = (dense or dense_loss_sums)(draft_logits, conf_logits, target.p, target.outside, index, weights,
                                      ce_weight, tv_weight, conf_weight, soft_ce_weight)
    return LossSums(*sums)


def dense_loss_sums(draft_logits, conf_logits, p_t, outside, index, w, ce_weight: float, tv_weight: float,
                    conf_weight: float, soft_ce_weight: float) -> tuple[torch.Tensor, ...]:
    """`kd_loss_sums`' arithmetic over [N, K] (labels already draft-vocabulary indices, `index`, None for
    the soft CE): (total, ce, tv, conf) sums. Elementwise passes and reductions only, so that a compiler
    fuses them."""
    log_pd = F.log_softmax(draft_logits.float(), dim=-1)
    zero = log_pd.new_zeros(())
    tv = conf = zero
    if soft_ce_weight:
        ce, ce_weight = -(p_t * log_pd).sum(-1), soft_ce_weight
    else:
        ce = -log_pd.gather(-1, index.clamp(min=0)[:, None]).squeeze(-1) * (index >= 0)
    if tv_weight or (conf_logits is not None and conf_weight):
        l1 = l1_to_target(log_pd, p_t, outside)
        tv = (w * l1).sum()
        if conf_logits is not None and conf_weight:
            c_star = (1 - 0.5 * l1.detach()).clamp(0, 1)
            bce = F.binary_cross_entropy_with_logits(conf_logits.float(), c_star, reduction="none")
            conf = (w * bce).sum()
    ce = (w * ce).sum()
    return ce_weight * ce + tv_weight * tv + conf_weight * conf, ce, tv, conf


def compiled_dense_loss():
    """`dense_loss_sums` compiled by Inductor over any slot count: one fused kernel for the elementwise
    passes and reductions of [N, K] in each direction (CPU, N = 2,040, K = 8,192: forward + backward
    0.21 -> 0.085 s); it falls back to eager, once and with a warning, where compilation fails."""
    compiled = torch.compile(dense_loss_sums, dynamic=True)
    state = {"fn": compiled}

    def run(*args):
        try:
            return state["fn"](*args)
        except Exception as e:
            if state["fn"] is dense_loss_sums:
                raise
            log.warning("the compiled loss failed (%s: %s); training on with the eager one", type(e).__name__, e)
            state["fn"] = dense_loss_sums
            return dense_loss_sums(*args)

    return run


def acceptance_sums(
    draft_logits: torch.Tensor, target: TargetDist | torch.Tensor, block_pos: torch.Tensor, block_size: int,
    draft_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block position k: (Σ α, count) over supervised slots, α = 1 − ½‖p_d − p_t‖₁ at T=1.

    draft logits [N, K] (over `draft_ids`, as in `kd_loss_sums`), the target's distribution
    (`TargetDist` [N] or logits [N, V]), each slot's block position [N] -> two [block_size] tensors."""
    target = _dist(target, draft_ids)
    l1 = l1_to_target(F.log_softmax(draft_logits.float(), dim=-1), target.p, target.outside)
    alpha = (1 - 0.5 * l1).clamp(0, 1)  # clamp: rounding of the L1 sum
    sums = alpha.new_zeros(block_size).index_add_(0, block_pos, alpha)
    return sums, torch.bincount(block_pos, minlength=block_size).to(alpha.dtype)


def greedy_acceptance_sums(
    draft_logits: torch.Tensor, target: TargetDist | torch.Tensor, block_pos: torch.Tensor, block_size: int,
    draft_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per block position k: Σ of T = 0 acceptances (the draft's argmax is the target's), shaped
    like `acceptance_sums`' first tensor (its counts apply)."""
    top = draft_logits.argmax(-1)
    hit = ((top if draft_ids is None else draft_ids[top]) == _dist(target, draft_ids).top).to(torch.float64)
    return hit.new_zeros(block_size).index_add_(0, block_pos, hit)


def expected_tau(alpha: list[float]) -> float:
    """τ = 1 + Σ_k Π_{i≤k} α_i (the bonus token included)."""
    tau, run = 1.0, 1.0
    for a in alpha:
        run *= a
        tau += run
    return tau
