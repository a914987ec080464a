"""Regeneration: the target answers training prompts, so the drafter learns the target's own
distribution (DESIGN.md §4).

Continuous batching on the lean runner: `batch_size` rows decode together, one token per step;
a finished row is written out at once and its slot refilled with the next prompt. Every prompt
samples from its own generator (seeded by run seed + prompt id), so a reply does not depend on
its batch neighbours, and a resumed run skips the ids already in the output file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.decode.sampling import SamplingParams, probs_from_logits, sample
from dspark.errors import DsparkError
from dspark.train.data import Prompt
from dspark.util.seeding import derived_generator


def _prompt_generator(seed: int, prompt_id: str) -> torch.Generator:
    return derived_generator(seed, prompt_id)


def finished_ids(out_path: Path) -> set[str]:
    """Ids already written; a torn last line (killed mid-write) is cut off so appending stays valid."""
    if not out_path.exists():
        return set()
    done, good_bytes = set(), 0
    with open(out_path, "rb") as f:
        for raw in f:
            try:
                if not raw.endswith(b"\n"):
                    raise ValueError("torn line")
                done.add(str(json.loads(raw)["id"]))
            except (ValueError, KeyError):
                break
            good_bytes += len(raw)
    if good_bytes != out_path.stat().st_size:
        with open(out_path, "r+b") as f:
            f.truncate(good_bytes)
    return done


@torch.inference_mode()
def regenerate(
    target,
    prompts: list[Prompt],
    out_path: str | Path,
    params: SamplingParams,
    max_new_tokens: int = 512,
    batch_size: int = 16,
    seed: int = 0,
    max_prompt_tokens: int = 1024,
    progress: bool = True,
) -> dict:
    """Write one JSON line per prompt to `out_path` (appending; finished ids are skipped).

    Line: {"id", "prompt_ids", "response_ids", "response", "finish_reason"}. Returns run stats."""
    if batch_size < 1 or max_new_tokens < 1:
        raise DsparkError("batch size and max new tokens must be >= 1")
    if target.tokenizer is None:
        raise DsparkError("regeneration needs the target's tokenizer (chat template)")
    out_path = Path(out_path).expanduser()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = finished_ids(out_path)
    queue, too_long = [], 0
    for p in prompts:
        if p.id in done:
            continue
        ids = target.encode_prompt(p.text)
        if len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        queue.append((p, ids))
    queue.reverse()  # pop() from the end keeps file order
    model = target.model
    eos = target.eos_token_ids
    max_len = min(model.max_positions, max_prompt_tokens + max_new_tokens + 1)
    B = min(batch_size, max(len(queue), 1))
    cache = model.new_cache(B, max_len)
    rows: list[dict | None] = [None] * B
    next_tokens = torch.zeros(B, 1, dtype=torch.long)
    new_tokens = prompts_done = 0
    t0 = time.perf_counter()
    bar = tqdm(total=len(queue), desc="regenerating", unit="prompt", disable=not progress)

    def first_token(b: int, prompt: Prompt, ids: list[int]) -> None:
        view = cache.row(b)
        out = model(torch.tensor([ids]), view)
        cache.lengths[b] = int(view.lengths[0])
        gen = _prompt_generator(seed, prompt.id)
        probs = probs_from_logits(model.logits(out.hidden[0, -1:]), params)
        tok = int(sample(probs, torch.rand(1, generator=gen))[0])
        rows[b] = {"prompt": prompt, "ids": ids, "gen": gen, "out": [tok]}
        next_tokens[b, 0] = tok

    with open(out_path, "a", encoding="utf-8") as f:

        def finish_row(b: int, reason: str) -> None:
            nonlocal new_tokens, prompts_done
            r = rows[b]
            line = {
                "id": r["prompt"].id,
                "prompt_ids": r["ids"],
                "response_ids": r["out"],
                "response": target.decode(r["out"]),
                "finish_reason": reason,
            }
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
            f.flush()
            new_tokens += len(r["out"])
            prompts_done += 1
            rows[b] = None
            cache.lengths[b] = 0
            bar.update(1)
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")

        while True:
            for b in range(B):  # retire finished rows, refill free slots
                r = rows[b]
                if r is not None:
                    if r["out"][-1] in eos:
                        finish_row(b, "stop")
                    elif len(r["out"]) >= max_new_tokens or int(cache.lengths[b]) + 1 >= max_len:
                        finish_row(b, "length")
                while rows[b] is None and queue:
                    first_token(b, *queue.pop())
                    if rows[b]["out"][-1] in eos or max_new_tokens == 1:
                        finish_row(b, "stop" if rows[b]["out"][-1] in eos else "length")
            active = [b for b in range(B) if rows[b] is not None]
            if not active:
                break
            out = model(next_tokens, cache)  # idle rows decode padding at length 0
            for b in range(B):
                if rows[b] is None:
                    cache.lengths[b] = 0
            probs = probs_from_logits(model.logits(out.hidden[:, -1]), params)
            uniforms = torch.stack([torch.rand((), generator=rows[b]["gen"]) if rows[b] else torch.zeros(())
                                    for b in range(B)])
            toks = sample(probs, uniforms)
            for b in active:
                tok = int(toks[b])
                rows[b]["out"].append(tok)
                next_tokens[b, 0] = tok
        os.fsync(f.fileno())
    bar.close()
    elapsed = time.perf_counter() - t0
    return {
        "prompts_done": prompts_done,
        "skipped_finished": len(done),
        "skipped_too_long": too_long,
        "new_tokens": new_tokens,
        "seconds": elapsed,
        "tokens_per_s": new_tokens / elapsed if elapsed > 0 else 0.0,
    }
