"""How much of the target's batched capacity the engine loop delivers (issue: one decode step).

In one process, on the embedded SmolLM2 (greedy, 2 threads):
  * single-stream plain decoding (`Decoder`, the loop of `dspark generate --drafter none`): decode tok/s;
  * regeneration (`dspark data regenerate`'s function, the engine under the AR policy) at 1, 16 and
    32 rows: reply tokens/s, prefill included;
  * engine steps/s under the `ar` policy with R rows all decoding, against the bare target forward
    (R rows x 1 token + the LM head over R rows, no engine) and `dspark profile`'s SPS(R).
Rounds rotate the order of the measurements so machine drift hits all alike; medians are reported.

    .venv/bin/python benchmarks/bench_engine.py --out benchmarks/results/engine.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dspark.decode.engine import Engine, Request
from dspark.decode.generate import Decoder
from dspark.model.loading import load_target, parse_dtype
from dspark.sampling import SamplingParams
from dspark.schedule.policies import ARPolicy
from dspark.schedule.sps import load_or_measure
from dspark.train.data import load_prompts
from dspark.train.regenerate import regenerate
from dspark.util.platform import cpu_flags

ROOT = Path(__file__).resolve().parents[1]


def single_stream(target, prompts, new_tokens) -> float:
    dec = Decoder(target)
    rates = [dec.generate(target.encode_prompt(p.text), new_tokens).stats.decode_tok_s for p in prompts]
    return statistics.median(rates)


def regen_rate(target, prompts, new_tokens, rows) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        stats = regenerate(target, prompts, Path(tmp) / "r.jsonl", SamplingParams(temperature=0.7, top_p=0.95),
                           max_new_tokens=new_tokens, batch_size=rows, progress=False)
    return stats["tokens_per_s"]


def engine_steps(target, prompts, rows, steps) -> float:
    """Steps/s of the engine with `rows` requests all decoding (warm-up steps excluded)."""
    engine = Engine(target, policy=ARPolicy(), max_batch=rows, max_len=1024)
    for i in range(rows):  # sampled, so that rows rarely end early on EOS
        engine.submit(Request(target.encode_prompt(prompts[i % len(prompts)].text), steps + 8,
                              SamplingParams(temperature=1.0), seed=i))
    for _ in range(4):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return steps / (time.perf_counter() - t0)


@torch.inference_mode()
def bare_forward(target, rows, steps, context=200) -> float:
    """Target forwards/s for `rows` rows of one token each after `context` cached tokens, LM head over
    the rows: what a decoding step must pay at the least."""
    model = target.model
    cache = model.new_cache(rows, context + steps + 8)
    model(torch.randint(0, model.cfg.vocab_size, (rows, context)), cache)
    x = torch.randint(0, model.cfg.vocab_size, (rows, 1))
    for _ in range(3):
        model.logits(model(x, cache).hidden[:, -1])
    t0 = time.perf_counter()
    for _ in range(steps):
        model.logits(model(x, cache).hidden[:, -1])
    return steps / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/engine.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = load_target(None, dtype=parse_dtype(args.dtype))
    prompts = [p for p in load_prompts(ROOT / "data/calib/prompts.jsonl")][:64]
    sps = load_or_measure(target, max_tokens=32, progress=False)[0]
    jobs = {
        "single_stream_tok_s": lambda: single_stream(target, prompts[:4], args.new_tokens),
        "regen_1_tok_s": lambda: regen_rate(target, prompts[:4], args.new_tokens, 1),
        "regen_16_tok_s": lambda: regen_rate(target, prompts[:32], args.new_tokens, 16),
        "regen_32_tok_s": lambda: regen_rate(target, prompts[:64], args.new_tokens, 32),
        "engine_8_steps_s": lambda: engine_steps(target, prompts, 8, 40),
        "engine_32_steps_s": lambda: engine_steps(target, prompts, 32, 40),
        "forward_8_steps_s": lambda: bare_forward(target, 8, 40),
        "forward_32_steps_s": lambda: bare_forward(target, 32, 40),
    }
    names = list(jobs)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for rnd in range(args.rounds):
        for name in names[rnd % len(names):] + names[: rnd % len(names)]:
            samples[name].append(jobs[name]())
            print(f"round {rnd} {name}: {samples[name][-1]:.1f}", flush=True)
    med = {n: statistics.median(v) for n, v in samples.items()}
    report = {
        "command": "benchmarks/bench_engine.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                                           if k != "out"),
        "machine": {"cpu": platform.processor() or platform.machine(), "flags": cpu_flags(), "threads": 2},
        "dtype": str(target.model.dtype).removeprefix("torch."),
        "medians": med, "samples": samples,
        "profile_sps": {"8": sps(8), "32": sps(32)},
        "ratios": {
            "regen_32_over_single_stream": med["regen_32_tok_s"] / med["single_stream_tok_s"],
            "regen_16_over_single_stream": med["regen_16_tok_s"] / med["single_stream_tok_s"],
            "engine_8_over_bare_forward": med["engine_8_steps_s"] / med["forward_8_steps_s"],
            "engine_32_over_bare_forward": med["engine_32_steps_s"] / med["forward_32_steps_s"],
            "engine_8_over_profile_sps": med["engine_8_steps_s"] / sps(8),
            "engine_32_over_profile_sps": med["engine_32_steps_s"] / sps(32),
        },
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"medians": med, "ratios": report["ratios"]}, indent=1))


if __name__ == "__main__":
    main()
