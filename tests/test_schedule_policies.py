"""The prefix scheduler (DESIGN.md §7): exactness of Algorithm 1, its lossless read order, policies."""

import itertools
import random

import pytest

from dspark.errors import DsparkError
from dspark.schedule.policies import (
    DraftGate,
    DSparkAsyncPolicy,
    SPSTable,
    dspark_lengths,
    lookback_lengths,
    parse_policy,
    top_k_lengths,
)


class Recorded(list):
    """A request's survivals that remember the highest index read."""

    def __init__(self, values):
        super().__init__(values)
        self.max_read = -1

    def __getitem__(self, i):
        self.max_read = max(self.max_read, i)
        return super().__getitem__(i)


def theta(lengths, survivals, sps):
    return (len(lengths) + sum(sum(s[:l]) for s, l in zip(survivals, lengths))) * sps(len(lengths) + sum(lengths))


def first_token_distribution(lengths_policy):
    """Appendix A, exactly: one request, γ = 2, p_t = (0.7, 0.3), p_d = (0.5, 0.5), a_1 = 0.8,
    and a_2 depends on the sampled d_1 (0.8 after A, 0.0 after B); SPS(1, 2, 3) = 1.0, 0.5, 0.45."""
    p_t, p_d = {"A": 0.7, "B": 0.3}, {"A": 0.5, "B": 0.5}
    a2 = {"A": 0.8, "B": 0.0}
    sps = SPSTable((1.0, 0.5, 0.45))
    out = {"A": 0.0, "B": 0.0}
    for d1 in "AB":
        ell = lengths_policy([[0.8, a2[d1]]], sps)[0]
        if ell == 0:  # nothing verified: the token comes straight from p_t
            for t in "AB":
                out[t] += p_d[d1] * p_t[t]
            continue
        accept = min(1.0, p_t[d1] / p_d[d1])
        out[d1] += p_d[d1] * accept
        residual = {t: max(p_t[t] - p_d[t], 0.0) for t in "AB"}
        z = sum(residual.values())
        for t in "AB":
            out[t] += p_d[d1] * (1 - accept) * residual[t] / z
    return out["A"], out["B"]


def test_appendix_a_counterexample():
    assert first_token_distribution(lookback_lengths) == pytest.approx((0.85, 0.15))
    assert first_token_distribution(dspark_lengths) == pytest.approx((0.7, 0.3))


def test_algorithm_1_equals_brute_force_when_theta_is_unimodal_and_reads_lazily():
    rng = random.Random(0)
    checked = 0
    for _ in range(400):
        R = rng.randint(1, 3)
        gamma = rng.randint(1, 4)
        survivals = []
        for _ in range(R):
            a, run = [], 1.0
            for _ in range(gamma):
                run *= rng.uniform(0.3, 1.0)
                a.append(run)
            survivals.append(a)
        max_b = R * (gamma + 1)
        base = rng.uniform(5, 50)
        sps = SPSTable(tuple(base / (1 + rng.uniform(0.02, 0.4) * (b - 1)) ** rng.uniform(0.5, 1.5)
                             for b in range(1, max_b + 1)))
        # Θ along the descending order of survivals
        order = sorted((a for s in survivals for a in s), reverse=True)
        thetas = [(R + sum(order[:n])) * sps(R + n) for n in range(len(order) + 1)]
        peak = thetas.index(max(thetas))
        unimodal = all(thetas[i] < thetas[i + 1] for i in range(peak)) and all(
            thetas[i] > thetas[i + 1] for i in range(peak, len(thetas) - 1))
        recorded = [Recorded(s) for s in survivals]
        got = dspark_lengths(recorded, sps)
        for s, ell in zip(recorded, got):  # never read a_{r, ℓ_r + 2} (index ℓ_r + 1) or beyond
            assert s.max_read <= ell
        if not unimodal:
            continue
        best = max(theta(list(ls), survivals, sps) for ls in itertools.product(range(gamma + 1), repeat=R))
        assert theta(got, survivals, sps) == pytest.approx(best)
        checked += 1
    assert checked > 100


