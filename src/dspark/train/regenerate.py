"""Regeneration: the target answers training prompts, so the drafter learns the target's own
distribution (DESIGN.md §4).

It runs on the batched engine with the plain AR policy: `batch_size` requests decode together and
a finished one is written out at once while the next prompt takes its slot (continuous batching).
Every prompt samples from its own generator (seeded by run seed + prompt id), so a reply does not
depend on its batch neighbours, and a resumed run skips the ids already in the output file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tqdm import tqdm

from dspark.decode.sampling import SamplingParams
from dspark.errors import DsparkError
from dspark.schedule.policies import ARPolicy
from dspark.serve.engine import Engine, Request
from dspark.train.data import Prompt
from dspark.util.journal import read_records
from dspark.util.seeding import derived_generator


def finished_ids(out_path: Path) -> set[str]:
    """Ids already written; a torn last line (killed mid-write) is cut off so appending stays valid."""
    records, bad_line = read_records(out_path, cut=True)
    if bad_line is not None or not all(isinstance(r, dict) and "id" in r for r in records):
        raise DsparkError(f"{out_path}:{bad_line or '?'}: not a regeneration record; fix or move the file")
    return {str(r["id"]) for r in records}


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
        if p.id not in done:
            ids = target.encode_prompt(p.text)
            if len(ids) > max_prompt_tokens:
                too_long += 1
            else:
                queue.append((p, ids))
    max_len = min(target.model.max_positions, max_prompt_tokens + max_new_tokens + 1)
    engine = Engine(target, policy=ARPolicy(), max_batch=min(batch_size, max(len(queue), 1)), max_len=max_len)
    written = {"prompts": 0, "tokens": 0}
    t0 = time.perf_counter()
    bar = tqdm(total=len(queue), desc="regenerating", unit="prompt", disable=not progress)
    with open(out_path, "a", encoding="utf-8") as f:

        def write(r: Request) -> None:
            f.write(json.dumps({"id": r.id, "prompt_ids": r.prompt_ids, "response_ids": r.token_ids,
                                "response": r.text, "finish_reason": r.finish_reason}, ensure_ascii=False) + "\n")
            f.flush()
            written["prompts"] += 1
            written["tokens"] += len(r.token_ids)
            bar.update(1)
            bar.set_postfix(tok_s=f"{written['tokens'] / (time.perf_counter() - t0):.0f}")

        for p, ids in queue:
            engine.submit(Request(ids, max_new_tokens, params, generator=derived_generator(seed, p.id), id=p.id,
                                  on_finish=write))
        while engine.has_work():
            engine.step()
        os.fsync(f.fileno())
    bar.close()
    elapsed = time.perf_counter() - t0
    return {
        "prompts_done": written["prompts"],
        "skipped_finished": len(done),
        "skipped_too_long": too_long,
        "new_tokens": written["tokens"],
        "seconds": elapsed,
        "tokens_per_s": written["tokens"] / elapsed if elapsed > 0 else 0.0,
    }
