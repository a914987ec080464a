"""The heads on top of the block backbone: sequential (Markov / gated Markov / RNN) and confidence.

Every head works slot by slot through `step` (inference: the previous token was just sampled)
or over whole blocks through `teacher_forced` (training: previous tokens are the ground truth).
Both run the same arithmetic; `step` stops in the rank-r space so the inference loop can apply
W2 with its own fast kernel. Tensor names and layouts are DeepSpec's (`markov_head.gate_proj`, one
`markov_head.joint_proj` [3r, 2r + H] for the RNN's gate / candidate / output), so its checkpoints
load as they are; `LEGACY_NAMES` maps dspark's first names onto them.
"""

from __future__ import annotations

import torch
from torch import nn


class SequentialHead(nn.Module):
    """Adds a bias B(prev_k, ...) to the base logits U_k of block slot k (DESIGN.md §3)."""

    def __init__(self, kind: str, vocab_size: int, hidden_size: int, rank: int, draft_vocab_size: int | None = None):
        super().__init__()
        if kind not in ("vanilla", "gated", "rnn"):
            raise ValueError(kind)
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # W1: previous-token lookup (any target token)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size or vocab_size, bias=False)  # W2: rank -> draft-vocab bias
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)  # σ(Wg [h ; W1[prev]])
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)  # [s_{k-1}; W1[prev]; h] -> g, c, o

    def initial_state(self, h: torch.Tensor) -> torch.Tensor | None:
        """s_{-1} = 0 for the RNN head, shaped like one slot of `h` [..., H] -> [..., r]."""
        return h.new_zeros(*h.shape[:-1], self.rank) if self.kind == "rnn" else None

    def step(
        self, h: torch.Tensor, e: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One slot: h [..., H] and e = W1[prev] [..., r] -> (u [..., r], next state); the bias is W2·u."""
        if self.kind == "vanilla":
            return e, None
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1))) * e, None
        gate, candidate, out = self.joint_proj(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)
        g = torch.sigmoid(gate)
        new_state = g * state + (1 - g) * torch.tanh(candidate)
        return torch.tanh(out), new_state

    def teacher_forced(self, h: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks: h [..., γ, H], prev [..., γ] -> (bias [..., γ, K], W1[prev] [..., γ, r])."""
        e = self.markov_w1(prev)
        if self.kind != "rnn":  # stateless: every slot at once
            return self.markov_w2(self.step(h, e, None)[0]), e
        state = self.initial_state(h[..., 0, :])
        us = []
        for k in range(h.shape[-2]):
            u, state = self.step(h[..., k, :], e[..., k, :], state)
            us.append(u)
        return self.markov_w2(torch.stack(us, dim=-2)), e


def upgrade_legacy_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """dspark's first head tensor names -> DeepSpec's: `markov_gate` -> `gate_proj`, and the RNN's
    separate `rnn_gate` / `rnn_cell` / `rnn_out` stacked into `joint_proj` (gate, candidate, output)."""
    out = dict(tensors)
    for part in ("weight", "bias"):
        old = f"markov_head.markov_gate.{part}"
        if old in out:
            out[f"markov_head.gate_proj.{part}"] = out.pop(old)
        rnn = [f"markov_head.rnn_{n}.{part}" for n in ("gate", "cell", "out")]
        if all(k in out for k in rnn):
            out[f"markov_head.joint_proj.{part}"] = torch.cat([out.pop(k) for k in rnn])
    return out


class ConfidenceHead(nn.Module):
    """z_k = w·[h_k ; W1[prev_k]] + b, or w·h_k + b without the Markov input; c_k = σ(z_k)."""

    def __init__(self, hidden_size: int, rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (rank if with_markov else 0), 1)
        self.detach_inputs = False  # training: the BCE trains this head alone, not the h and W1 it reads

    def forward(self, h: torch.Tensor, prev_embed: torch.Tensor | None) -> torch.Tensor:
        """`prev_embed` (W1[prev], or None without a sequential head) is read only `with_markov`."""
        x = torch.cat([h, prev_embed.to(h.dtype)], dim=-1) if self.with_markov else h
        if self.detach_inputs:
            x = x.detach()
        return self.proj(x).squeeze(-1)
