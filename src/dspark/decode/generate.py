"""Single-request decoding on the lean runner: speculative (with any Drafter) or plain autoregressive.

Plain AR is the same loop with no drafter (every round verifies zero drafts), so both share
prefill, sampling, stopping and timing, and any difference between them is the drafting.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable

import torch

from dspark.decode.sampling import SamplingParams, new_generator, probs_from_logits, sample
from dspark.decode.stopping import StopChecker
from dspark.decode.verify import verify_chains
from dspark.draft.base import Drafter
from dspark.errors import DsparkError
from dspark.target.loading import Target


@dataclasses.dataclass
class RoundRecord:
    drafted: int  # draft tokens verified this round
    accepted: int  # of which accepted
    confidence_logits: list[float] | None = None


@dataclasses.dataclass
class GenerationStats:
    new_tokens: int
    rounds: int  # target forwards after prefill
    tau: float  # tokens committed per round, bonus/replacement included
    prefill_s: float
    decode_s: float
    decode_tok_s: float  # tokens produced by decode rounds / decode wall time

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    stats: GenerationStats
    rounds: list[RoundRecord]


class Decoder:
    """Generates for one request at a time with `target`, drafting with `drafter` (None = plain AR)."""

    def __init__(self, target: Target, drafter: Drafter | None = None):
        self.target = target
        self.drafter = drafter
        taps = drafter.tap_layers if drafter else ()
        bad = [t for t in taps if not -1 <= t < target.cfg.num_hidden_layers]  # -1: the embedding output
        if bad:
            raise DsparkError(f"drafter taps layers {bad}, but the target has {target.cfg.num_hidden_layers} layers")
        self.taps = tuple(taps)

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
        model, drafter = self.target.model, self.drafter
        max_len = min(model.max_positions, len(prompt_ids) + max_new_tokens + 1)
        if len(prompt_ids) + 1 > max_len:
            raise DsparkError(f"prompt of {len(prompt_ids)} tokens leaves no room in the {model.max_positions}-token context")
        gen = new_generator(seed)
        decode = self.target.decode if self.target.tokenizer is not None else None
        checker = StopChecker(self.target.eos_token_ids, max_new_tokens, stop, decode)
        emit = on_tokens or (lambda ids: None)
        cache = model.new_cache(1, max_len)

        t0 = time.perf_counter()
        out = model(torch.tensor([prompt_ids]), cache, taps=self.taps)
        probs = probs_from_logits(model.logits(out.hidden[0, -1:]), params)
        token = int(sample(probs, torch.rand(1, generator=gen))[0])
        if drafter:
            drafter.begin(prompt_ids)
            drafter.observe(list(prompt_ids), out.taps[0] if self.taps else None)
        prefill_s = time.perf_counter() - t0
        checker.push(token)
        emit([token])

        records: list[RoundRecord] = []
        t1 = time.perf_counter()
        while not checker.done:
            committed = int(cache.lengths[0])
            if committed >= max_len:  # context window full
                checker.finish_reason = "length"
                break
            # the bonus token always comes on top of the drafts, so leave room for it
            budget = min(max_new_tokens - len(checker.token_ids), max_len - committed) - 1
            block = drafter.propose(token, budget, params, gen) if drafter and budget > 0 else None
            drafts = block.tokens[:budget] if block else []
            n_draft = len(drafts)
            out = model(torch.tensor([[token] + drafts]), cache, taps=self.taps)
            target_probs = probs_from_logits(model.logits(out.hidden[0]), params)
            draft_probs = block.probs[None, :n_draft] if block is not None and block.probs is not None else None
            accepted, nxt = verify_chains(
                torch.tensor([drafts], dtype=torch.long),
                draft_probs,
                target_probs[None],
                torch.tensor([n_draft]),
                torch.rand(1, n_draft + 1, generator=gen),
            )
            a = int(accepted[0])
            cache.truncate(committed + 1 + a)
            if drafter:
                drafter.observe([token] + drafts[:a], out.taps[0, : a + 1] if self.taps else None)
            conf = block.confidence_logits if block is not None else None
            records.append(RoundRecord(n_draft, a, None if conf is None else conf[:n_draft].tolist()))
            token = int(nxt[0])
            emit(checker.push_many(drafts[:a] + [token]))
        decode_s = time.perf_counter() - t1

        n_new = len(checker.token_ids)
        stats = GenerationStats(
            new_tokens=n_new,
            rounds=len(records),
            tau=(n_new - 1) / len(records) if records else 0.0,
            prefill_s=prefill_s,
            decode_s=decode_s,
            decode_tok_s=(n_new - 1) / decode_s if records else 0.0,
        )
        return GenerationResult(checker.token_ids, checker.text(), checker.finish_reason, stats, records)
