"""Drafter latency benchmark (issue 3): one DSpark draft pass (`propose`: backbone + LM head +
sequential sampling) for block sizes γ = 4, 8, 16, 1 and 2 draft layers, sequential head on/off,
against one SmolLM2 target forward (1 token, and the γ+1 tokens that verify a block).

Every configuration is timed round-robin in the same loop (this machine's speed drifts), after a
512-token context is observed; medians over repetitions. Writes benchmarks/results/drafter.{json,md}.

    python benchmarks/bench_drafter.py [--reps 30] [--context 512] [--ranks 8,16,32] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.draft.checkpoint import new_draft_config
from dspark.draft.dspark import DSparkDrafter, DSparkModel
from dspark.model.loading import load_target, parse_dtype
from dspark.sampling import SamplingParams, new_generator

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--ranks", default="8,16,32", help="Markov ranks of the head-on drafters")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "drafter"))
    args = ap.parse_args()

    target = load_target(None, dtype=parse_dtype(args.dtype))
    model = target.model
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(100, model.cfg.vocab_size, (args.context,), generator=gen).tolist()

    ranks = [int(r) for r in args.ranks.split(",")]
    drafters = {}
    for g in (4, 8, 16):
        for layers in (1, 2):
            for rank in [0] + ranks:  # rank 0: no heads (DFlash mode)
                cfg = new_draft_config(target, block_size=g, num_hidden_layers=layers,
                                       markov_head_type="vanilla" if rank else "none", markov_rank=rank,
                                       enable_confidence_head=rank > 0)
                torch.manual_seed(0)
                d = DSparkDrafter(DSparkModel(cfg).to(model.dtype).requires_grad_(False), target)
                drafters[(g, layers, rank)] = d
    taps = next(iter(drafters.values())).tap_layers
    cache = model.new_cache(1, args.context + 32)
    out = model(torch.tensor([context]), cache, taps=taps)
    for d in drafters.values():
        d.begin(context)
        d.observe(context, out.taps[0])

    def target_forward(k: int) -> None:
        x = torch.randint(100, model.cfg.vocab_size, (1, k), generator=gen)
        model.logits(model(x, cache, taps=taps).hidden[0])
        cache.truncate(args.context)

    settings = {"T=0": SamplingParams(0.0), "T=1": SamplingParams(1.0)}
    jobs = {("target", k): (lambda k=k: target_forward(k)) for k in (1, 5, 9, 17)}
    for key, d in drafters.items():
        for name, params in settings.items():
            jobs[("draft", *key, name)] = lambda d=d, p=params: d.propose(7, 99, p, new_generator(0))
    times = {key: [] for key in jobs}
    for rep in tqdm(range(args.reps + 2), desc="round-robin reps"):
        for key, job in jobs.items():
            t0 = time.perf_counter()
            job()
            if rep >= 2:  # warm-up
                times[key].append((time.perf_counter() - t0) * 1e3)
    med = {key: statistics.median(v) for key, v in times.items()}

    rows = []
    for (g, layers, rank) in drafters:
        if rank:
            continue
        for name in settings:
            off = med[("draft", g, layers, 0, name)]
            on = {r: med[("draft", g, layers, r, name)] for r in ranks}
            rows.append(dict(block_size=g, layers=layers, sampling=name, draft_ms_no_head=off,
                             draft_ms_markov={r: v for r, v in on.items()},
                             head_overhead={r: v / off - 1 for r, v in on.items()},
                             target_1_ms=med[("target", 1)], target_verify_ms=med[("target", g + 1)]))
    result = {
        "command": f"python benchmarks/bench_drafter.py --reps {args.reps} --context {args.context} "
                   f"--ranks {args.ranks} --dtype {args.dtype}",
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "dtype": str(model.dtype).removeprefix("torch."),
        "markov_ranks": ranks,
        "context": args.context,
        "target_forward_ms": {k: med[("target", k)] for k in (1, 5, 9, 17)},
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Drafter latency (issue 3)",
        "",
        f"`{result['command']}` — SmolLM2-135M target, {result['dtype']}, {result['threads']} threads, "
        f"context {args.context}, medians of {args.reps} interleaved repetitions. A draft pass is one "
        "`propose`: backbone, LM head, sampling of the whole block (and, with heads, the Markov head "
        "slot by slot plus the confidence head).",
        "",
        "| γ | layers | sampling | draft, no head (ms) | "
        + " | ".join(f"Markov r={r} (ms, overhead)" for r in ranks)
        + " | target 1-token fwd (ms) | target γ+1 verify fwd (ms) |",
        "|---|---|---|---|" + "---|" * len(ranks) + "---|---|",
    ]
    for r in rows:
        cells = " | ".join(f"{r['draft_ms_markov'][k]:.2f} ({100 * r['head_overhead'][k]:+.0f}%)" for k in ranks)
        lines.append(f"| {r['block_size']} | {r['layers']} | {r['sampling']} | {r['draft_ms_no_head']:.2f} | "
                     f"{cells} | {r['target_1_ms']:.1f} | {r['target_verify_ms']:.1f} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
