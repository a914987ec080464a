"""Verification-length policies, including the hardware-aware prefix scheduler (DESIGN.md §7).

Every policy maps, for one engine step, each request's prefix survivals a_{r,1} ≥ a_{r,2} ≥ ...
(a_{r,j}: probability that drafts 1..j all survive) to a verification length ℓ_r. Survivals are
read lazily, in order: a_{r,j+1} depends on the sampled draft d_{r,j}, so a lossless policy may
read it only after it has decided to verify d_{r,j} (DESIGN.md §7, Appendix A).
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Callable, Sequence

from dspark.errors import DsparkError

MAX_TREE_NODES = 256


@dataclasses.dataclass(frozen=True)
class SPSTable:
    """Target steps per second for a verification forward of B tokens, B = 1..max_tokens."""

    values: tuple[float, ...]  # values[B - 1] = SPS(B)

    def __post_init__(self):
        if not self.values or any(not v > 0 for v in self.values):
            raise DsparkError("an SPS table needs positive steps/s for B = 1..max")

    @property
    def max_tokens(self) -> int:
        return len(self.values)

    def __call__(self, tokens: int) -> float:
        """SPS(B); 0 beyond the profiled maximum (such a step is never chosen)."""
        return self.values[tokens - 1] if 1 <= tokens <= len(self.values) else 0.0


def _admit(
    survivals: Sequence[Sequence[float]],
    sps: Callable[[int], float],
    stop_at_drop: bool,
    capacity: int | None = None,
    limits: Sequence[int] | None = None,
):
    """Admit drafts in descending survival order, reading each request's next survival lazily.

    stop_at_drop: stop at the first admission that does not raise Θ = τ·SPS(B) (Algorithm 1);
    otherwise scan everything and keep the best prefix of the order (look-back search).
    capacity: admit exactly the top-`capacity` drafts instead (no Θ test).
    limits: per request, how many drafts exist (default: all survivals given).
    Returns (lengths, number admitted in the best prefix)."""
    R = len(survivals)
    avail = [len(s) if limits is None else min(len(s), n) for s, n in zip(survivals, limits or [0] * R)]
    lengths = [0] * R
    heap = [(-s[0], r, 1) for r, s in enumerate(survivals) if avail[r] > 0]
    heapq.heapify(heap)
    tokens, tau = R, float(R)
    best = tau * sps(tokens)
    history: list[int] = []  # admitted requests, in order
    best_len = 0
    while heap:
        if capacity is not None and len(history) >= capacity:
            break
        neg_a, r, j = heapq.heappop(heap)
        tokens += 1
        tau += -neg_a
        theta = tau * sps(tokens)
        if capacity is None:
            if theta <= best:
                if stop_at_drop:
                    break
            else:
                best, best_len = theta, len(history) + 1
        history.append(r)
        lengths[r] = j
        if j < avail[r]:  # read a_{r,j+1} only now that d_{r,j} is admitted
            heapq.heappush(heap, (-survivals[r][j], r, j + 1))
    if capacity is None:
        lengths = [0] * R
        for r in history[:best_len]:
            lengths[r] += 1
    return lengths, (len(history) if capacity is not None else best_len)


def dspark_lengths(survivals: Sequence[Sequence[float]], sps: Callable[[int], float],
                   limits: Sequence[int] | None = None) -> list[int]:
    """Algorithm 1 with the early-stop break (lossless)."""
    return _admit(survivals, sps, stop_at_drop=True, limits=limits)[0]


def lookback_lengths(survivals: Sequence[Sequence[float]], sps: Callable[[int], float]) -> list[int]:
    """Unconstrained search: the best prefix of the whole descending order. Biased if applied to the
    current step's survivals (Appendix A); used on stale survivals by `dspark-async`."""
    return _admit(survivals, sps, stop_at_drop=False)[0]


def top_k_lengths(survivals: Sequence[Sequence[float]], capacity: int, limits: Sequence[int] | None = None) -> list[int]:
    """Admit the `capacity` highest current survivals (prefix-closed, read lazily)."""
    return _admit(survivals, SPSTable((1.0,)), stop_at_drop=False, capacity=capacity, limits=limits)[0]


