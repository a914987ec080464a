"""Single-request decoding: the decode step (decode/step.py) with one row, speculative (any Drafter
and verification policy) or plain autoregressive.

Plain AR is the same step with no drafter (every round verifies zero drafts), so both share
prefill, sampling, stopping and timing, and any difference between them is the drafting.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable

from dspark.decode.step import DecodeStep, Round, draft_budget, drafts_per_round
from dspark.decode.stopping import StopChecker
from dspark.draft.base import Drafter, PerRequestDrafters
from dspark.errors import DsparkError
from dspark.model.compiled import ROWS
from dspark.model.target import Target
from dspark.sampling import SamplingParams, new_generator
from dspark.schedule.policies import ARPolicy, Policy, VerifyAllPolicy


@dataclasses.dataclass
class GenerationStats:
    new_tokens: int
    rounds: int  # target forwards after prefill
    tau: float  # tokens committed per round, bonus/replacement included
    drafts_per_round: float  # draft tokens the target verified per round (a tree's nodes)
    prefill_s: float
    decode_s: float
    decode_tok_s: float  # tokens produced by decode rounds / decode wall time
    draft_s: float = 0.0  # of decode_s: drafting passes
    verify_s: float = 0.0  # of decode_s: verify forwards, rejection sampling and commits

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    stats: GenerationStats
    rounds: list[Round]


class Decoder:
    """Generates for one request at a time with `target`, drafting with `drafter` (None = plain AR)
    and verifying what `policy` chooses (default: every draft). The policy starts afresh for each
    request, so a request's output depends on that request alone."""

    def __init__(self, target: Target, drafter: Drafter | None = None, policy: Policy | None = None):
        self.target = target
        self.drafter = drafter
        self.policy = policy or (VerifyAllPolicy() if drafter else ARPolicy())
        taps = drafter.tap_layers if drafter else ()
        bad = [t for t in taps if not -1 <= t < target.cfg.num_hidden_layers]  # -1: the embedding output
        if bad:
            raise DsparkError(f"drafter taps layers {bad}, but the target has {target.cfg.num_hidden_layers} layers")
        limit = target.model.verify_limit  # the tokens a forward verifies exactly in this mode: no more
        if limit is not None and self.policy.tree_nodes >= limit:
            raise DsparkError(f"a tree of {self.policy.tree_nodes} drafts needs {self.policy.tree_nodes + 1}-token forwards, "
                              f"and this target verifies at most {limit} tokens a forward exactly in {target.model.precision}")
        self.most_drafts = limit - 1 if limit is not None else None
        self.step = DecodeStep(target.model, PerRequestDrafters(lambda: drafter) if drafter else None, self.policy)

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),
        seed: int | None = None,
        stop: Iterable[str] = (),
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult:
        if not prompt_ids:
            raise DsparkError("the prompt is empty")
        if max_new_tokens < 1:
            raise DsparkError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        model = self.target.model
        max_len = min(model.max_positions, len(prompt_ids) + max_new_tokens + 1)
        if len(prompt_ids) + 1 > max_len:
            raise DsparkError(f"prompt of {len(prompt_ids)} tokens leaves no room in the {model.max_positions}-token context")
        decode = self.target.decode if self.target.tokenizer is not None else None
        checker = StopChecker(self.target.eos_token_ids, max_new_tokens, stop, decode)
        emit = on_tokens or (lambda ids: None)
        cache = model.new_cache(1, max_len + tree_room(self.policy))
        self.policy.reset()

        t0 = time.perf_counter()
        row = self.step.start(cache, 0, list(prompt_ids), params, new_generator(seed))
        prefill_s = time.perf_counter() - t0
        checker.push(row.anchor)
        emit([row.anchor])

        rounds: list[Round] = []
        spent = (self.step.draft_s, self.step.verify_s)
        t1 = time.perf_counter()
        while not checker.done:
            committed = int(cache.lengths[0])
            if committed >= max_len:  # context window full
                checker.finish_reason = "length"
                break
            row.budget = draft_budget(max_new_tokens - len(checker.token_ids), max_len - committed)
            if self.most_drafts is not None:
                row.budget = min(row.budget, self.most_drafts)
            result = self.step(cache, [row])[0]
            rounds.append(result.round)
            row.anchor = result.tokens[-1]
            emit(checker.push_many(result.tokens))
        decode_s = time.perf_counter() - t1

        n_new = len(checker.token_ids)
        stats = GenerationStats(
            new_tokens=n_new,
            rounds=len(rounds),
            tau=(n_new - 1) / len(rounds) if rounds else 0.0,
            drafts_per_round=drafts_per_round(rounds),
            prefill_s=prefill_s,
            decode_s=decode_s,
            decode_tok_s=(n_new - 1) / decode_s if rounds else 0.0,
            draft_s=self.step.draft_s - spent[0],
            verify_s=self.step.verify_s - spent[1],
        )
        return GenerationResult(checker.token_ids, checker.text(), checker.finish_reason, stats, rounds)


def tree_room(policy: Policy) -> int:
    """Cache positions past a request's window where a tree's drafts sit: the policy's tree, and at least a
    tree the compiled runner verifies (ROWS - 1 drafts) for every policy, trees or none. The compiled
    runner attends over the whole cache and its attention sums depend on that width, so plain and
    speculative decoding of a request must get the same one for its verify invariance (model/compiled.py):
    with a policy's own room, `@tree`'s 8 more positions moved logits and greedy output on an AVX512-BF16
    EPYC (4 of 12 prompts differed from plain decoding)."""
    return max(policy.tree_nodes, ROWS - 1)