def test_lookback_reads_past_its_stopping_point():
    recorded = [Recorded([0.8, 0.8])]
    assert lookback_lengths(recorded, SPSTable((1.0, 0.5, 0.45))) == [2]
    recorded = [Recorded([0.8, 0.0])]
    assert lookback_lengths(recorded, SPSTable((1.0, 0.5, 0.45))) == [0]
    assert recorded[0].max_read == 1  # it looked at a_2 to decide about d_1: the source of the bias
    recorded = [Recorded([0.8, 0.8])]
    assert dspark_lengths(recorded, SPSTable((1.0, 0.5, 0.45))) == [0] and recorded[0].max_read == 0


def test_simple_policies_and_parsing():
    sps = SPSTable((10.0, 9.0, 8.0, 7.0, 6.0, 5.0))
    survivals, drafted = [[0.9, 0.5, 0.2], [0.4, 0.3], []], [3, 2, 0]
    assert parse_policy("ar").lengths(survivals, drafted) == [0, 0, 0]
    assert parse_policy("fixed:1").lengths(survivals, drafted) == [1, 1, 0]
    assert parse_policy("fixed:5").lengths(survivals, drafted) == [3, 2, 0]
    assert parse_policy("threshold:0.45").lengths(survivals, drafted) == [2, 0, 0]
    assert parse_policy("dspark", sps).lengths(survivals, [1, 2, 0]) == dspark_lengths(survivals, sps, [1, 2, 0])
    assert top_k_lengths(survivals, 3) == [2, 1, 0]
    for bad, msg in [("fixed:0", "K >= 1"), ("fixed:x", "integer"), ("threshold:2", "C in"), ("mtp", "unknown"),
                     ("dspark", "SPS table")]:
        with pytest.raises(DsparkError, match=msg):
            parse_policy(bad)
    with pytest.raises(DsparkError, match="positive"):
        SPSTable((1.0, 0.0))


def test_async_capacity_comes_from_two_steps_earlier():
    sps = SPSTable(tuple(100.0 / (1 + 0.15 * b) for b in range(12)))
    policy = DSparkAsyncPolicy(sps)
    steps = [[[0.95, 0.9, 0.85], [0.9, 0.8, 0.7]], [[0.1, 0.05, 0.01], [0.2, 0.1, 0.05]],
             [[0.99, 0.98, 0.97], [0.99, 0.98, 0.97]]]
    out = [policy.lengths(s, [3, 3]) for s in steps]
    assert out[0] == dspark_lengths(steps[0], sps) and out[1] == dspark_lengths(steps[1], sps)  # warm-up
    capacity = sum(lookback_lengths(steps[0], sps))  # from step 0, not from the current survivals
    assert sum(out[2]) == capacity and out[2] == top_k_lengths(steps[2], capacity)


def test_draft_gate_skips_drafting_that_does_not_pay_and_probes_again():
    sps = SPSTable((20.0,) * 9)  # a plain step: 50 ms for one token
    gate = DraftGate(sps, draft_seconds=lambda requests: 0.025, probe_every=4)
    assert gate.should_draft(1)  # nothing known: draft
    gate.record(1, True, verified=3, committed=1, draft_s=0.025)  # 1 token in 75 ms
    assert not gate.should_draft(1) and gate.should_draft(2)  # R = 2 has no record yet
    for _ in range(3):
        gate.record(1, False, 1, 1, 0.0)
        assert not gate.should_draft(1)
    gate.record(1, False, 1, 1, 0.0)
    assert gate.should_draft(1)  # probe after 4 skipped steps
    for _ in range(10):  # now 3 tokens per drafting step: 3 / 75 ms beats 1 / 50 ms
        gate.record(1, True, 3, 3, 0.025)
    assert gate.should_draft(1)
    with pytest.raises(DsparkError, match="probe_every"):
        DraftGate(sps, probe_every=8, max_probe_every=4)


