"""Cheap drafting (issue 20) on the embedded SmolLM2, all in one process:

(a) one γ = 8 DSpark draft pass (`propose`: backbone + LM head + Markov head + sampling) in the
    shipped shape (1 layer, vanilla Markov head of rank 32, confidence head), at T = 0 and T = 1,
    over the full vocabulary and over K ∈ {4096, 8192, 16384} (the most frequent response tokens of
    data/regen/smollm2.jsonl), next to a 1-token and a 9-token target forward; every configuration
    timed round-robin after a 256-token context, medians;
(b) training throughput in supervised slots per second: today's recipe (16 anchors per sequence,
    full vocabulary) against the new one (every anchor, K = --train-k, chunks of 64 anchors), the
    same data and batch, steps interleaved one by one between the two trainers;
and the coverage of each K: the share of response tokens inside it, on the training data and on
the target's greedy replies to the evaluation prompts.

    .venv/bin/python benchmarks/bench_draft_vocab.py --out benchmarks/results/draft_vocab
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dspark.decode.generate import Decoder
from dspark.draft import vocab
from dspark.draft.checkpoint import new_draft_config, wrap_drafter
from dspark.draft.dspark import DSparkModel
from dspark.model.loading import load_target
from dspark.sampling import SamplingParams
from dspark.train.config import TrainConfig
from dspark.train.data import load_samples
from dspark.train.trainer import Trainer
from dspark.util.platform import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "regen" / "smollm2.jsonl"
SETS = ("gsm8k", "humaneval", "mt-bench")
KS = (0, 4096, 8192, 16384)  # 0: the full vocabulary


def drafter_for(target, k: int, replies: list[list[int]], layers: int = 1, rank: int = 32, block: int = 8,
                head: str = "vanilla", fusion: str = "shared"):
    """A random DSpark drafter (the shipped shape by default; `head` "none": DFlash) over the top-K tokens
    of `replies`."""
    cfg = new_draft_config(target, block_size=block, num_hidden_layers=layers, markov_head_type=head,
                           markov_rank=rank, enable_confidence_head=head != "none", draft_vocab_size=k,
                           context_fusion=fusion)
    torch.manual_seed(0)
    model = DSparkModel(cfg)
    if k:
        model.set_draft_vocab(vocab.most_frequent(replies, k, target.cfg.vocab_size))
    return wrap_drafter(model.to(target.model.dtype).requires_grad_(False), target)


@torch.inference_mode()
def draft_pass_latency(target, drafters: dict, reps: int, context: int = 256, forwards=(1, 9)) -> dict:
    """Median ms of one full-block draft pass of each drafter ({name: drafter}) at T = 0 and T = 1,
    and of target forwards over each number of tokens in `forwards`, all round-robin after a
    `context`-token prompt.

    Every draft pass is timed right after an (untimed) 9-token target forward, the state a decode
    loop drafts in: the target's weights have just streamed through the caches. The jobs run in a
    fresh shuffled order each round: what ran before a pass matters even so (a pass after another
    drafter's pass finds the shared Python and dispatcher paths warm, one after two target forwards
    does not), and a fixed cyclic order gave the same drafter the same predecessor every round, which
    looked like a first-built-drafter effect of up to ~20%."""
    m = target.model
    ctx = list(range(1000, 1000 + context))
    capacity = context + max(forwards) + 16
    taps = {}  # tapped features of the prompt, per set of tapped layers
    for d in drafters.values():
        if d.tap_layers not in taps:
            taps[d.tap_layers] = m(torch.tensor([ctx]), m.new_cache(1, capacity), taps=d.tap_layers).taps[0]
        d.begin(ctx)
        d.observe(ctx, taps[d.tap_layers])
    cache = m.new_cache(1, capacity)
    m(torch.tensor([ctx]), cache)
    temps = {"T=0": SamplingParams(temperature=0.0), "T=1": SamplingParams(temperature=1.0)}

    def target_forward(q: int) -> None:
        cache.truncate(context)
        m.logits(m(torch.arange(200, 200 + q)[None], cache).hidden[0])

    jobs = {f"target {q}-token forward": (lambda q=q: target_forward(q)) for q in forwards}
    for label, d in drafters.items():
        for name, params in temps.items():
            gen = torch.Generator().manual_seed(0)
            jobs[f"draft {label} {name}"] = lambda d=d, p=params, g=gen: d.propose(1234, d.max_drafts, p, g)
    verify_first = {n for n in jobs if n.startswith("draft")}
    times = {n: [] for n in jobs}
    names = list(jobs)
    for rep in range(reps + 2):  # every round in its own shuffled order (see above); 2 warm-ups
        for name in random.Random(rep).sample(names, len(names)):
            if name in verify_first:
                target_forward(9)
            t0 = time.perf_counter()
            jobs[name]()
            if rep >= 2:
                times[name].append(time.perf_counter() - t0)
    return {n: statistics.median(v) * 1e3 for n, v in times.items()}


def eval_replies(target, per_set: int, new_tokens: int) -> dict[str, list[list[int]]]:
    dec = Decoder(target)
    out = {}
    for name in SETS:
        with open(ROOT / "data" / "eval" / f"{name}.jsonl") as f:
            prompts = [json.loads(line)["turns"][0] for line, _ in zip(f, range(per_set))]
        out[name] = [dec.generate(target.encode_prompt(p), new_tokens).token_ids for p in prompts]
    return out


def training_throughput(steps: int, train_k: int, run_dir: Path) -> dict:
    base = dict(data=str(DATA), steps=1000, batch_size=4, block_size=8, markov_rank=32, eval_every=10**9,
                checkpoint_every=10**9, val_fraction=0.02, threads=2, seed=0)
    recipes = {"today: 16 anchors, full vocabulary": dict(anchors_per_seq=16),
               f"new: all anchors, K = {train_k}": dict(anchors_per_seq="all", draft_vocab_size=train_k,
                                                         anchor_chunk=64)}
    trainers = {name: Trainer(TrainConfig(out=str(run_dir / str(i)), **base, **kw), progress=False)
                for i, (name, kw) in enumerate(recipes.items())}
    recs = {name: [] for name in trainers}
    for step in range(steps + 1):  # interleaved step by step; step 0 warms up
        for name, tr in trainers.items():
            rec = tr.train_step()
            if step:
                recs[name].append(rec)
    out = {}
    for name, rs in recs.items():
        slots, seconds = sum(r["slots"] for r in rs), sum(r["seconds"] for r in rs)
        out[name] = {"supervised_slots_per_s": slots / seconds, "seconds_per_step": seconds / len(rs),
                     "slots_per_step": slots / len(rs),
                     "target_s_per_step": statistics.mean(r["target_s"] for r in rs),
                     "drafter_s_per_step": statistics.mean(r["drafter_s"] for r in rs),
                     "optimizer_s_per_step": statistics.mean(r["optimizer_s"] for r in rs)}
    names = list(out)
    out["speedup"] = out[names[1]]["supervised_slots_per_s"] / out[names[0]]["supervised_slots_per_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30, help="timed rounds of (a)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--train-steps", type=int, default=8, help="timed steps per recipe in (b)")
    ap.add_argument("--train-k", type=int, default=8192)
    ap.add_argument("--eval-prompts", type=int, default=4, help="prompts per evaluation set for the coverage")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "draft_vocab"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = load_target(None, dtype=args.dtype)
    replies = [s.response_ids for s in load_samples(DATA)]
    latency = draft_pass_latency(target, {f"K={k or 'full'}": drafter_for(target, k, replies) for k in KS}, args.reps)
    print(json.dumps(latency, indent=1), flush=True)
    evals = eval_replies(target, args.eval_prompts, 128)
    cover = {}
    for k in KS[1:]:
        ids = vocab.most_frequent(replies, k, target.cfg.vocab_size)
        cover[k] = {"training data": vocab.coverage(replies, ids),
                    **{name: vocab.coverage(r, ids) for name, r in evals.items()}}
    with tempfile.TemporaryDirectory() as tmp:
        train = training_throughput(args.train_steps, args.train_k, Path(tmp))
    one = latency["target 1-token forward"]
    report = {
        "command": f"benchmarks/bench_draft_vocab.py --reps {args.reps} --dtype {args.dtype} --train-steps "
                   f"{args.train_steps} --train-k {args.train_k} --eval-prompts {args.eval_prompts}",
        "machine": {"flags": cpu_flags(), "threads": 2, "precision": target.model.precision},
        "draft_pass_ms": latency,
        "draft_pass_over_one_token_step": {n: v / one for n, v in latency.items() if n.startswith("draft")},
        "coverage": cover,
        "training": train,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("draft_pass_over_one_token_step", "coverage", "training")}, indent=1))


if __name__ == "__main__":
    main()
