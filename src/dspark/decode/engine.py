"""Batched speculative engine: continuous batching around the decode step (decode/step.py).

Requests join free slots between steps (prefilled one by one into their row of a shared KV cache)
and leave when done; each engine step is one `DecodeStep` over the active rows. All randomness is
per request, so a request's sample path never depends on which requests share its batch (only on
float numerics of batched products).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Callable

import torch

from dspark.decode.step import DecodeStep, Round, Row, draft_budget
from dspark.decode.stopping import StopChecker
from dspark.draft.base import BatchDrafter, Drafter, PerRequestDrafters
from dspark.draft.hybrid import SUFFIX, BatchLookupBranches
from dspark.errors import DsparkError
from dspark.model.target import Target
from dspark.sampling import SamplingParams, new_generator
from dspark.schedule.policies import ARPolicy, Policy

log = logging.getLogger("dspark.engine")

@dataclasses.dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 256
    params: SamplingParams = SamplingParams()
    seed: int | None = 0
    stop: tuple[str, ...] = ()
    on_tokens: Callable[[list[int]], None] | None = None
    on_finish: Callable[["Request"], None] | None = None  # called once it is done, before the next step
    generator: torch.Generator | None = None  # its random stream (default: seeded with `seed`)
    id: str = ""
    # filled in by the engine
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: Exception | None = None  # what failed it (finish reason "error")
    rounds: list[Round] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    submitted_at: float = 0.0
    first_token_at: float = 0.0
    finished_at: float = 0.0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class _Slot:
    request: Request
    row: Row
    checker: StopChecker


def check_batch(target: Target, max_batch: int) -> None:
    """Refuse batched rows where the target's mode exists for one request alone (int8: its compiled runner;
    batched rows would run the eager bf16 model)."""
    if target.model.precision == "int8" and max_batch > 1:
        raise DsparkError(f"--dtype {target.model.precision} runs one request at a time (its compiled runner); the "
                          "batched engine would run its rows in bf16: use --dtype bfloat16 (or q4), or --max-batch 1")


class Engine:
    """Continuous-batching speculative decoding over `max_batch` slots.

    Drafting: `draft_model` (a DSpark / DFlash model) drafts for all slots in one batched pass;
    otherwise `make_drafter` builds one Drafter per request (e.g. prompt lookup, EAGLE-3); with
    neither, no speculation. `lookup_branches`: the drafter's token trees also take each row's
    prompt-lookup continuation (`DRAFTER+lookup`; tree policies). `policy` picks ℓ_r (default: plain AR).
    Ragged rows' padding is never computed nor cached, so every slot may use the target's whole window.
    `prefix_cache_bytes` > 0: prompts reuse the K/V of prompt blocks prefilled before (decode/prefix_cache.py)."""

    def __init__(
        self,
        target: Target,
        make_drafter: Callable[[], Drafter] | None = None,
        policy: Policy | None = None,
        max_batch: int = 8,
        max_len: int | None = None,
        draft_model=None,
        temperatures: list[float] | None = None,
        lookup_branches: bool = False,
        prefix_cache_bytes: int = 0,
    ):
        if max_batch < 1:
            raise DsparkError(f"max_batch must be >= 1, got {max_batch}")
        if draft_model is not None and make_drafter is not None:
            raise DsparkError("give either draft_model (batched) or make_drafter (per request), not both")
        check_batch(target, max_batch)
        self.target = target
        self.model = target.model
        self.policy = policy or ARPolicy()
        self.max_batch = max_batch
        self.max_len = min(max_len or self.model.max_positions, self.model.max_positions)
        if self.max_len < 2:
            raise DsparkError(f"max_len must leave room for a prompt and a token (model positions {self.model.max_positions})")
        self.cache = self.model.new_cache(max_batch, self.max_len)
        self.slots: list[_Slot | None] = [None] * max_batch
        self.waiting: list[Request] = []
        drafter: BatchDrafter | None = None
        if self.policy.drafts and draft_model is not None:
            from dspark.draft.batched import BatchedDSparkDrafter

            drafter = BatchedDSparkDrafter(draft_model, target, max_batch, self.max_len, temperatures)
        elif self.policy.drafts and make_drafter is not None:
            drafter = PerRequestDrafters(make_drafter)
        if drafter is not None and lookup_branches:
            if not self.policy.tree_nodes:
                raise DsparkError(f"`{SUFFIX}` adds prompt-lookup branches to token trees: verify them with the tree "
                                  f"policy (@tree or @tree:N), not {self.policy.name}")
            drafter = BatchLookupBranches(drafter)
        self.decode_step = DecodeStep(self.model, drafter, self.policy, prefix_cache_bytes)
        self._ids = itertools.count()

    @property
    def drafter(self) -> BatchDrafter | None:
        return self.decode_step.drafter

    @property
    def steps(self) -> int:
        return self.decode_step.steps

    # ---- requests ------------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        if not request.prompt_ids:
            raise DsparkError("the prompt is empty")
        if request.max_new_tokens < 1:
            raise DsparkError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if len(request.prompt_ids) > self.max_prompt_len:
            raise DsparkError(f"prompt of {len(request.prompt_ids)} tokens leaves no room in the {self.max_len}-token context")
        request.id = request.id or f"req-{next(self._ids)}"
        request.submitted_at = time.perf_counter()
        self.waiting.append(request)
        return request

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt a request may bring: room must remain for its first tokens."""
        return self.max_len - 2

    @property
    def active(self) -> list[int]:
        return [b for b, s in enumerate(self.slots) if s is not None]

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.active)

    @torch.inference_mode()
    def cancel(self, request: Request) -> bool:
        """Drop a waiting or running request (finish reason "abort"); its cache row is free for the
        next step. False when it had already finished or was never submitted."""
        if request.done:
            return False
        for s in self.slots:
            if s is not None and s.request is request:
                s.checker.finish_reason = "abort"
                self._finish(s)
                return True
        if not any(r is request for r in self.waiting):
            return False
        self.waiting = [r for r in self.waiting if r is not request]
        request.finish_reason = "abort"
        request.finished_at = time.perf_counter()
        self._notify(request)
        return True

    def run(self, requests: list[Request]) -> list[Request]:
        """Decode `requests` to the end; a request that fails raises its error here."""
        for r in requests:
            self.submit(r)
        while self.has_work():
            self.step()
            failed = next((r for r in requests if r.error is not None), None)
            if failed is not None:
                raise failed.error
        return requests

    # ---- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        """Admit waiting requests, then one decode step over the rows. A failure while handling one
        request (its prefill, its tokens) fails that request alone; a failure of the batched forward
        fails the requests of that step; either way the engine goes on with the rest."""
        self._admit()
        active = [s for s in self.slots if s is not None]
        if not active:
            return
        for s in active:
            s.row.budget = self._budget(s)
        try:
            results = self.decode_step(self.cache, [s.row for s in active])
        except Exception as e:
            log.exception("a decode step over %d requests failed; failing them", len(active))
            for s in active:
                self._fail(s.request, s.row.index, e)
            return
        for s, result in zip(active, results):
            try:
                s.request.rounds.append(result.round)
                s.row.anchor = result.tokens[-1]
                self._emit(s, result.tokens)
            except Exception as e:
                log.exception("request %s failed", s.request.id)
                self._fail(s.request, s.row.index, e)

    def _budget(self, s: _Slot) -> int:
        room = self.max_len - int(self.cache.lengths[s.row.index])
        return draft_budget(s.request.max_new_tokens - len(s.checker.token_ids), room)

    def _admit(self) -> None:
        for b in range(self.max_batch):
            if self.slots[b] is None and self.waiting:
                r = self.waiting.pop(0)
                try:
                    self._prefill(b, r)
                except Exception as e:
                    log.exception("request %s failed in its prefill", r.id)
                    self._fail(r, b, e)

    def _prefill(self, b: int, r: Request) -> None:
        row = self.decode_step.start(self.cache, b, r.prompt_ids, r.params, r.generator or new_generator(r.seed))
        decode = self.target.decode if self.target.tokenizer is not None else None
        slot = _Slot(r, row, StopChecker(self.target.eos_token_ids, r.max_new_tokens, r.stop, decode))
        self.slots[b] = slot
        r.cached_tokens = row.cached
        r.first_token_at = time.perf_counter()
        self._emit(slot, [row.anchor])

    def _emit(self, s: _Slot, tokens: list[int]) -> None:
        r, b = s.request, s.row.index
        new = s.checker.push_many(tokens)
        if new and r.on_tokens:
            r.on_tokens(new)
        if not s.checker.done and int(self.cache.lengths[b]) >= self.max_len:
            s.checker.finish_reason = "length"  # context window full: no room for the next anchor
        if s.checker.done:
            self._finish(s)

    def _fail(self, r: Request, row: int, error: Exception) -> None:
        """End `r` with finish reason "error" (its `error` says why) and free its row."""
        slot = self.slots[row]
        if slot is not None and slot.request is r:
            r.token_ids = slot.checker.token_ids
            self.slots[row] = None
        self.cache.lengths[row] = 0
        r.error, r.finish_reason, r.finished_at = error, "error", time.perf_counter()
        self._notify(r)

    @staticmethod
    def _notify(r: Request) -> None:
        if r.on_finish:
            try:
                r.on_finish(r)
            except Exception:
                log.exception("request %s: its on_finish callback failed", r.id)

    def _finish(self, s: _Slot) -> None:
        r, b = s.request, s.row.index
        r.token_ids = s.checker.token_ids
        r.text = s.checker.text()
        r.finish_reason = s.checker.finish_reason
        r.finished_at = time.perf_counter()
        self.slots[b] = None
        self.cache.lengths[b] = 0
        self._notify(r)
