"""Regeneration: the target answers training prompts, so the drafter learns the target's own
distribution (DESIGN.md §4).

It runs on the batched engine with the plain AR policy: `batch_size` requests decode together and
a finished one is written out at once while the next prompt takes its slot (continuous batching).
Every prompt samples from its own generator (seeded by run seed + prompt id), so a reply does not
depend on its batch neighbours, and a resumed run skips the ids already written.

Output: a JSONL file (`*.jsonl`, one reply a line with its text) or a directory holding a
`ShardStore` (token ids in sealed shards, for large sets; `dspark.train.shards`).
"""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.decode.engine import Engine, Request
from dspark.errors import DsparkError
from dspark.model.loading import dtype_key
from dspark.model.target import Target
from dspark.sampling import SamplingParams
from dspark.schedule.policies import ARPolicy
from dspark.train.data import Prompt
from dspark.train.shards import ShardStore
from dspark.util.journal import read_records
from dspark.util.platform import cpu_flags
from dspark.util.seeding import derived_generator


class JsonlSink:
    """Appends one JSON line per reply (with its text); a torn last line (killed mid-write) is cut off."""

    def __init__(self, path: Path, decode):
        self.path, self.decode = path, decode
        path.parent.mkdir(parents=True, exist_ok=True)
        records, bad_line = read_records(path, cut=True)
        if bad_line is not None or not all(isinstance(r, dict) and "id" in r for r in records):
            raise DsparkError(f"{path}:{bad_line or '?'}: not a regeneration record; fix or move the file")
        self.done = {str(r["id"]) for r in records}
        self.file = open(path, "a", encoding="utf-8")

    def done_ids(self) -> set[str]:
        return self.done

    def add(self, record: dict) -> None:
        self.file.write(json.dumps({**record, "response": self.decode(record["response_ids"])},
                                   ensure_ascii=False) + "\n")
        self.file.flush()

    def progress(self, run: dict) -> None:
        pass

    def close(self, run: dict) -> None:
        os.fsync(self.file.fileno())
        self.file.close()


class StoreSink:
    """Replies into a `ShardStore`; the remainder is sealed when every prompt is answered."""

    def __init__(self, store: ShardStore):
        self.store = store
        self.sealed = self.sealed_at_start = len(store.manifest["shards"])
        self.run_index = len(store.manifest["runs"])  # this run's entry in the manifest

    def done_ids(self) -> set[str]:
        return self.store.done_ids()

    def add(self, record: dict) -> None:
        self.store.add(record)

    def progress(self, run: dict) -> None:
        """The run's throughput goes into the manifest with every shard it seals."""
        if len(self.store.manifest["shards"]) != self.sealed:
            self.sealed = len(self.store.manifest["shards"])
            self.store.log_run(self.run_index, run)

    def close(self, run: dict) -> None:
        if run["complete"]:
            self.store.seal()
        if run["prompts_done"] or len(self.store.manifest["shards"]) != self.sealed_at_start:
            self.store.log_run(self.run_index, run)  # a resume that found nothing to do leaves no trace


def regeneration_settings(target: Target, params: SamplingParams, max_new_tokens: int, seed: int,
                          max_prompt_tokens: int) -> dict:
    """What a store's replies must share: appending replies made otherwise is refused. (The dtype
    may differ between runs, so that a store grows on CPUs with and without bf16 units; each run
    records its own.)"""
    return {"target": target.path.name, "vocab_size": target.cfg.vocab_size, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "seed": seed,
            "max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens}


def open_sink(target: Target, out_path: str | Path, settings: dict, shard_size: int = 1024):
    out_path = Path(out_path).expanduser()
    if out_path.suffix == ".jsonl":
        return JsonlSink(out_path, target.decode)
    return StoreSink(ShardStore(out_path, settings, shard_size))


def regenerate(
    target: Target,
    prompts: list[Prompt],
    out_path: str | Path,
    params: SamplingParams,
    max_new_tokens: int = 512,
    batch_size: int = 16,
    seed: int = 0,
    max_prompt_tokens: int = 1024,
    progress: bool = True,
    shard_size: int = 1024,
) -> dict:
    """Answer every prompt not yet in `out_path` (a `.jsonl` file or a shard-store directory).

    Record: {"id", "prompt_ids", "response_ids", "finish_reason"} (JSONL lines add "response", the
    text). Returns run stats."""
    if batch_size < 1 or max_new_tokens < 1:
        raise DsparkError("batch size and max new tokens must be >= 1")
    if target.tokenizer is None:
        raise DsparkError("regeneration needs the target's tokenizer (chat template)")
    sink = open_sink(target, out_path, regeneration_settings(target, params, max_new_tokens, seed, max_prompt_tokens),
                     shard_size)
    done = sink.done_ids()
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
    run = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "dtype": dtype_key(target.model), "cpu_flags": cpu_flags(), "threads": torch.get_num_threads(),
           "batch_size": batch_size}

    def stats(complete: bool) -> dict:
        elapsed = time.perf_counter() - t0
        return {**run, "prompts_done": written["prompts"], "skipped_finished": len(done),
                "skipped_too_long": too_long, "new_tokens": written["tokens"], "seconds": round(elapsed, 1),
                "tokens_per_s": round(written["tokens"] / elapsed, 1) if elapsed > 0 else 0.0, "complete": complete}

    def write(r: Request) -> None:
        sink.add({"id": r.id, "prompt_ids": r.prompt_ids, "response_ids": r.token_ids,
                  "finish_reason": r.finish_reason})
        written["prompts"] += 1
        written["tokens"] += len(r.token_ids)
        sink.progress(stats(False))
        bar.update(1)
        bar.set_postfix(tok_s=f"{written['tokens'] / (time.perf_counter() - t0):.0f}")

    for p, ids in queue:
        engine.submit(Request(ids, max_new_tokens, params, generator=derived_generator(seed, p.id), id=p.id,
                              on_finish=write))
    complete = False
    try:
        while engine.has_work():
            engine.step()
        complete = True
    finally:
        result = stats(complete)
        sink.close(result)
        bar.close()
    return result
