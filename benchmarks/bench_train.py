"""Training-side throughput on SmolLM2 (issue 4): regeneration tokens/s per batch size, and online
distillation throughput (anchor blocks/s, target tokens/s) for the DSpark and DFlash drafters.

Writes benchmarks/results/train.{json,md}.

    python benchmarks/bench_train.py [--prompts 48] [--max-new-tokens 128] [--batch-sizes 1,16,32,64]
                                     [--train-steps 6]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from pathlib import Path

import torch

from dspark.model.loading import load_target
from dspark.sampling import SamplingParams
from dspark.train.config import TrainConfig
from dspark.train.data import load_prompts
from dspark.train.regenerate import regenerate
from dspark.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,16,32,64")
    ap.add_argument("--train-steps", type=int, default=6)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train"))
    args = ap.parse_args()
    target = load_target(None, dtype=torch.float32)
    prompts = load_prompts(ROOT / "data" / "train" / "prompts.jsonl")[: args.prompts]
    params = SamplingParams(temperature=0.7, top_p=0.95)
    regen = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "regen.jsonl"
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            n = args.prompts if bs > 1 else max(2, args.prompts // 16)
            out = Path(tmp) / f"bs{bs}.jsonl"
            stats = regenerate(target, prompts[:n], out, params, args.max_new_tokens, bs)
            regen.append({"batch_size": bs, **stats})
            print(regen[-1])
            if bs == max(int(b) for b in args.batch_sizes.split(",")):
                data.write_text(out.read_text())
        training = []
        for algorithm in ("dspark", "dflash"):
            cfg = TrainConfig(data=str(data), out=str(Path(tmp) / algorithm), algorithm=algorithm,
                              steps=args.train_steps + 1, batch_size=4, anchors_per_seq=16, block_size=8,
                              markov_rank=32, max_seq_len=512, eval_every=10**6, checkpoint_every=10**6,
                              val_fraction=0.0)
            trainer = Trainer(cfg, progress=False)
            recs = [trainer.train_step() for _ in range(args.train_steps + 1)][1:]  # first step: warm-up
            training.append({
                "algorithm": algorithm, "batch_size": 4, "anchors_per_seq": 16, "block_size": 8,
                "seconds_per_step": statistics.median(r["seconds"] for r in recs),
                "blocks_per_s": statistics.median(r["blocks_per_s"] for r in recs),
                "target_tok_per_s": statistics.median(r["target_tok_per_s"] for r in recs),
            })
            print(training[-1])
    result = {
        "command": f"python benchmarks/bench_train.py --prompts {args.prompts} --max-new-tokens "
                   f"{args.max_new_tokens} --batch-sizes {args.batch_sizes} --train-steps {args.train_steps}",
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "dtype": "float32", "regeneration": regen, "training": training,
    }
    Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Training throughput (issue 4)", "", f"`{result['command']}` — SmolLM2-135M target, fp32, "
             f"{result['threads']} threads. Regeneration at T=0.7, top-p 0.95, training prompts.", "",
             "| regeneration batch size | prompts | new tokens | tokens/s |", "|---|---|---|---|"]
    for r in regen:
        lines.append(f"| {r['batch_size']} | {r['prompts_done']} | {r['new_tokens']} | {r['tokens_per_s']:.1f} |")
    lines += ["", "| training | sequences/step | anchors/seq | γ | s/step | anchor blocks/s | target tokens/s |",
              "|---|---|---|---|---|---|---|"]
    for t in training:
        lines.append(f"| {t['algorithm']} | 4 | 16 | 8 | {t['seconds_per_step']:.2f} | {t['blocks_per_s']:.1f} | "
                     f"{t['target_tok_per_s']:.0f} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
