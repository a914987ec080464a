"""Fuzz `dspark serve` through the OpenAPI schema it publishes, with schemathesis (issue 48).

Starts the server (embedded SmolLM2 and its shipped drafter, an API key, a short window so that
valid requests stay quick), runs `schemathesis run` on loopback with every check but positive-data
acceptance (whether a prompt's tokens plus its limit fit the window no schema can say), bounded by
--max-examples per operation, and writes what it printed, the server's 5xx count (from its access
log) and whether a traceback was logged to OUT.md. Exit 1 on any failure.

    .venv/bin/python benchmarks/fuzz_server.py --out benchmarks/results/server-fuzz.md
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dspark.util.platform import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_server import free_port, wait_healthy  # noqa: E402

KEY = "sk-fuzz"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-examples", type=int, default=150, help="examples per operation and phase")
    p.add_argument("--seed", type=int, default=48)
    p.add_argument("--max-model-len", type=int, default=192)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/server-fuzz.md")
    p.add_argument("server_args", nargs="*", help="more `dspark serve` arguments (after --)")
    args = p.parse_args()
    port = free_port()
    serve = [sys.executable, "-m", "dspark.cli", "serve", "--port", str(port), "--api-key", KEY, "--max-batch", "4",
             "--max-model-len", str(args.max_model_len), "--log-level", "info", *args.server_args]
    fuzz = [str(Path(sys.executable).with_name("schemathesis")), "run", f"http://127.0.0.1:{port}/openapi.json",
            "--checks", "all", "--exclude-checks", "positive_data_acceptance", "--max-examples",
            str(args.max_examples), "--seed", str(args.seed), "--workers", "2", "--request-timeout", "120",
            "-H", f"Authorization: Bearer {KEY}", "--no-color"]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(serve, stdout=log, stderr=log)
        try:
            wait_healthy(proc, port, "fuzz")
            t0 = time.time()
            done = subprocess.run(fuzz, capture_output=True, text=True, check=False)
            seconds = time.time() - t0
        finally:
            proc.terminate()
            proc.wait(120)
        log.seek(0)
        server_log = log.read()
    statuses = re.findall(r'HTTP/1\.1" (\d{3})', server_log)
    errors = sum(s.startswith("5") and s != "503" for s in statuses)
    at = done.stdout.rfind("\n", 0, done.stdout.rfind("SUMMARY")) + 1  # the start of the SUMMARY line
    summary = done.stdout[at:] if "SUMMARY" in done.stdout else done.stdout[-3000:]
    lines = ["# dspark serve under schemathesis", "",
             f"`{' '.join(sys.argv)}` (schemathesis {version()}; CPU flags: {', '.join(cpu_flags())})", "",
             "Server: `" + " ".join(serve[2:]) + "`", "", "Fuzzer: `" + " ".join(["schemathesis", *fuzz[1:]]) + "`", "",
             f"{len(statuses)} responses in {seconds:.0f} s; 5xx other than 503: {errors}; traceback in the server's "
             f"log: {'yes' if 'Traceback' in server_log else 'no'}; schemathesis exit code {done.returncode}.", "",
             "```", summary.strip(), "```"]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if done.returncode == 0 and errors == 0 and "Traceback" not in server_log else 1


def version() -> str:
    from importlib.metadata import version as v

    return v("schemathesis")


if __name__ == "__main__":
    sys.exit(main())
