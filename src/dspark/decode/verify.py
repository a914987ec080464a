"""Lossless verification (speculative rejection sampling): chains, batched over independent rows, and
token trees (one request at a time, `verify_tree_greedy` / `verify_tree_sampled` below).

Row r verified `lengths[r]` draft tokens d_0..d_{l-1}. Draft k is accepted with probability
min(1, p_t(d_k) / p_d(d_k)); at the first rejection the replacement is drawn from
norm(max(p_t - p_d, 0)); when all are accepted the bonus token is drawn from p_t at position l.
At temperature 0 (one-hot p_t) this is exactly "accept while the draft equals the target argmax".
"""

from __future__ import annotations

import torch

from dspark.draft.tree import DraftTree
from dspark.sampling import sample


def verify_chains(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    lengths: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify N draft chains at once.

    draft_tokens [N, L] (long), draft_probs [N, L, V] or None when every draft token was proposed
    deterministically (one-hot p_d, as prompt lookup does), target_probs [N, L+1, V],
    lengths [N] (0..L drafts to verify per row), uniforms [N, L+1] in [0, 1): column k < l is the
    acceptance draw of draft k, column l the draw that samples the final token.
    Returns (num_accepted [N], next_token [N]).
    """
    N, L = draft_tokens.shape
    rows = torch.arange(N)
    if L:
        p_t = target_probs[:, :L].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
        p_d = (
            torch.ones_like(p_t)
            if draft_probs is None
            else draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
        )
        accept = uniforms[:, :L] * p_d < p_t
        accept &= torch.arange(L)[None, :] < lengths[:, None]
        num_accepted = accept.long().cumprod(-1).sum(-1)
    else:
        num_accepted = torch.zeros(N, dtype=torch.long)

    final = target_probs[rows, num_accepted].clone()  # [N, V]: p_t at the stop position
    rejected = num_accepted < lengths
    if bool(rejected.any()):
        r = rows[rejected]
        k = num_accepted[rejected]
        residual = final[r]
        if draft_probs is None:
            residual[torch.arange(len(r)), draft_tokens[r, k]] = 0.0
        else:
            residual = (residual - draft_probs[r, k]).clamp_(min=0.0)
        # float round-off can leave nothing when p_t == p_d (a rejection then has probability 0)
        empty = residual.sum(-1) <= 0
        residual[empty] = final[r][empty]
        final[r] = residual
    next_token = sample(final, uniforms[rows, lengths])
    return num_accepted, next_token


def verify_tree_greedy(children: dict[int, list[int]], tokens: list[int], best: list[int]) -> tuple[list[int], int]:
    """Temperature 0: the longest path that follows the target's argmax. `best[1 + i]` is the target's
    argmax after node i (`best[0]`: after the anchor). Returns (accepted nodes, next token)."""
    node, path = -1, []
    while True:
        want = best[node + 1]
        node = next((c for c in children.get(node, ()) if tokens[c] == want), None)
        if node is None:
            return path, want
        path.append(node)


def verify_tree_sampled(tree: DraftTree, target_probs: torch.Tensor,
                        generator: torch.Generator) -> tuple[list[int], int]:
    """Recursive rejection sampling down a token tree (DESIGN.md §7b): at each node the children are
    tried in draw order, child k accepted with probability min(1, p_k(x) / q_k(x)), where q_k is the
    draft distribution the child was drawn from with the earlier siblings removed (one-hot for a
    deterministic child: greedy growth, a given branch) and p_k the target's distribution with each
    rejected q_j subtracted (p_{k+1} = norm(max(p_k - q_k, 0))); past the last child the next token is
    drawn from p.
    `target_probs[1 + i]` is the target's distribution after node i. Returns (accepted nodes, next token)."""
    children, node, path = tree.children(), -1, []
    while True:
        p = target_probs[node + 1]
        rest = tree.draft_probs(node, p.shape[0])  # a fresh copy (None: deterministic children)
        accepted = None
        for child in children.get(node, ()):
            x = tree.tokens[child]
            if rest is None or child in tree.given:
                q = torch.zeros_like(p)
                q[x] = 1.0
            else:
                q = rest / rest.sum()
            if rest is not None:
                rest[x] = 0.0
            if float(torch.rand(1, generator=generator)) * float(q[x]) < float(p[x]):
                accepted = child
                break
            residual = (p - q).clamp_(min=0.0)
            total = float(residual.sum())
            if total > 0:  # else p == q up to round-off: the rejection had probability 0
                p = residual / total
        if accepted is None:
            return path, int(sample(p, torch.rand(1, generator=generator))[0])
        path.append(accepted)
        node = accepted
