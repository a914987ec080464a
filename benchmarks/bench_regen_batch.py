"""The regeneration workload's engine step: how its batch size and the attention of one-token rows
(the ragged decode kernel, or SDPA: one boolean-masked call over the longest row's keys, or a row at a
time over each row's own) set its throughput.

The workload is `dspark data regenerate`'s own: the training prompts in `--shuffle 0` order (a slice
past the committed store's), T = 0.7 / top-p 0.95, up to 256 new tokens, finished rows replaced by
waiting prompts; the embedded SmolLM2 in the precision `--dtype auto` picks. Each arm starts a fresh
engine on the same prompts and times `--steps` engine steps (prefills included); arms alternate
over `--rounds`, medians reported. Attention modes: `kernel` (model/decode_attention.py, the default
where it builds), and with it switched off SDPA `masked` (PER_ROW_SPREAD = inf), `per-row`
(PER_ROW_SPREAD = 0), `auto` (the shipped rule).

    python benchmarks/bench_regen_batch.py --out benchmarks/results/regen_batch.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from dspark.decode.engine import Engine, Request
from dspark.model import transformer
from dspark.model.attention import PER_ROW_SPREAD
from dspark.model.loading import load_target
from dspark.sampling import SamplingParams
from dspark.schedule.policies import ARPolicy
from dspark.train.data import select_prompts
from dspark.util.platform import cpu_flags
from dspark.util.seeding import derived_generator

ROOT = Path(__file__).resolve().parents[1]
SPREADS = {"masked": float("inf"), "per-row": 0, "auto": PER_ROW_SPREAD, "kernel": PER_ROW_SPREAD}


def workload(target, first: int, count: int) -> list[tuple[str, list[int]]]:
    prompts = select_prompts([ROOT / "data/train/prompts.jsonl"], shuffle=0, limit=first + count,
                             skip_validation_fraction=0.02)[first:]
    return [(p.id, ids) for p in prompts if len(ids := target.encode_prompt(p.text)) <= 1024]


def run_arm(target, prompts, batch: int, mode: str, steps: int) -> dict:
    transformer.PER_ROW_SPREAD = SPREADS[mode]
    os.environ["DSPARK_DECODE_KERNEL"] = "1" if mode == "kernel" else "0"
    engine = Engine(target, policy=ARPolicy(), max_batch=batch, max_len=1024 + 257)
    params = SamplingParams(temperature=0.7, top_p=0.95)
    for pid, ids in prompts:
        engine.submit(Request(ids, 256, params, generator=derived_generator(0, pid), id=pid))
    tokens = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        before = {id(s): len(s.checker.token_ids) for s in engine.slots if s}
        engine.step()
        tokens += sum(len(s.checker.token_ids) - before[id(s)] for s in engine.slots if s and id(s) in before)
    seconds = time.perf_counter() - t0
    return {"ms_per_step": 1000 * seconds / steps, "tok_per_s_running_rows": tokens / seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="32,64", help="engine rows, comma-separated")
    ap.add_argument("--modes", default="masked,per-row,auto,kernel", help=f"attention modes: {', '.join(SPREADS)}")
    ap.add_argument("--steps", type=int, default=300, help="engine steps timed per arm")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--first", type=int, default=44000, help="first prompt of the slice (--shuffle 0 order)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = load_target(None)
    batches, modes = [int(b) for b in args.batches.split(",")], args.modes.split(",")
    prompts = workload(target, args.first, 3 * max(batches))
    results: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for batch in batches:
            for mode in modes:
                results.setdefault(f"{batch} rows, {mode}", []).append(
                    run_arm(target, prompts, batch, mode, args.steps))
    rows = {arm: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for arm, runs in results.items()}
    report = {"command": "python benchmarks/bench_regen_batch.py " + " ".join(sys.argv[1:]),
              "machine": {"flags": cpu_flags(), "threads": 2, "precision": target.model.precision},
              "steps": args.steps, "rounds": args.rounds, "arms": rows}
    for arm, r in rows.items():
        print(f"{arm:>22}: {r['ms_per_step']:6.1f} ms a step, {r['tok_per_s_running_rows']:6.1f} tok/s")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
