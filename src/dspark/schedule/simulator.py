"""Scheduler simulator: any policy on synthetic confidences, acceptance draws and any SPS curve.

Each step, every one of R concurrent requests holds γ drafts whose true per-position acceptance
probabilities α_{r,k} are drawn around a mean that decays along the block; the drafter reports
them as calibrated survivals a_{r,j} = Π_{k<j} α_{r,k} (optionally blurred by noise). The policy
picks verification lengths, the target "verifies" by sequential Bernoulli draws, and the step
costs 1 / SPS(B) seconds, plus `draft_s` when it drafted (a policy may skip drafting: DraftGate).
Predicts throughput for other hardware without running a model.
"""

from __future__ import annotations

import dataclasses
import random

from dspark.errors import DsparkError
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
        rate = sps(tokens)
        if rate <= 0:
            raise DsparkError(f"policy {policy.name} at concurrency {concurrency} verifies {tokens} tokens, beyond "
                              f"the SPS table (B <= {sps.max_tokens}): profile or give a larger table")
        seconds += 1.0 / rate + draft_s
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
