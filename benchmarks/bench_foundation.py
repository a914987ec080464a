"""Foundation benchmark: the lean runner vs HF transformers, prompt lookup vs AR, forward latency.

All decode measurements are interleaved prompt by prompt in one run (this machine's speed drifts),
and reported as medians over prompts. Writes benchmarks/results/foundation.{json,md}.

    python benchmarks/bench_foundation.py [--prompts-per-dataset 10] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.decode.generate import Decoder
from dspark.draft.prompt_lookup import PromptLookupDrafter
from dspark.model.kernels import cpu_has_native_bf16
from dspark.model.loading import load_target

ROOT = Path(__file__).resolve().parents[1]


def load_prompts(name: str, n: int) -> list[str]:
    with open(ROOT / "data" / "eval" / f"{name}.jsonl") as f:
        return [json.loads(line)["turns"][0] for line, _ in zip(f, range(n))]


def hf_decode_tok_s(hf, ids: list[int], max_new_tokens: int) -> tuple[float, list[int]]:
    """HF generate, greedy; decode speed excludes prefill (timed separately and subtracted)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        t0 = time.perf_counter()
        hf(x)  # prefill-equivalent forward
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = hf.generate(x, max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(x))
        total = time.perf_counter() - t0
    new = out[0, len(ids) :].tolist()
    return (len(new) - 1) / max(total - prefill, 1e-9), new


def forward_latencies(model, ks, context: int = 512, reps: int = 15) -> dict[int, float]:
    """Median ms of a k-token forward (+ LM head) at `context`; the k values are interleaved
    round-robin so machine drift hits all of them alike."""
    g = torch.Generator().manual_seed(0)
    cache = model.new_cache(1, context + max(ks) + 1)
    model(torch.randint(0, model.cfg.vocab_size, (1, context), generator=g), cache)
    times = {k: [] for k in ks}
    for rep in range(reps + 2):
        for k in ks:
            x = torch.randint(0, model.cfg.vocab_size, (1, k), generator=g)
            t0 = time.perf_counter()
            model.logits(model(x, cache).hidden[0])
            if rep >= 2:
                times[k].append(time.perf_counter() - t0)
            cache.truncate(context)
    return {k: statistics.median(v) * 1000 for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts-per-dataset", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    fp32 = load_target(None, dtype=torch.float32)
    bf16 = load_target(None, dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(str(fp32.path), dtype=torch.float32).eval()
    engines = {
        "runner_ar_fp32": Decoder(fp32),
        "runner_ar_bf16": Decoder(bf16),
        "prompt_lookup_fp32": Decoder(fp32, PromptLookupDrafter(4)),
    }
    prompts = [(d, p) for d in ("gsm8k", "humaneval") for p in load_prompts(d, args.prompts_per_dataset)]
    rows = []
    for dataset, prompt in tqdm(prompts, desc="decode (interleaved)"):
        ids = fp32.encode_prompt(prompt)
        row = {"dataset": dataset, "prompt_tokens": len(ids)}
        row["hf_generate_fp32"], hf_tokens = hf_decode_tok_s(hf, ids, args.max_new_tokens)
        for name, dec in engines.items():
            r = dec.generate(ids, args.max_new_tokens)
            row[name] = r.stats.decode_tok_s
            row[name + "_tau"] = r.stats.tau
            if name == "runner_ar_fp32":
                ar_tokens = r.token_ids
            if name == "prompt_lookup_fp32":
                row["prompt_lookup_identical"] = r.token_ids == ar_tokens
        row["hf_identical"] = hf_tokens[: len(ar_tokens)] == ar_tokens
        rows.append(row)

    def med(key, subset=rows):
        return statistics.median(r[key] for r in subset)

    summary = {k: med(k) for k in ["hf_generate_fp32", *engines]}
    summary["runner_ar_fp32_over_hf"] = med_ratio(rows, "runner_ar_fp32", "hf_generate_fp32")
    summary["runner_ar_bf16_over_hf"] = med_ratio(rows, "runner_ar_bf16", "hf_generate_fp32")
    summary["prompt_lookup_over_ar_fp32"] = med_ratio(rows, "prompt_lookup_fp32", "runner_ar_fp32")
    summary["prompt_lookup_tau"] = med("prompt_lookup_fp32_tau")
    summary["prompt_lookup_identical"] = sum(r["prompt_lookup_identical"] for r in rows)
    summary["hf_identical"] = sum(r["hf_identical"] for r in rows)

    latency = {}
    for name, target in (("float32", fp32), ("bfloat16", bf16)):
        latency[name] = forward_latencies(target.model, (1, 2, 4, 8, 16, 32))
    results = {
        "command": "python " + " ".join(sys.argv),
        "machine": {
            "cpu": cpu_model(),
            "native_bf16": cpu_has_native_bf16(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "max_new_tokens": args.max_new_tokens,
        "prompts": len(rows),
        "summary": summary,
        "forward_latency_ms_context512": latency,
        "per_prompt": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "foundation.json").write_text(json.dumps(results, indent=2))
    (args.out / "foundation.md").write_text(report(results))
    print(report(results))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def med_ratio(rows, a, b):
    return statistics.median(r[a] / r[b] for r in rows)


def report(res: dict) -> str:
    s, lat = res["summary"], res["forward_latency_ms_context512"]
    n = res["prompts"]
    lines = [
        "# Foundation benchmark",
        "",
        f"`{res['command']}` — {n} prompts (gsm8k and humaneval, half each), {res['max_new_tokens']} new tokens, greedy, "
        f"{res['machine']['threads']} threads, torch {res['machine']['torch']}. Medians over prompts; every engine ran "
        "on every prompt in turn (interleaved).",
        "",
        "| engine | decode tok/s (median) |",
        "|---|---|",
        f"| HF transformers `generate`, fp32 | {s['hf_generate_fp32']:.1f} |",
        f"| dspark runner AR, fp32 (oneDNN prepacked) | {s['runner_ar_fp32']:.1f} |",
        f"| dspark runner AR, bf16 | {s['runner_ar_bf16']:.1f} |",
        f"| dspark prompt lookup (4 drafts), fp32 | {s['prompt_lookup_fp32']:.1f} |",
        "",
        f"- runner AR / HF generate (per-prompt ratio, median): fp32 **{s['runner_ar_fp32_over_hf']:.2f}x**, "
        f"bf16 **{s['runner_ar_bf16_over_hf']:.2f}x**",
        f"- prompt lookup / runner AR (fp32): **{s['prompt_lookup_over_ar_fp32']:.2f}x**, tau {s['prompt_lookup_tau']:.2f}; "
        f"token-identical to AR on {s['prompt_lookup_identical']}/{n} prompts; HF greedy identical to runner on {s['hf_identical']}/{n}",
        "",
        "Forward latency at context 512 (ms, median of 15; k new tokens incl. LM head):",
        "",
        "| k | " + " | ".join(str(k) for k in lat["float32"]) + " |",
        "|---|" + "---|" * len(lat["float32"]),
    ]
    for dt, row in lat.items():
        lines.append(f"| {dt} | " + " | ".join(f"{v:.1f}" for v in row.values()) + " |")
    for dt, row in lat.items():
        lines.append(f"\nk=8 / k=1 ({dt}): **{row[8] / row[1]:.2f}x**")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