class DraftGate:
    """Whether a step drafts at all. The drafter pass is paid before any verification length is
    chosen, so this is decided from past steps only (never from this step's drafts: lossless).

    Drafting pays when a drafting step commits more tokens per second than a plain one at the same
    number of requests R. Where both kinds of step have been timed at R (the engine passes each step's
    seconds), that is τ̄ / t_drafting ≥ 1 / t_plain with running means of the timed steps: the verify
    cost of a batch of ragged rows is not the profiled curve's single-row forward of as many tokens (on
    an AVX512-BF16 EPYC it rose ~3x faster with the tokens), so the timings decide. Until then, the model
    R·τ̄ / (t_draft + 1 / SPS(R·v̄)) ≥ R·SPS(R): τ̄ and v̄ running means of tokens committed and positions
    computed per request over drafting steps at R, t_draft the draft-pass seconds (`draft_seconds(R)`,
    else the running mean of measured ones). Once a size has drafted, its next steps are plain until one
    is timed (the first of each kind and size is not: it pays one-time costs), and one step in
    `max_probe_every` drafting steps is too, to keep the comparison current. After
    `probe_every` skipped steps it drafts once to refresh the estimates; each probe that finds drafting
    still does not pay doubles that wait (up to `max_probe_every`), so a drafter that never pays costs
    ever fewer probes, and a step that pays restores it."""

    def __init__(self, sps: SPSTable, draft_seconds: Callable[[int], float] | None = None,
                 probe_every: int = 16, max_probe_every: int = 256, weight: float = 0.2):
        if not 1 <= probe_every <= max_probe_every:
            raise DsparkError(f"need 1 <= probe_every <= max_probe_every, got {probe_every}, {max_probe_every}")
        self.sps, self.draft_seconds = sps, draft_seconds
        self.probe_every, self.max_probe_every, self.weight = probe_every, max_probe_every, weight
        self.reset()

    def reset(self) -> None:
        self.stats: dict[int, list[float]] = {}  # R -> [τ̄, v̄, measured t_draft]
        self.timed: dict[int, list[float | None]] = {}  # R -> running mean seconds of [a drafting, a plain] step
        self.warmed: set[tuple[int, bool]] = set()  # (R, drafted) of the steps seen (their first is not timed)
        self.skipped = 0
        self.drafted_in_a_row = 0
        self.interval = self.probe_every  # skipped steps before the next probe

    def draft_cost(self, requests: int) -> float:
        """Seconds a drafting pass over `requests` requests adds to a step (0 before any is seen)."""
        if self.draft_seconds:
            return self.draft_seconds(requests)
        stats = self.stats.get(requests)
        return stats[2] if stats else 0.0

    def should_draft(self, requests: int) -> bool:
        if requests not in self.stats:
            return True
        timed = self.timed.get(requests)
        if timed is not None and (timed[1] is None or self.drafted_in_a_row >= self.max_probe_every):
            return False  # time a plain step at this size: what drafting must beat
        return self.skipped >= self.interval or self._pays(requests)

    def _pays(self, requests: int) -> bool:
        tau, verify, _ = self.stats[requests]
        timed = self.timed.get(requests)
        if timed is not None and None not in timed:  # both kinds of step timed at this size
            return tau / timed[0] >= 1.0 / timed[1]
        tokens = min(self.sps.max_tokens, max(requests, round(requests * verify)))
        return tau / (self.draft_cost(requests) + 1.0 / self.sps(tokens)) >= self.sps(requests)

    def step_rate(self, requests: int) -> Callable[[int], float]:
        """Steps per second of a drafting step verifying B tokens: 1 / (t_draft + 1 / SPS(B))."""
        t = self.draft_cost(requests)
        return lambda tokens: 1.0 / (t + 1.0 / self.sps(tokens)) if self.sps(tokens) > 0 else 0.0

    def record(self, requests: int, drafted: bool, verified: int, committed: int, draft_s: float,
               step_s: float | None = None) -> None:
        """One finished step: positions the verify forward computed (B) and tokens committed over its
        `requests` requests; `step_s` its seconds (draft pass, verify forward, verification), if timed."""
        if step_s is not None and (requests, drafted) not in self.warmed:
            self.warmed.add((requests, drafted))  # a first step of its kind and size pays one-time costs
        elif step_s is not None:  # (oneDNN primitives for new shapes: ~2 s once, measured on an EPYC)
            timed = self.timed.setdefault(requests, [None, None])
            old = timed[not drafted]
            timed[not drafted] = step_s if old is None else old + self.weight * (step_s - old)
        if not drafted:
            self.skipped += 1
            self.drafted_in_a_row = 0
            return
        probed = self.skipped >= self.interval
        self.skipped = 0
        self.drafted_in_a_row += 1
        new = [committed / requests, verified / requests, draft_s]
        old = self.stats.get(requests)
        self.stats[requests] = new if old is None else [o + self.weight * (n - o) for o, n in zip(old, new)]
        if self._pays(requests):
            self.interval = self.probe_every
        elif probed:
            self.interval = min(2 * self.interval, self.max_probe_every)


