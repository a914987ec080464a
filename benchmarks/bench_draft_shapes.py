"""What each drafter shape costs (issue 20, item 5): one full-block DSpark draft pass at T = 0 and
T = 1 over a K-token draft vocabulary, for draft layers × Markov rank × block size, next to a 1- and
a 9-token target forward of the embedded SmolLM2; all round-robin in one process, medians. What a
change to the draft pass gains is measured against the revision before it by bench_draft_pass_ab.py.

    .venv/bin/python benchmarks/bench_draft_shapes.py --out benchmarks/results/draft_shapes
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_draft_vocab import DATA, draft_pass_latency, drafter_for

from dspark.model.loading import load_target
from dspark.train.data import load_samples
from dspark.util.platform import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(1, 32, 8), (2, 32, 8), (3, 32, 8), (1, 16, 8), (1, 64, 8), (1, 32, 6), (1, 32, 10)]  # layers, rank, block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30, help="timed rounds")
    ap.add_argument("--k", type=int, default=8192, help="draft vocabulary")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "draft_shapes"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = load_target(None, dtype=args.dtype)
    replies = [s.response_ids for s in load_samples(DATA)]
    drafters = {f"L={layers} r={rank} block={block}": drafter_for(target, args.k, replies, layers, rank, block)
                for layers, rank, block in SHAPES}
    latency = draft_pass_latency(target, drafters, args.reps)
    one = latency["target 1-token forward"]
    report = {"command": f"benchmarks/bench_draft_shapes.py --reps {args.reps} --k {args.k} --dtype {args.dtype}",
              "machine": {"flags": cpu_flags(), "threads": 2, "precision": target.model.precision},
              "draft_pass_ms": latency,
              "draft_pass_over_one_token_step": {n: v / one for n, v in latency.items() if n.startswith("draft")}}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["draft_pass_over_one_token_step"], indent=1))


if __name__ == "__main__":
    main()
