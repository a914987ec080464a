"""The batched engine under several `--drafter` spellings at once, in one process (no HTTP).

Each arm (`ar`, or a `--drafter` value such as `auto@dspark`, `auto@tree`, `auto+lookup@tree`) gets one
persistent `Engine` with C rows, as a server keeps one: its draft gate and estimates carry over from
chunk to chunk. A chunk is `--waves` x C requests (greedy by default, --max-tokens each) over the
gsm8k / humaneval / mt-bench prompts interleaved, run closed-loop (a finished request's row takes the
next); the arms take turns chunk by chunk in rotated order, so that machine drift hits all alike.
Reported per arm: median tok/s over the chunks (prefills included), the ratio to the first arm, τ,
drafts verified per round, and the seconds per step spent drafting and verifying.

    .venv/bin/python benchmarks/bench_engine_arms.py --concurrency 1,4,8 \
        --arms ar,auto@dspark,auto+lookup@tree --out benchmarks/results/engine_arms.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dspark.decode.engine import Request
from dspark.decode.speculation import engine_curve_tokens, engine_factory, resolve_drafter_spec, split_spec
from dspark.eval.prompts import load_eval_prompts
from dspark.model.loading import load_target
from dspark.sampling import SamplingParams
from dspark.schedule.policies import parse_policy
from dspark.schedule.sps import load_or_measure
from dspark.util.platform import cpu_flags


def make_engine(target, arm: str, rows: int):
    spec, policy = (None, "ar") if arm == "ar" else split_spec(resolve_drafter_spec(arm, target))
    make, _, drafts = engine_factory(target, spec, 1024)
    tokens = engine_curve_tokens(policy, rows, drafts)  # as `dspark serve` reads the curve
    sps = load_or_measure(target, max_tokens=tokens)[0] if tokens is not None else None
    return make(parse_policy(policy, sps), rows)


def run_level(target, prompts, arms: list[str], rows: int, chunks: int, waves: int, max_tokens: int,
              temperature: float) -> list[dict]:
    engines = {arm: make_engine(target, arm, rows) for arm in arms}
    n = max(waves * rows, 6)
    rates, taus, verified = ({a: [] for a in arms} for _ in range(3))
    for k in range(chunks):
        for arm in arms[k % len(arms):] + arms[: k % len(arms)]:
            reqs = [Request(prompts[(k * n + j) % len(prompts)], max_tokens, SamplingParams(temperature), seed=j)
                    for j in range(n)]
            t0 = time.perf_counter()
            engines[arm].run(reqs)
            wall = time.perf_counter() - t0
            rounds = [x for r in reqs for x in r.rounds]
            rates[arm].append(sum(len(r.token_ids) for r in reqs) / wall)
            taus[arm].append(sum(x.accepted + 1 for x in rounds) / len(rounds))
            verified[arm].append(sum(x.computed for x in rounds) / len(rounds))
        print(f"C={rows} chunk {k}: " + "  ".join(f"{a} {rates[a][-1]:.1f}" for a in arms), flush=True)
    base = statistics.median(rates[arms[0]])
    out = []
    for arm in arms:
        step = engines[arm].decode_step
        out.append({"concurrency": rows, "arm": arm, "tok_s": statistics.median(rates[arm]),
                    "over_first": statistics.median(rates[arm]) / base, "tau": statistics.fmean(taus[arm]),
                    "verified_per_round": statistics.fmean(verified[arm]), "chunks_tok_s": rates[arm],
                    "draft_ms_per_step": 1e3 * step.draft_s / max(1, step.steps),
                    "verify_ms_per_step": 1e3 * step.verify_s / max(1, step.steps)})
        print(json.dumps({k: v for k, v in out[-1].items() if k != "chunks_tok_s"}), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="ar,auto@dspark,auto+lookup@tree",
                    help="comma-separated: ar, or --drafter values (the first is the ratios' base)")
    ap.add_argument("--concurrency", default="1,4,8,16,32", help="engine rows, one level after another")
    ap.add_argument("--chunks", type=int, default=3, help="chunks per arm and level (default 3)")
    ap.add_argument("--waves", type=int, default=6, help="requests per chunk: this many times C (default 6)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True, help="JSON file for the results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(None, dtype=args.dtype)
    per_set = [load_eval_prompts(d) for d in ("gsm8k", "humaneval", "mt-bench")]
    prompts = [target.encode_prompt(p) for group in zip(*per_set) for p in group]
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    rows = [r for c in args.concurrency.split(",")
            for r in run_level(target, prompts, arms, int(c), args.chunks, args.waves, args.max_tokens,
                               args.temperature)]
    command = "benchmarks/bench_engine_arms.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")
    Path(args.out).write_text(json.dumps({"command": command, "cpu_flags": cpu_flags(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
