"""Scheduler simulator: any policy on synthetic confidences, acceptance draws and any SPS curve.

Each step, every one of R concurrent requests holds γ drafts whose true per-position acceptance
probabilities α_{r,k} are drawn around a mean that decays along the block; the drafter reports
them as calibrated survivals a_{r,j} = Π_{k<j} α_{r,k} (optionally blurred by noise). The policy
picks verification lengths, the target "verifies" by sequential Bernoulli draws, and the step
costs 1 / SPS(B) seconds, plus `draft_s` when it drafted (a policy may skip drafting: DraftGate).
Predicts throughput for other hardware without running a model.

Tree policies (`tree`, `tree:N`) grow each request's token tree with the real growth code
(`draft/tree.py`) over a calibrated synthetic drafter: a node at depth d puts α_d (drawn as above) on
its best child and the rest geometrically on seven more, and the target's token is drawn from that
same distribution; a step verifies every row's tree, R + N tokens.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from dspark.draft.tree import DraftTree, TreeGrowth, TreeLimits, grow_forest
from dspark.errors import DsparkError
from dspark.sampling import SamplingParams
from dspark.schedule.policies import Policy, SPSTable


@dataclasses.dataclass
class SimResult:
    policy: str
    concurrency: int
    throughput: float  # committed tokens per second, all requests
    per_user: float  # tokens per second per request
    avg_verify_len: float  # mean ℓ_r per request and step
    tau: float  # committed tokens per request and step


def simulate(
    policy: Policy,
    sps: SPSTable,
    concurrency: int,
    gamma: int = 8,
    steps: int = 2000,
    accept_mean: float = 0.8,
    decay: float = 0.97,
    spread: float = 0.15,
    noise: float = 0.0,
    seed: int = 0,
    draft_s: float = 0.0,
) -> SimResult:
    rng = random.Random(seed)
    committed = verified = 0
    seconds = 0.0
    for _ in range(steps):
        if not policy.should_draft(concurrency):
            seconds += 1.0 / sps(concurrency)
            committed += concurrency
            policy.record_step(concurrency, False, concurrency, concurrency, 0.0)
            continue
        if policy.tree_nodes:
            tokens, step_committed = _tree_step(policy, concurrency, gamma, rng, accept_mean, decay, spread)
            seconds += _step_seconds(policy, sps, tokens, concurrency) + draft_s
            committed, verified = committed + step_committed, verified + tokens - concurrency
            policy.record_step(concurrency, True, tokens, step_committed, draft_s)
            continue
        alphas, survivals = [], []
        for _ in range(concurrency):
            a = [min(0.999, max(0.001, rng.gauss(accept_mean * decay**k, spread))) for k in range(gamma)]
            alphas.append(a)
            run, s = 1.0, []
            for k in range(gamma):
                run *= min(0.999, max(0.001, a[k] + rng.gauss(0.0, noise))) if noise else a[k]
                s.append(run)
            survivals.append(s)
        lengths = policy.lengths(survivals, [gamma] * concurrency)
        tokens = concurrency + sum(lengths)
        seconds += _step_seconds(policy, sps, tokens, concurrency) + draft_s
        step_committed = 0
        for a, ell in zip(alphas, lengths):
            accepted = 0
            while accepted < ell and rng.random() < a[accepted]:
                accepted += 1
            step_committed += accepted + 1
            verified += ell
        committed += step_committed
        policy.record_step(concurrency, True, tokens, step_committed, draft_s)
    throughput = committed / seconds
    return SimResult(policy.name, concurrency, throughput, throughput / concurrency,
                     verified / (steps * concurrency), committed / (steps * concurrency))


def _step_seconds(policy: Policy, sps: SPSTable, tokens: int, concurrency: int) -> float:
    rate = sps(tokens)
    if rate <= 0:
        raise DsparkError(f"policy {policy.name} at concurrency {concurrency} verifies {tokens} tokens, beyond "
                          f"the SPS table (B <= {sps.max_tokens}): profile or give a larger table")
    return 1.0 / rate


def _tree_step(policy: Policy, concurrency: int, gamma: int, rng: random.Random, accept_mean: float,
               decay: float, spread: float) -> tuple[int, int]:
    """(tokens verified, tokens committed) of one step in which every row verifies a synthetic tree."""
    growths = [TreeGrowth(_synthetic_expand(rng, accept_mean, decay, spread), 0,
                          TreeLimits(policy.tree_nodes, gamma), SamplingParams(), None)
               for _ in range(concurrency)]
    trees = grow_forest(growths, policy.tree_admit(concurrency))
    committed = sum(_walk(tree, growth, rng) for tree, growth in zip(trees, growths))
    return concurrency + sum(map(len, trees)), committed


def _synthetic_expand(rng: random.Random, accept_mean: float, decay: float, spread: float, children: int = 8):
    """A node at depth d: α ~ N(accept_mean · decay^d, spread) on its best child, the rest halving over
    `children` - 1 more (as log-probabilities, the form `TreeGrowth` expands)."""
    tail = torch.tensor([0.5**s for s in range(1, children)])
    tail /= tail.sum()

    def expand(node: int, depth: int, token: int, state):
        top = min(0.999, max(0.001, rng.gauss(accept_mean * decay**depth, spread)))
        return torch.cat([torch.tensor([top]), (1 - top) * tail]).log(), None

    return expand


def _walk(tree: DraftTree, growth: TreeGrowth, rng: random.Random) -> int:
    """Tokens a synthetic tree commits (calibrated drafter: the target's token at a node is child s with
    the node's own probability of s): descend while that child was grown, then the bonus token."""
    children, node, committed = tree.children(), -1, 1
    while (probs := growth.nodes[node].probs if node in growth.nodes else None) is not None:
        s = rng.choices(range(probs.numel()), weights=probs.tolist())[0]
        node = next((c for c in children.get(node, ()) if tree.tokens[c] == s), None)
        if node is None:
            break
        committed += 1
    return committed
