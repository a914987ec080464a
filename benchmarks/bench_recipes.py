"""Equal wall-clock distillation (issue 20 (c)): today's recipe (the shipped drafter's of 2026-11-29:
smollm2.jsonl, 16 anchors per sequence, the full vocabulary) against the new one (every anchor, a K-token draft
vocabulary), `--minutes` of training each on the same data, then the validation expected τ of
both final drafters measured the same way (every anchor of the same validation replies).

The two runs take turns in chunks of `--chunk-minutes` (order rotated each round), so that machine
drift hits both alike. Each run's step count is set from its measured seconds per step so that its
cosine schedule ends with its budget. Runs checkpoint after every chunk under --work; a rerun
resumes them (on the same kind of machine: the figure is only meaningful within one). Results:
<out>.json.

    .venv/bin/python benchmarks/bench_recipes.py --minutes 60 --out benchmarks/results/recipes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from dspark.train.config import load_config
from dspark.train.trainer import Trainer
from dspark.util.cache import cache_root
from dspark.util.platform import cpu_flags

ROOT = Path(__file__).resolve().parents[1]


def recipes(k: int) -> dict:
    today = load_config(ROOT / "configs" / "dspark-smollm2.toml")  # its shape, losses and optimiser; the data of 11-29
    today = dataclasses.replace(today, data=str(ROOT / "data" / "regen" / "smollm2.jsonl"), val_data="", threads=2,
                                eval_every=10**9, checkpoint_every=10**9, anchors_per_seq=16, draft_vocab_size=0)
    return {"today": today, "new": dataclasses.replace(today, anchors_per_seq="all", draft_vocab_size=k)}


def state_path(work: Path) -> Path:
    return work / "state.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0, help="training wall-clock per recipe")
    ap.add_argument("--chunk-minutes", type=float, default=5.0)
    ap.add_argument("--k", type=int, default=8192, help="draft vocabulary of the new recipe")
    ap.add_argument("--calibration-steps", type=int, default=24,
                    help="steps that measure seconds per step (batches are grouped by length: short probes "
                    "underestimate; the 30-minute pilot's 4 steps planned 1.5-1.7x too many)")
    ap.add_argument("--work", default=str(cache_root() / "bench-recipes"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "recipes"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    state = json.loads(state_path(work).read_text()) if state_path(work).is_file() else {}
    settings = {"minutes": args.minutes, "k": args.k, "flags": cpu_flags()}
    if state and state.get("settings") != settings:
        raise SystemExit(f"{work} holds runs made with {state.get('settings')}; pass another --work or delete it")
    state.setdefault("settings", settings)
    runs = state.setdefault("runs", {})
    cfgs = recipes(args.k)
    budget = args.minutes * 60
    for name, cfg in cfgs.items():  # seconds per step, measured once, sets each run's schedule length
        if name not in runs:
            probe = Trainer(dataclasses.replace(cfg, out=str(work / f"probe-{name}")), progress=False)
            probe.train_step()  # warm-up
            t0 = time.perf_counter()
            for _ in range(args.calibration_steps):
                probe.train_step()
            per_step = (time.perf_counter() - t0) / args.calibration_steps
            runs[name] = {"seconds_per_step": per_step, "steps": max(10, int(budget / per_step)), "trained_s": 0.0}
            state_path(work).write_text(json.dumps(state, indent=1))
    rnd, trainers = 0, {}
    while any(r["trained_s"] < budget for r in runs.values()):
        for name in list(cfgs)[rnd % 2 :] + list(cfgs)[: rnd % 2]:
            run = runs[name]
            if run["trained_s"] >= budget:
                continue
            cfg = dataclasses.replace(cfgs[name], out=str(work / name), steps=run["steps"])
            if name not in trainers:  # once per process; a rerun resumes from the last chunk's checkpoint
                trainers[name] = Trainer(cfg, resume=(work / name / "checkpoint").is_dir(), progress=False)
            trainer = trainers[name]
            end = min(budget, run["trained_s"] + args.chunk_minutes * 60)
            while run["trained_s"] < end and trainer.step < cfg.steps:
                run["trained_s"] += trainer.train_step()["seconds"]
            if trainer.step >= cfg.steps:
                run["trained_s"] = max(run["trained_s"], budget)
            run["steps_done"] = trainer.step
            trainer.save_checkpoint()
            state_path(work).write_text(json.dumps(state, indent=1))
            print(f"{name}: step {trainer.step}/{cfg.steps}, {run['trained_s'] / 60:.1f} of {args.minutes} min",
                  flush=True)
        rnd += 1
    results = {}
    for name, cfg in cfgs.items():  # the same validation for both: every anchor of the same replies
        ckpt = work / name / "checkpoint" / "drafter"
        judge = dataclasses.replace(cfgs["new"], init=str(ckpt), out=str(work / f"judge-{name}"),
                                    draft_vocab_size=0)
        val = Trainer(judge, progress=False).validate()
        results[name] = {"expected_tau": val["expected_tau"], "alpha": val["alpha"], **runs[name]}
    report = {"command": f"benchmarks/bench_recipes.py --minutes {args.minutes} --chunk-minutes "
                         f"{args.chunk_minutes} --k {args.k}",
              "machine": {"flags": cpu_flags(), "threads": 2}, "recipes": {n: c.to_dict() for n, c in cfgs.items()},
              "results": results}
    Path(args.out).with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
