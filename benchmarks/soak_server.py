"""Soak `dspark serve` (issue 48): a bounded closed loop of well-formed and hostile clients.

One server (the embedded SmolLM2 and its shipped drafter by default, the server's default policy),
C client threads, each looping until --minutes have passed, drawing per request:
  - a well-formed chat or completion (the bundled evaluation prompts, greedy or sampled, streamed or
    whole, --max-tokens at most), which must end with a finish reason, usage that agrees with it and,
    streamed, every chunk then [DONE];
  - with --disconnect-rate, a streamed request the client abandons after a few chunks;
  - with --bad-rate, a bad request (malformed JSON, an unknown field, the wrong model, an over-limit
    body, a body nested too deep) that must get its 4xx.
The server's RSS is sampled every 10 s. At the end: no request or KV row left (`/metrics`), the
counts, the RSS after warm-up and at the end, no traceback in the server's log. Exit 1 on any
failure. Writes OUT.json and OUT.md.

    .venv/bin/python benchmarks/soak_server.py --minutes 15 --concurrency 16 --out benchmarks/results/soak
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from dspark.util.platform import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_server import free_port, wait_healthy  # noqa: E402

MODEL = "smollm2"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Soak:
    def __init__(self, port: int, args, prompts: list[str]):
        self.port, self.args, self.prompts = port, args, prompts
        self.counts: Counter = Counter()
        self.failures: list[str] = []
        self.lock = threading.Lock()

    def note(self, kind: str, failure: str | None = None) -> None:
        with self.lock:
            self.counts[kind] += 1
            if failure is not None:
                self.counts["failed"] += 1
                if len(self.failures) < 50:
                    self.failures.append(f"{kind}: {failure}")

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)

    def client(self, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        while time.time() < deadline:
            roll = rng.random()
            try:
                if roll < self.args.bad_rate:
                    self.bad(rng)
                elif roll < self.args.bad_rate + self.args.disconnect_rate:
                    self.abandon(rng)
                else:
                    self.good(rng)
            except Exception as e:  # a refused connection, a timeout: a failure, never a crash of the soak
                self.note("exception", f"{type(e).__name__}: {e}")

    def body(self, rng: random.Random, stream: bool) -> tuple[str, dict]:
        prompt = rng.choice(self.prompts)
        sampling = {"max_tokens": rng.randint(1, self.args.max_tokens), "stream": stream,
                    "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randrange(1 << 30)}
        if rng.random() < 0.5:
            return "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                                            **sampling}
        return "/v1/completions", {"model": MODEL, "prompt": prompt, **sampling}

    def good(self, rng: random.Random) -> None:
        stream = rng.random() < 0.5
        path, body = self.body(rng, stream)
        if stream:
            body["stream_options"] = {"include_usage": True}
        c = self.connect()
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        kind = "stream" if stream else "whole"
        if r.status == 429:  # the queue is full: a correct answer under load, retried by real clients
            r.read()
            return self.note("429")
        if r.status != 200:
            return self.note(kind, f"status {r.status}: {r.read()[:300]!r}")
        failure = self.check_stream(r, body) if stream else self.check_whole(json.loads(r.read()), body)
        c.close()
        self.note(kind, failure)

    @staticmethod
    def check_whole(reply: dict, body: dict) -> str | None:
        finish, usage = reply["choices"][0]["finish_reason"], reply.get("usage") or {}
        if finish not in ("stop", "length"):
            return f"finish reason {finish!r}"
        n = usage.get("completion_tokens")
        if not isinstance(n, int) or n > body["max_tokens"] or (finish == "length" and n != body["max_tokens"]):
            return f"truncated: {finish} after {usage.get('completion_tokens')} of {body['max_tokens']} tokens"
        return None

    def check_stream(self, r, body: dict) -> str | None:
        finish, usage, done = None, None, False
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                return f"error event {event['error']}"
            if event.get("choices"):
                finish = event["choices"][0].get("finish_reason") or finish
            usage = event.get("usage") or usage
        if not done or usage is None:
            return f"stream cut short (finish {finish!r}, usage {usage})"
        return self.check_whole({"choices": [{"finish_reason": finish}], "usage": usage}, body)

    def abandon(self, rng: random.Random) -> None:
        path, body = self.body(rng, stream=True)
        body["max_tokens"] = self.args.max_tokens
        c = self.connect()
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        for _ in range(rng.randint(0, 6) if r.status == 200 else 0):
            r.readline()
        c.close()  # gone mid-stream
        self.note("abandoned")

    def bad(self, rng: random.Random) -> None:
        good = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        cases = [(b"{not json", 400), (json.dumps({**good, "frobnicate": 1}).encode(), 400),
                 (json.dumps({**good, "model": "gpt-9"}).encode(), 400), (b"[" * 20_000 + b"]" * 20_000, 400),
                 (json.dumps({**good, "user": "x" * (self.args.max_request_bytes + 1)}).encode(), 413)]
        raw, want = rng.choice(cases)
        c = self.connect()
        try:
            c.request("POST", "/v1/chat/completions", raw, {"Content-Type": "application/json"})
            r = c.getresponse()
            status, reply = r.status, r.read()
        except (BrokenPipeError, ConnectionResetError):
            return self.note("bad", None if want == 413 else "connection reset")  # 413 may close mid-send
        c.close()
        ok = status == want and b'"error"' in reply
        self.note("bad", None if ok else f"wanted {want}, got {status}: {reply[:200]!r}")


def metrics(port: int) -> dict[str, float]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    out = {}
    for line in c.getresponse().read().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def start(args, log) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "dspark.cli", "serve", "--port", str(port), "--max-batch", str(args.max_batch),
           "--max-model-len", str(args.max_model_len), "--max-request-bytes", str(args.max_request_bytes),
           "--served-model-name", MODEL, "--log-level", "warning", *args.server_args]
    return wait_healthy(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log), port, "soak"), port


def sample_rss(pid: int, until: float, samples: list) -> None:
    t0 = time.time()
    while time.time() < until:
        samples.append((round(time.time() - t0), round(rss_mib(pid), 1)))
        time.sleep(10)


def report(args, soak: Soak, rss: list, left: dict, log_text: str) -> dict:
    warm = [m for t, m in rss if t >= args.warmup_s] or [m for _, m in rss]
    growth = warm[-1] - warm[0]
    held = {k: left.get(f'dspark:{k}{{model_name="{MODEL}"}}') for k in
            ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}
    problems = list(soak.failures)
    problems += [f"left behind: {k} = {v}" for k, v in held.items() if v != 0]
    problems += ["a traceback in the server's log"] if "Traceback" in log_text else []
    problems += [f"RSS grew {growth:.0f} MiB after warm-up (bound {args.rss_bound_mib})"] \
        if growth > args.rss_bound_mib else []
    return {"command": " ".join(sys.argv), "cpu_flags": cpu_flags(), "minutes": args.minutes,
            "concurrency": args.concurrency, "counts": dict(soak.counts), "rss_mib": rss,
            "rss_after_warmup_mib": warm[0], "rss_end_mib": warm[-1], "rss_growth_mib": round(growth, 1),
            "rss_bound_mib": args.rss_bound_mib, "left_at_end": held, "problems": problems}


def write(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    c = result["counts"]
    lines = ["# dspark serve soak", "", f"`{result['command']}`", "", f"CPU flags: {result['cpu_flags']}", "",
             f"{result['minutes']} minutes, {result['concurrency']} closed-loop clients.", "",
             "| well-formed whole | streamed | abandoned mid-stream | bad requests | 429 | failed |",
             "|---|---|---|---|---|---|",
             f"| {c.get('whole', 0)} | {c.get('stream', 0)} | {c.get('abandoned', 0)} | {c.get('bad', 0)} | "
             f"{c.get('429', 0)} | {c.get('failed', 0)} |", "",
             f"Server RSS: {result['rss_after_warmup_mib']:.0f} MiB after warm-up, {result['rss_end_mib']:.0f} MiB "
             f"at the end (growth {result['rss_growth_mib']:+.0f} MiB, bound {result['rss_bound_mib']} MiB). Left at "
             f"the end: {result['left_at_end']}.", "",
             "Problems: " + ("none" if not result["problems"] else "; ".join(result["problems"][:20]))]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=15)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96, help="largest max_tokens a request asks for")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-request-bytes", type=int, default=65536)
    p.add_argument("--bad-rate", type=float, default=0.1)
    p.add_argument("--disconnect-rate", type=float, default=0.1)
    p.add_argument("--warmup-s", type=float, default=120, help="RSS growth is counted from this second on")
    p.add_argument("--rss-bound-mib", type=float, default=64)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/soak")
    p.add_argument("server_args", nargs="*", help="more `dspark serve` arguments (after --)")
    args = p.parse_args()
    from dspark.eval.prompts import load_eval_prompts

    prompts = [q for name in ("gsm8k", "humaneval", "mt-bench") for q in load_eval_prompts(name)[:20]]
    with tempfile.TemporaryFile("w+") as log:
        proc, port = start(args, log)
        soak, rss = Soak(port, args, prompts), []
        deadline = time.time() + args.minutes * 60
        threads = [threading.Thread(target=soak.client, args=(i, deadline)) for i in range(args.concurrency)]
        threads.append(threading.Thread(target=sample_rss, args=(proc.pid, deadline, rss)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(2)  # abandoned requests are cancelled at the next step
        left = metrics(port)
        proc.terminate()
        proc.wait(120)
        log.seek(0)
        result = report(args, soak, rss, left, log.read())
    write(args.out, result)
    print(args.out.with_suffix(".md").read_text())
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