def test_draft_gate_trusts_timed_steps_over_the_cost_model():
    """Where the engine times its steps, drafting must beat a timed plain step at the same size: the
    model (SPS 20 / s flat, a 25 ms draft pass) says 2 tokens per 75 ms beat 1 per 50 ms, but plain
    steps of these 4 rows take 30 ms."""
    sps = SPSTable((20.0,) * 9)
    gate = DraftGate(sps, draft_seconds=lambda requests: 0.025, probe_every=4, max_probe_every=8)
    gate.record(4, True, verified=12, committed=8, draft_s=0.025, step_s=2.0)  # a first step: not timed
    assert gate.should_draft(4)  # the model drafts (nothing timed yet)
    gate.record(4, True, verified=12, committed=8, draft_s=0.025, step_s=0.075)
    assert not gate.should_draft(4)  # the model would draft; first plain steps at this size, timed
    gate.record(4, False, 4, 4, 0.0, step_s=0.5)  # (the first: not timed)
    assert not gate.should_draft(4)
    gate.record(4, False, 4, 4, 0.0, step_s=0.030)
    assert not gate.should_draft(4) and gate.should_draft(3)  # 2 / 75 ms < 1 / 30 ms; R = 3 unknown
    for _ in range(2):
        gate.record(4, False, 4, 4, 0.0, step_s=0.030)
    assert gate.should_draft(4)  # the probe after probe_every skipped steps
    # slower plain steps (50 ms): now drafting wins, every step, but one in max_probe_every is timed plain
    kinds = []
    for _ in range(40):
        drafted = gate.should_draft(4)
        kinds.append(drafted)
        gate.record(4, drafted, 12, 8, 0.025, step_s=0.075 if drafted else 0.050)
    assert kinds[-18:] == ([True] * 8 + [False]) * 2
    untimed = DraftGate(sps, draft_seconds=lambda requests: 0.025)  # the simulator's steps: the model alone
    untimed.record(4, True, 12, 8, 0.025)
    assert untimed.should_draft(4)


def _probe_gaps(gate: DraftGate, committed: int, steps: int) -> list[int]:
    """Skipped steps between drafting steps over `steps` steps, each drafting step committing `committed`."""
    gaps, run = [], 0
    for _ in range(steps):
        if gate.should_draft(1):
            gate.record(1, True, verified=3, committed=committed, draft_s=0.025)
            gaps.append(run)
            run = 0
        else:
            gate.record(1, False, 1, 1, 0.0)
            run += 1
    return gaps


def test_draft_gate_backs_off_probing_a_drafter_that_never_pays():
    sps = SPSTable((20.0,) * 9)
    gate = DraftGate(sps, draft_seconds=lambda requests: 0.025, probe_every=4, max_probe_every=32)
    assert _probe_gaps(gate, committed=1, steps=200) == [0, 4, 8, 16, 32, 32, 32, 32, 32]
    # the drafter got good (3 tokens per 75 ms beat 1 per 50 ms): the probes find out (the running
    # mean needs two), and from then on it drafts every step
    gaps = _probe_gaps(gate, committed=3, steps=100)
    assert max(gaps[:2]) <= 32 and gaps[2:] == [0] * (len(gaps) - 2) and len(gaps) > 30
    # a bad phase after a good one: the waits start again from probe_every
    gaps = _probe_gaps(gate, committed=1, steps=60)
    assert gaps[-3:] == [4, 8, 16] and set(gaps[:-3]) == {0}
    assert gate.step_rate(1)(3) == pytest.approx(1 / (0.025 + 1 / 20))
    measured = DraftGate(sps)  # no given costs: running mean of measured draft passes
    assert measured.draft_cost(1) == 0.0
    measured.record(1, True, 2, 2, 0.01)
    measured.record(1, True, 2, 2, 0.02)
    assert measured.draft_cost(1) == pytest.approx(0.012)
    measured.reset()
    assert measured.draft_cost(1) == 0.0 and measured.should_draft(1)


def test_ar_policy_never_drafts_and_dspark_counts_the_draft_pass():
    sps = SPSTable((10.0, 7.0, 6.0, 5.5))
    assert not parse_policy("ar").should_draft(4) and parse_policy("fixed:1").should_draft(4)
    policy = parse_policy("dspark", sps)
    survivals = [[0.6, 0.3, 0.1]]
    assert policy.lengths(survivals, [3]) == dspark_lengths(survivals, sps) == [2]  # no draft cost seen yet
    policy.record_step(1, True, 2, 2, 0.5)  # a draft pass of 0.5 s dwarfs the verify cost
    assert policy.lengths(survivals, [3]) == [3]  # so verifying every draft is worth it