class Policy:
    """Chooses verification lengths for a batch of requests, one engine step at a time."""

    name = "policy"
    needs_survivals = True
    drafts = True  # False: the engine never drafts (plain AR)
    gate: DraftGate | None = None  # decides per step whether drafting pays at all
    tree_nodes = 0  # > 0: each row verifies a token tree of up to this many drafts

    def tree_admit(self, rows: int) -> Callable[[int, float, float], bool] | None:
        """For a step of `rows` rows growing their trees together: (drafts of all rows so far, their
        total gain, the next one's priority) -> grow it? None: every row grows `tree_nodes`."""
        return None

    def should_draft(self, requests: int) -> bool:
        return self.drafts and (self.gate is None or self.gate.should_draft(requests))

    def reset(self) -> None:
        """Forget what earlier steps taught (a single request's decoder starts each request afresh, so
        its output depends on that request alone)."""
        if self.gate is not None:
            self.gate.reset()

    def record_step(self, requests: int, drafted: bool, verified: int, committed: int, draft_s: float,
                    step_s: float | None = None) -> None:
        if self.gate is not None:
            self.gate.record(requests, drafted, verified, committed, draft_s, step_s)

    def lengths(self, survivals: Sequence[Sequence[float]], drafted: Sequence[int]) -> list[int]:
        raise NotImplementedError


class ARPolicy(Policy):
    name = "ar"
    needs_survivals = False
    drafts = False

    def lengths(self, survivals, drafted):
        return [0] * len(drafted)


class VerifyAllPolicy(Policy):
    """Verify every draft the drafter proposes (`PATH` / `PATH@full`)."""

    name = "full"
    needs_survivals = False

    def lengths(self, survivals, drafted):
        return list(drafted)


class FixedPolicy(Policy):
    needs_survivals = False

    def __init__(self, k: int):
        if k < 1:
            raise DsparkError(f"fixed:K needs K >= 1, got {k}")
        self.k, self.name = k, f"fixed:{k}"

    def lengths(self, survivals, drafted):
        return [min(self.k, d) for d in drafted]


class TreePolicy(Policy):
    """Verify a token tree of up to `nodes` drafts grown best-first per row (`tree:N`, DESIGN.md §7b);
    rows whose drafter grows no trees verify their whole chains (`full`)."""

    needs_survivals = False

    def __init__(self, nodes: int):
        if not 1 <= nodes <= MAX_TREE_NODES:
            raise DsparkError(f"tree:N needs N in 1..{MAX_TREE_NODES}, got {nodes}")
        self.tree_nodes, self.name = nodes, f"tree:{nodes}"

    def lengths(self, survivals, drafted):
        return list(drafted)


class ThresholdPolicy(Policy):
    def __init__(self, c: float):
        if not 0.0 <= c <= 1.0:
            raise DsparkError(f"threshold:C needs C in [0, 1], got {c}")
        self.c, self.name = c, f"threshold:{c:g}"

    def lengths(self, survivals, drafted):
        out = []
        for s, d in zip(survivals, drafted):
            n = 0
            while n < min(d, len(s)) and s[n] >= self.c:  # stops before reading past a rejection
                n += 1
            out.append(n)
        return out


class DSparkPolicy(Policy):
    """Algorithm 1 maximising Θ = τ / (t_draft + 1 / SPS(B)): the profiled SPS curve with the drafting
    pass counted in each step's time (t_draft = 0 gives DESIGN.md's τ·SPS(B)); and no drafting at all
    while it does not pay (DraftGate)."""

    name = "dspark"

    def __init__(self, sps: SPSTable):
        self.sps = sps
        self.gate = DraftGate(sps)

    def lengths(self, survivals, drafted):
        return dspark_lengths(survivals, self.rate(len(drafted)), drafted)

    def rate(self, requests: int) -> Callable[[int], float]:
        return self.gate.step_rate(requests) if self.gate else self.sps


