"""Batched speculative engine with continuous batching and a verification-length policy.

Requests join free slots between steps (prefilled one by one into their row of a shared KV cache)
and leave when done. One engine step: every active request drafts (unless the policy, from past
steps, finds that drafting does not pay: then it is a plain AR step), the policy chooses how many of
each request's drafts to verify (ℓ_r), one ragged target forward verifies all of them (row r
holds 1 + ℓ_r tokens), each row accepts / resamples with its own generator, and the cache rows roll
back to their committed lengths. All randomness is per request, so a request's sample path never
depends on which requests share its batch (only on float numerics of batched products).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable

import torch

from dspark.decode.generate import RoundRecord
from dspark.decode.sampling import SamplingParams, new_generator, probs_from_logits, sample
from dspark.decode.stopping import StopChecker
from dspark.decode.verify import verify_chains
from dspark.draft.base import Drafter
from dspark.draft.heads import prefix_survival
from dspark.errors import DsparkError
from dspark.schedule.policies import ARPolicy, Policy

HEADROOM = 64  # extra cache columns for the padding of ragged verification rows (caps drafts per step)


@dataclasses.dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 256
    params: SamplingParams = SamplingParams()
    seed: int | None = 0
    stop: tuple[str, ...] = ()
    on_tokens: Callable[[list[int]], None] | None = None
    id: str = ""
    # filled in by the engine
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    rounds: list[RoundRecord] = dataclasses.field(default_factory=list)
    submitted_at: float = 0.0
    first_token_at: float = 0.0
    finished_at: float = 0.0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class _Slot:
    request: Request
    generator: torch.Generator
    checker: StopChecker
    drafter: Drafter | None
    anchor: int  # last sampled token, not yet in the cache


class AcceptanceEstimate:
    """Running per-position conditional acceptance, for drafters without a confidence head."""

    def __init__(self, positions: int, prior: float = 0.5, weight: float = 0.02):
        self.alpha = [prior] * positions
        self.weight = weight

    def survivals(self, n: int) -> list[float]:
        out, run = [], 1.0
        for k in range(n):
            run *= self.alpha[min(k, len(self.alpha) - 1)]
            out.append(run)
        return out

    def update(self, verified: int, accepted: int) -> None:
        for k in range(min(verified, accepted + 1, len(self.alpha))):
            self.alpha[k] += self.weight * (float(k < accepted) - self.alpha[k])


class Engine:
    """Continuous-batching speculative decoding over `max_batch` slots.

    Drafting: `draft_model` (a DSpark / DFlash model) drafts for all slots in one batched pass;
    otherwise `make_drafter` builds one Drafter per request (e.g. prompt lookup, EAGLE-3); with
    neither, no speculation. `policy` picks ℓ_r."""

    def __init__(
        self,
        target,
        make_drafter: Callable[[], Drafter] | None = None,
        policy: Policy | None = None,
        max_batch: int = 8,
        max_len: int | None = None,
        draft_model=None,
        temperatures: list[float] | None = None,
    ):
        if max_batch < 1:
            raise DsparkError(f"max_batch must be >= 1, got {max_batch}")
        if draft_model is not None and make_drafter is not None:
            raise DsparkError("give either draft_model (batched) or make_drafter (per request), not both")
        self.target = target
        self.model = target.model
        self.policy = policy or ARPolicy()
        if not self.policy.drafts:  # plain AR: no drafter to run or feed
            make_drafter = draft_model = None
        self.make_drafter = make_drafter
        self.max_batch = max_batch
        # rows verify ragged lengths padded to the longest: padding K/V of a row near its limit lands in
        # HEADROOM extra cache columns (never valid), so the usable window is that much shorter
        self.max_len = min(max_len or self.model.max_positions, self.model.max_positions - HEADROOM)
        if self.max_len < 2:
            raise DsparkError(f"max_len must leave room for a prompt and a token (model positions {self.model.max_positions})")
        self.cache = self.model.new_cache(max_batch, self.max_len + HEADROOM)
        self.slots: list[_Slot | None] = [None] * max_batch
        self.waiting: list[Request] = []
        self.batch = None
        if draft_model is not None:
            from dspark.draft.batched import DSparkBatch

            self.batch = DSparkBatch(draft_model, target, max_batch, self.max_len)
            self.batch.temperatures = temperatures
        probe = self.batch or (make_drafter() if make_drafter else None)
        self.taps = tuple(probe.tap_layers) if probe else ()
        self.positions = getattr(probe, "block_size", None) or getattr(probe, "num_draft_tokens", None) or 8
        self.estimate = AcceptanceEstimate(self.positions)
        self._ids = itertools.count()
        self.steps = 0
        self.verified_tokens = 0

    # ---- requests ------------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        if not request.prompt_ids:
            raise DsparkError("the prompt is empty")
        if request.max_new_tokens < 1:
            raise DsparkError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if len(request.prompt_ids) + 2 > self.max_len:
            raise DsparkError(f"prompt of {len(request.prompt_ids)} tokens leaves no room in the {self.max_len}-token context")
        request.id = request.id or f"req-{next(self._ids)}"
        request.submitted_at = time.perf_counter()
        self.waiting.append(request)
        return request

    @property
    def active(self) -> list[int]:
        return [b for b, s in enumerate(self.slots) if s is not None]

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.active)

    def run(self, requests: list[Request]) -> list[Request]:
        for r in requests:
            self.submit(r)
        while self.has_work():
            self.step()
        return requests

    # ---- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        self._admit()
        active = self.active
        if not active:
            return
        slots = [self.slots[b] for b in active]
        budgets = [self._budget(b) for b in active]
        drafting = self.policy.should_draft(len(active))  # from past steps only
        t0 = time.perf_counter()
        if not drafting:
            blocks = [None] * len(active)
        elif self.batch is not None:
            blocks = self.batch.propose(active, [s.anchor for s in slots], budgets, [s.request.params for s in slots],
                                        [s.generator for s in slots])
        else:
            blocks = [s.drafter.propose(s.anchor, n, s.request.params, s.generator) if s.drafter and n > 0 else None
                      for s, n in zip(slots, budgets)]
        draft_s = time.perf_counter() - t0
        drafts = [blk.tokens[:n] if blk else [] for blk, n in zip(blocks, budgets)]
        lengths = self._schedule(slots, blocks, drafts)

        B, q = self.max_batch, 1 + max(lengths)
        ids = torch.zeros(B, q, dtype=torch.long)
        num_new = torch.zeros(B, dtype=torch.long)
        for b, s, d, ell in zip(active, slots, drafts, lengths):
            ids[b, : 1 + ell] = torch.tensor([s.anchor] + d[:ell])
            num_new[b] = 1 + ell
        committed = self.cache.lengths.clone()
        idle = [b for b in range(B) if self.slots[b] is None]
        self.cache.lengths[idle] = 0  # idle rows compute padding at the start of their row
        out = self.model(ids, self.cache, num_new=num_new, taps=self.taps)
        self.steps += 1
        self.verified_tokens += int(num_new.sum())

        new_lengths = committed.clone()
        new_lengths[idle] = 0
        results = []
        for i, (b, s, d, ell) in enumerate(zip(active, slots, drafts, lengths)):
            blk = blocks[i]
            target_probs = probs_from_logits(self.model.logits(out.hidden[b, : ell + 1]), s.request.params)
            draft_probs = blk.probs[None, :ell] if blk is not None and blk.probs is not None else None
            accepted, nxt = verify_chains(
                torch.tensor([d[:ell]], dtype=torch.long), draft_probs, target_probs[None], torch.tensor([ell]),
                torch.rand(1, ell + 1, generator=s.generator))
            a = int(accepted[0])
            new_lengths[b] = committed[b] + 1 + a
            results.append((a, int(nxt[0])))
        self.cache.truncate(new_lengths)
        # the forward computed B x q positions (rows padded to the longest, idle rows included)
        self.policy.record_step(len(active), drafting, B * q, sum(a + 1 for a, _ in results), draft_s)
        for i, (b, s, d, ell) in enumerate(zip(active, slots, drafts, lengths)):
            a, nxt = results[i]
            blk = blocks[i]
            if self.batch is not None:
                self.batch.observe(b, out.taps[b, : a + 1])
            elif s.drafter:
                s.drafter.observe([s.anchor] + d[:a], out.taps[b, : a + 1] if self.taps else None)
            conf = blk.confidence_logits[:ell].tolist() if blk is not None and blk.confidence_logits is not None else None
            s.request.rounds.append(RoundRecord(ell, a, conf))
            if blk is not None and blk.confidence_logits is None:
                self.estimate.update(ell, a)
            s.anchor = nxt
            self._emit(b, d[:a] + [nxt])

    def _budget(self, b: int) -> int:
        """Drafts row b may verify: the bonus token always comes on top, within both limits."""
        s = self.slots[b]
        left = s.request.max_new_tokens - len(s.checker.token_ids)
        room = min(self.max_len - int(self.cache.lengths[b]), HEADROOM) - 1
        return max(0, min(left - 1, room))

    def _schedule(self, slots, blocks, drafts) -> list[int]:
        drafted = [len(d) for d in drafts]
        survivals = []
        if self.policy.needs_survivals:
            for s, blk, n in zip(slots, blocks, drafted):
                if blk is not None and blk.confidence_logits is not None:
                    temps = self.batch.temperatures if self.batch is not None else getattr(s.drafter, "temperatures", None)
                    survivals.append(prefix_survival(blk.confidence_logits[:n].tolist(), temps))
                else:
                    survivals.append(self.estimate.survivals(n))
        else:
            survivals = [[] for _ in drafted]
        return [min(ell, n) for ell, n in zip(self.policy.lengths(survivals, drafted), drafted)]

    def _admit(self) -> None:
        for b in range(self.max_batch):
            if self.slots[b] is None and self.waiting:
                self._prefill(b, self.waiting.pop(0))

    def _prefill(self, b: int, r: Request) -> None:
        view = self.cache.row(b)
        view.lengths.zero_()
        out = self.model(torch.tensor([r.prompt_ids]), view, taps=self.taps)
        self.cache.lengths[b] = int(view.lengths[0])
        gen = new_generator(r.seed)
        probs = probs_from_logits(self.model.logits(out.hidden[0, -1:]), r.params)
        token = int(sample(probs, torch.rand(1, generator=gen))[0])
        drafter = self.make_drafter() if self.make_drafter else None
        if drafter:
            drafter.begin(r.prompt_ids)
            drafter.observe(list(r.prompt_ids), out.taps[0] if self.taps else None)
        if self.batch is not None:
            self.batch.reset(b)
            self.batch.observe(b, out.taps[0])
        decode = self.target.decode if self.target.tokenizer is not None else None
        checker = StopChecker(self.target.eos_token_ids, r.max_new_tokens, r.stop, decode)
        self.slots[b] = _Slot(r, gen, checker, drafter, token)
        r.first_token_at = time.perf_counter()
        self._emit(b, [token])

    def _emit(self, b: int, tokens: list[int]) -> None:
        s = self.slots[b]
        r = s.request
        new = s.checker.push_many(tokens)
        if new and r.on_tokens:
            r.on_tokens(new)
        if not s.checker.done and int(self.cache.lengths[b]) >= self.max_len:
            s.checker.finish_reason = "length"  # context window full: no room for the next anchor
        if s.checker.done:
            r.token_ids = s.checker.token_ids
            r.text = s.checker.text()
            r.finish_reason = s.checker.finish_reason
            r.finished_at = time.perf_counter()
            self.slots[b] = None
            self.cache.lengths[b] = 0
