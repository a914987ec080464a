"""EAGLE-3 vs DSpark draft latency (issue 5): one `propose` of γ = 4 and 8 tokens, EAGLE-3 (one layer,
γ sequential steps) against DSpark drafters of the same width (one target-shaped layer; Markov
head r=32 + confidence head, and DFlash mode), all timed round-robin after a 512-token context.
Writes benchmarks/results/eagle3.{json,md}.

    python benchmarks/bench_eagle3.py [--reps 30] [--context 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.draft.checkpoint import new_draft_config, new_model, wrap_drafter
from dspark.model.loading import load_target
from dspark.sampling import SamplingParams, new_generator

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "eagle3"))
    args = ap.parse_args()
    target = load_target(None, dtype=torch.float32)
    model = target.model
    context = torch.randint(100, model.cfg.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    variants = {"eagle3": dict(kind="eagle3"), "dspark": dict(markov_head_type="vanilla", markov_rank=32),
                "dflash": dict(markov_head_type="none", enable_confidence_head=False)}
    drafters = {}
    for g in (4, 8):
        for name, opts in variants.items():
            torch.manual_seed(0)
            m = new_model(new_draft_config(target, block_size=g, **opts)).requires_grad_(False)
            drafters[(name, g)] = wrap_drafter(m, target)
    taps = {d.tap_layers: None for d in drafters.values()}
    for layers in taps:
        taps[layers] = model(torch.tensor([context]), model.new_cache(1, args.context), taps=layers).taps[0]
    times = {k: [] for k in drafters}
    greedy = SamplingParams()
    for rep in tqdm(range(args.reps + 2), desc="round-robin reps"):
        for key, d in drafters.items():
            d.begin(context)  # fresh context each time (untimed): EAGLE-3 commits the anchor's pair
            d.observe(context, taps[d.tap_layers])
            t0 = time.perf_counter()
            d.propose(7, 99, greedy, new_generator(0))
            if rep >= 2:
                times[key].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [dict(block_size=g, **{f"{n}_ms": med[(n, g)] for n in variants}) for g in (4, 8)]
    result = {"command": f"python benchmarks/bench_eagle3.py --reps {args.reps} --context {args.context}",
              "threads": torch.get_num_threads(), "dtype": "float32", "rows": rows}
    Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# EAGLE-3 vs DSpark draft latency (issue 5)", "",
             f"`{result['command']}` — SmolLM2-135M target, fp32, {result['threads']} threads, greedy, medians of "
             f"{args.reps} interleaved repetitions. All drafters have one target-shaped layer.", "",
             "| γ | EAGLE-3 (ms) | DSpark, Markov r=32 + confidence (ms) | DFlash (ms) | EAGLE-3 / DSpark |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['block_size']} | {r['eagle3_ms']:.1f} | {r['dspark_ms']:.1f} | {r['dflash_ms']:.1f} | "
                     f"{r['eagle3_ms'] / r['dspark_ms']:.2f}x |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