class DSparkTreePolicy(DSparkPolicy):
    """`tree`: the rows of a step grow their best-first token trees together (up to `tree_nodes` drafts
    each), the next node of any row while it raises Θ = (R + Σ_{i<N} s_i) · rate(R + N) — R rows, N
    drafts, s_i node i's slot priority, its path's draft probability as known *before* the node is
    drawn, rate the step rate of the SPS curve with the drafting pass — stopping at the first that does
    not (what is grown never depends on a node's own token: lossless, DESIGN.md §7b). As the batch
    grows the curve steepens and the trees shrink to chains and to nothing; rows whose drafter grows
    no trees get the dspark policy's chains."""

    name = "tree"

    def __init__(self, sps: SPSTable):
        super().__init__(sps)
        self.max_nodes = max(1, sps.max_tokens - 1)  # the profiled curve's reach

    @property
    def tree_nodes(self) -> int:
        """How many nodes are worth growing: node k can raise Θ only while ρ_k = rate(k) / rate(k + 1) keeps
        (k - 1)(ρ_k - 1) < 1 (its priority s is at most each earlier one's and at most 1, so the gain
        before it is at least 1 + (k - 1) s): on a curve with a step (the compiled runner's 9 rows, then
        eager) growth stops at the step instead of drafting nodes no prefix would keep."""
        rate = self.rate(1)
        for k in range(1, self.max_nodes + 1):
            rho = rate(k) / rate(k + 1) if rate(k + 1) > 0 else float("inf")
            if (k - 1) * (rho - 1) >= 1 or rho >= 2:
                return max(1, k - 1)
        return self.max_nodes

    def tree_admit(self, rows: int) -> Callable[[int, float, float], bool]:
        rate = self.rate(rows)
        return lambda n, gain, priority: (gain + priority) * rate(rows + n + 1) > gain * rate(rows + n)


class DSparkAsyncPolicy(DSparkPolicy):
    """Capacity K from the survivals of two steps earlier (unconstrained search), then top-K
    admission of the current survivals. Lossless: K never depends on the current tokens."""

    name = "dspark-async"

    def __init__(self, sps: SPSTable):
        super().__init__(sps)
        self._history: list[list[list[float]]] = []  # survivals of the last two drafting steps

    def reset(self) -> None:
        super().reset()
        self._history = []

    def lengths(self, survivals, drafted):
        rate = self.rate(len(drafted))
        if len(self._history) < 2:  # warm-up: the synchronous rule
            out = dspark_lengths(survivals, rate, drafted)
        else:
            capacity = sum(lookback_lengths(self._history[0], rate))
            out = top_k_lengths(survivals, capacity, drafted)
        # kept for the step after next, which reads them only once these drafts are verified
        self._history = (self._history + [[list(s[:d]) for s, d in zip(survivals, drafted)]])[-2:]
        return out


POLICY_NAMES = ("ar", "full", "fixed", "threshold", "tree", "dspark", "dspark-async")
POLICIES = "ar | full | fixed:K | threshold:C | tree | tree:N | dspark | dspark-async"  # the spellings parse_policy reads


def parse_policy(spec: str, sps: SPSTable | None = None) -> Policy:
    """ar | full | fixed:K | threshold:C | tree | tree:N | dspark | dspark-async."""
    name, _, arg = spec.partition(":")
    try:
        if name == "ar" and not arg:
            return ARPolicy()
        if name == "full" and not arg:
            return VerifyAllPolicy()
        if name == "fixed":
            return FixedPolicy(int(arg))
        if name == "threshold":
            return ThresholdPolicy(float(arg))
        if name == "tree" and arg:
            return TreePolicy(int(arg))
    except ValueError:
        raise DsparkError(f"bad policy {spec!r}: fixed:K and tree:N need an integer, threshold:C needs a number") from None
    if name in ("dspark", "dspark-async", "tree") and not arg:
        if sps is None:
            raise DsparkError(f"policy {spec} needs an SPS table (run `dspark profile`)")
        return {"dspark": DSparkPolicy, "dspark-async": DSparkAsyncPolicy, "tree": DSparkTreePolicy}[name](sps)
    raise DsparkError(f"unknown policy {spec!r}; choose ar, full, fixed:K, threshold:C, tree, tree:N, dspark or "
                      "dspark-async")
