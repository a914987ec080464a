"""This tree's draft pass against a baseline git revision's (issue 20 (a)): the shipped drafter shape
(1 layer, Markov rank 32, block 8, K = 8192) drafting a full block at T = 0 and T = 1, next to a 1- and
a 9-token target forward, each pass right after an untimed 9-token target forward.

Both sides run the same measuring code (`bench_draft_vocab.draft_pass_latency`, this tree's) in child
processes that import `dspark` from either tree (the baseline checked out with `git worktree`), one
process at a time, baseline and current alternating for --rounds rounds; each side's figure is the
median over its rounds of each round's medians.

    .venv/bin/python benchmarks/bench_draft_pass_ab.py --baseline 6650389 --out benchmarks/results/draft_pass_ab
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(reps: int, k: int) -> None:
    import torch
    from bench_draft_vocab import DATA, draft_pass_latency, drafter_for

    import dspark
    from dspark.model.loading import load_target
    from dspark.train.data import load_samples

    torch.set_num_threads(2)
    target = load_target(None, dtype="auto")
    drafter = drafter_for(target, k, [s.response_ids for s in load_samples(DATA)])
    latency = draft_pass_latency(target, {"shipped shape": drafter}, reps)
    print(json.dumps({"dspark": str(Path(dspark.__file__).parent), "precision": target.model.precision,
                      "ms": latency}))


def run_side(tree: Path, reps: int, k: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    out = subprocess.run([sys.executable, __file__, "--child", "--reps", str(reps), "--k", str(k)], env=env,
                         check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if not result["dspark"].startswith(str(tree)):
        raise SystemExit(f"the child imported dspark from {result['dspark']}, not from {tree}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="git revision to compare against (required unless --child)")
    ap.add_argument("--rounds", type=int, default=3, help="processes per side, alternating")
    ap.add_argument("--reps", type=int, default=30, help="timed rounds inside each process")
    ap.add_argument("--k", type=int, default=8192, help="draft vocabulary")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "draft_pass_ab"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.reps, args.k)
    if not args.baseline:
        ap.error("--baseline REV is required (e.g. --baseline HEAD~1)")
    from dspark.util.platform import cpu_flags

    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline], check=True,
                         capture_output=True, text=True).stdout.strip()
    runs: dict[str, list[dict]] = {"baseline": [], "current": []}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(base), rev], check=True)
        try:
            for r in range(args.rounds):
                for side in (("baseline", "current") if r % 2 == 0 else ("current", "baseline")):
                    tree = base if side == "baseline" else ROOT
                    runs[side].append(run_side(tree, args.reps, args.k)["ms"])
                    print(f"round {r + 1}/{args.rounds} {side}: {json.dumps(runs[side][-1])}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=True)
    medians = {side: {job: statistics.median(run[job] for run in rs) for job in rs[0]} for side, rs in runs.items()}
    one = {side: m["target 1-token forward"] for side, m in medians.items()}
    report = {"command": f"benchmarks/bench_draft_pass_ab.py --baseline {args.baseline} --rounds {args.rounds} "
                         f"--reps {args.reps} --k {args.k}",
              "baseline": rev, "machine": {"flags": cpu_flags(), "threads": 2},
              "median_ms": medians,
              "over_one_token_step": {side: {j: v / one[side] for j, v in m.items() if j.startswith("draft")}
                                      for side, m in medians.items()},
              "current_over_baseline": {j: medians["current"][j] / medians["baseline"][j] for j in medians["current"]},
              "rounds_ms": runs}
    Path(args.out).with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("over_one_token_step", "current_over_baseline")}, indent=1))


if __name__ == "__main__":
    main()
