"""What each drafter shape costs (issue 20, item 5): one full-block DSpark draft pass at T = 0 and
T = 1 over a K-token draft vocabulary, for draft layers × Markov rank × block size, next to a 1- and
a 9-token target forward of the embedded SmolLM2; all round-robin in one process, medians. The
shipped shape runs a second time as it drafted before the prepacked projections (`FastLinear`), the
fp32 Markov W2 and the RoPE table (plain `F.linear`, W2 in bf16, RoPE recomputed every pass), for
the gain side by side.

    .venv/bin/python benchmarks/bench_draft_shapes.py --out benchmarks/results/draft_shapes
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_draft_vocab import DATA, draft_pass_latency, drafter_for

from dspark.target.kernels import FastLinear
from dspark.target.loading import load_target
from dspark.train.data import load_samples
from dspark.util.platform import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "L=1 r=32 block=8 as drafted before"
SHAPES = [(1, 32, 8), (2, 32, 8), (3, 32, 8), (1, 16, 8), (1, 64, 8), (1, 32, 6), (1, 32, 10)]  # layers, rank, block


def as_drafted_before(drafter):
    """`drafter` as it drafted before `FastLinear`, the fp32 W2 and the RoPE table: plain `nn.Linear`
    projections, W2ᵀ in the model's dtype, RoPE computed for every pass."""
    def unpack(module: torch.nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, FastLinear):
                plain = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                plain.weight, plain.bias = child.weight, child.bias
                setattr(module, name, plain)
            else:
                unpack(child)

    unpack(drafter.model)
    drafter._w2t = drafter.model.markov_head.markov_w2.weight.t().contiguous()
    drafter.model.rope = drafter.model.rope_values
    return drafter


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
    drafters[BEFORE] = as_drafted_before(drafter_for(target, args.k, replies, *SHAPES[0]))
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
