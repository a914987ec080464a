"""Regeneration temperature ablation (issue 21): does a drafter learn more from the target's greedy
replies or from sampled ones?

Arms: the prompts of data/regen/smollm2.jsonl (1,380) answered by the target at T = 0.7 / top-p 0.95
(that file, regenerated on 2026-11-29) and the same prompts answered greedily (regenerated here).
Each arm trains the same drafter (the new recipe: every anchor, a K-token draft vocabulary) for the
same number of steps with the same seed. Both final drafters are judged on held-out prompts (the
trainer's id-hash validation split of data/train/prompts.jsonl, never trained on) answered by the
target greedily (T = 0 acceptance: the draft's argmax is the target's) and at T = 1 (acceptance
1 − TV), each conditional on the true prefix; expected τ over a block of 8.

Everything resumes: the regenerations are shard stores under data/regen/ (committed as they grow:
`smollm2-t0` the greedy arm, `val-smollm2-t0` / `val-smollm2-t1` the judging sets), the trainings
checkpoint every 50 steps under --work. Results: <out>.json.

    .venv/bin/python benchmarks/bench_regen_temperature.py --out benchmarks/results/regen_temperature
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from pathlib import Path

import torch

from dspark.model.loading import load_target
from dspark.sampling import SamplingParams
from dspark.train.config import load_config
from dspark.train.data import is_validation, load_prompts, load_samples
from dspark.train.regenerate import regenerate
from dspark.train.trainer import Trainer
from dspark.util.cache import cache_root
from dspark.util.platform import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
SAMPLED = ROOT / "data" / "regen" / "smollm2.jsonl"
PROMPTS = ROOT / "data" / "train" / "prompts.jsonl"


def regeneration_record(store: Path) -> dict:
    """A store's totals and the runs that produced its replies (not later no-op resumes)."""
    manifest = json.loads((store / "manifest.json").read_text())
    return {"totals": manifest["totals"], "runs": [r for r in manifest["runs"] if r["prompts_done"]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600, help="training steps per arm (default 600)")
    ap.add_argument("--k", type=int, default=8192, help="draft vocabulary (default 8192)")
    ap.add_argument("--val-prompts", type=int, default=64, help="held-out prompts per judging set (default 64)")
    ap.add_argument("--limit", type=int, default=None, help="use only the first N training prompts (smoke runs)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32, help="regeneration rows (default 32)")
    ap.add_argument("--dtype", default="auto", help="the target's dtype for regeneration (default auto)")
    ap.add_argument("--regen-dir", default=str(ROOT / "data" / "regen"), help="where the regenerated stores go")
    ap.add_argument("--only-regenerate", action="store_true", help="stop after the regenerations")
    ap.add_argument("--work", default=str(cache_root() / "bench-regen-temperature"), help="training runs")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "regen_temperature"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    sampled = load_samples(SAMPLED)[: args.limit]
    wanted = {s.id for s in sampled}
    by_id = {p.id: p for p in load_prompts(PROMPTS)}
    held_out = [p for p in by_id.values() if is_validation(p.id, 0.02)]
    random.Random(0).shuffle(held_out)  # a mix of the sources
    held_out = held_out[: args.val_prompts]

    target = load_target(None, dtype=args.dtype)
    stores = {name: Path(args.regen_dir) / name for name in ("smollm2-t0", "val-smollm2-t0", "val-smollm2-t1")}
    for name, prompts, params in [
        ("val-smollm2-t0", held_out, SamplingParams()),
        ("val-smollm2-t1", held_out, SamplingParams(temperature=1.0)),
        ("smollm2-t0", [by_id[i] for i in by_id if i in wanted], SamplingParams()),
    ]:
        regenerate(target, prompts, stores[name], params, args.max_new_tokens, args.batch_size,
                   max_prompt_tokens=1024, shard_size=256)
    del target
    if args.only_regenerate:
        return

    base = load_config(ROOT / "configs" / "dspark-smollm2.toml")
    base = dataclasses.replace(base, anchors_per_seq="all", draft_vocab_size=args.k, steps=args.steps, threads=2,
                               eval_every=10**9, checkpoint_every=50, val_fraction=0.0)
    if args.limit:  # the same sampled replies as the greedy arm
        subset = work / "sampled-subset.jsonl"
        subset.write_text("".join(json.dumps(dataclasses.asdict(s)) + "\n" for s in sampled))
    arms = {"sampled T=0.7": subset if args.limit else SAMPLED, "greedy T=0": stores["smollm2-t0"]}
    results = {}
    for arm, data in arms.items():
        run = work / arm.split()[0]
        cfg = dataclasses.replace(base, data=str(data), out=str(run), val_data=str(stores["val-smollm2-t0"]))
        trainer = Trainer(cfg, resume=(run / "checkpoint").is_dir())
        trainer.run()
        judged = {}
        for val in ("val-smollm2-t0", "val-smollm2-t1"):
            judge = dataclasses.replace(cfg, init=str(run / "final"), out=str(work / f"judge-{arm.split()[0]}"),
                                        val_data=str(stores[val]), val_max_samples=args.val_prompts)
            judged[val] = Trainer(judge, progress=False).validate()
        results[arm] = {
            "train_samples": len(trainer.train_set),
            "train_response_tokens": sum(len(s.response_ids) for s in trainer.train_set),
            "tau_t0_on_greedy_replies": judged["val-smollm2-t0"]["expected_tau_greedy"],
            "alpha_t0": judged["val-smollm2-t0"]["alpha_greedy"],
            "tau_t1_on_t1_replies": judged["val-smollm2-t1"]["expected_tau"],
            "alpha_t1": judged["val-smollm2-t1"]["alpha"],
        }
    report = {"command": f"benchmarks/bench_regen_temperature.py --steps {args.steps} --k {args.k} "
                         f"--val-prompts {args.val_prompts}" + (f" --limit {args.limit}" if args.limit else ""),
              "machine": {"flags": cpu_flags(), "threads": 2}, "regeneration": {name: regeneration_record(path) for name, path in stores.items()}, "results": results}
    Path(args.out).with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
