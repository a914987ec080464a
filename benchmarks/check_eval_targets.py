"""The shipped drafter's evaluation against the targets of its release (issue 21), from `dspark eval` runs.

Reads one or more eval output directories (each `results.json` + `journal.jsonl`; the T = 0 and T = 1
runs may be separate) and writes, next to the first, `targets.md` / `targets.json`: every target, the
measured figure, met or missed and by how much; the llama.cpp rows; and the decomposition that says
what limits the speed (speedup = tokens per round / round cost, each measured in the same run).
Calibration is pooled over every verified block of every prompt of the `@full` run (each block
verified whole, so every position is judged), with the temperatures the drafter ships.

    .venv/bin/python benchmarks/check_eval_targets.py benchmarks/results/eval-smollm2-30k/t0 \\
        benchmarks/results/eval-smollm2-30k/t1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspark.eval import metrics
from dspark.eval.evaluate import RunAccumulator
from dspark.util.journal import read_records

SHIPPED = "smollm2-135m-instruct"  # the bundled drafter, every block verified
DEFAULT = SHIPPED + "@dspark"  # the same under the default rule
MATH_CODE = ("gsm8k", "math500", "humaneval", "mbpp")


def load_runs(dirs: list[Path]) -> tuple[dict, dict, dict]:
    """(runs by (drafter, dataset, T), peers by (engine, dataset, T), every generation of the journals by T and drafter)."""
    runs, peers, rounds = {}, {}, {}
    for d in dirs:
        if not (d / "results.json").exists():
            raise SystemExit(f"{d}/results.json not found: run `dspark eval ... --out {d}` to the end first")
        res = json.loads((d / "results.json").read_text())
        runs |= {(r["drafter"], r["dataset"], r["temperature"]): r for r in res["runs"]}
        peers |= {(r["engine"], r["dataset"], r["temperature"]): r for r in res["peers"]}
        records, _ = read_records(d / "journal.jsonl")
        latest = {tuple(rec["key"]): rec["value"] for rec in records[1:]}  # a prompt redone after a kill: its last run
        for (temp, _, _, name), value in latest.items():
            rounds.setdefault((temp, name), RunAccumulator()).add(value)
    return runs, peers, {key: acc.rounds for key, acc in rounds.items()}


def check(name: str, measured: float, op: str, goal: float, unit: str = "") -> dict:
    met = measured >= goal if op == "≥" else measured <= goal
    return {"target": name, "measured": measured, "goal": f"{op} {goal}{unit}", "met": met,
            "by": measured - goal}


def targets(runs: dict, rounds: dict) -> tuple[list[dict], dict]:
    temps = sorted({t for _, _, t in runs})
    out = []
    tau = lambda d, ds, t: runs[(d, ds, t)]["tau"]  # noqa: E731
    if 0.0 in temps:
        out.append(check("τ, T = 0, every block verified: macro", tau(SHIPPED, "macro", 0.0), "≥", 3.0))
        out += [check(f"τ, T = 0: {ds}", tau(SHIPPED, ds, 0.0), "≥", 3.5) for ds in MATH_CODE]
        out.append(check("τ macro over prompt lookup's, T = 0", tau(SHIPPED, "macro", 0.0) / tau("prompt-lookup", "macro", 0.0),
                         "≥", 1.5, "x"))
    for t in temps:
        out.append(check(f"τ macro over DFlash's, T = {t:g}", tau(SHIPPED, "macro", t) / tau("dflash", "macro", t), "≥", 1.15, "x"))
        out.append(check(f"τ macro over EAGLE-3's, T = {t:g}", tau(SHIPPED, "macro", t) / tau("eagle3", "macro", t), "≥", 1.25, "x"))
    speed = lambda ds, t: runs[(DEFAULT, ds, t)]["speedup"]  # noqa: E731
    if 0.0 in temps:
        out += [check(f"speed over AR, default rule, T = 0: {ds}", speed(ds, 0.0), "≥", 2.0, "x") for ds in MATH_CODE]
        out.append(check("speed over AR, default rule, T = 0: mt-bench", speed("mt-bench", 0.0), "≥", 1.3, "x"))
    if 1.0 in temps:
        out += [check(f"speed over AR, default rule, T = 1: {ds}", speed(ds, 1.0), "≥", 1.5, "x") for ds in MATH_CODE]
    calibration = None
    if 0.0 in temps:
        # the temperatures the drafter ships, as each of its dataset rows records them
        temperatures = next(r["calibration"]["temperatures"] for k, r in runs.items() if k[0] == SHIPPED and r["calibration"])
        pooled = rounds[(0.0, SHIPPED)]
        positions = len(runs[(SHIPPED, "macro", 0.0)]["cond_accept"])
        calibration = {"after_sts": metrics.calibration_report(pooled, positions, temperatures),
                       "raw": metrics.calibration_report(pooled, positions, None), "temperatures": temperatures}
        for row in calibration["after_sts"]["per_position"]:
            out.append(check(f"ECE after STS, T = 0, position {row['position']}", 100 * row["ece"], "≤", 2.0, "%"))
        out += [check(f"AUC after STS, T = 0, position {row['position']}", row["auc"], "≥", 0.8)
                for row in calibration["after_sts"]["per_position"]]
    return out, calibration


def speed_rows(runs: dict, peers: dict) -> list[str]:
    lines = ["| T | dataset | AR tok/s | dspark default tok/s (speedup) | every block verified: τ, round cost, speedup "
             "| llama.cpp Q4_1 tok/s | llama.cpp BF16 tok/s | dspark default / llama.cpp Q4_1 |",
             "|---|---|---|---|---|---|---|---|"]
    for (d, ds, t), r in sorted(runs.items(), key=lambda kv: (kv[0][2], kv[0][1] == "macro", kv[0][1])):
        if d != DEFAULT:
            continue
        full = runs[(SHIPPED, ds, t)]
        q4, bf16 = peers.get(("llama.cpp Q4_1", ds, t)), peers.get(("llama.cpp BF16", ds, t))
        cell = lambda p: "–" if p is None else f"{p['decode_tok_s']:.1f}"  # noqa: E731
        ratio = "–" if q4 is None else f"{r['decode_tok_s'] / q4['decode_tok_s']:.2f}x"
        lines.append(f"| {t:g} | {ds} | {r['ar_decode_tok_s']:.1f} | {r['decode_tok_s']:.1f} ({r['speedup']:.2f}x) | "
                     f"{full['tau']:.2f}, {full['round_cost']:.2f}, {full['speedup']:.2f}x | {cell(q4)} | {cell(bf16)} | {ratio} |")
    return lines


def cost_rows(runs: dict) -> list[str]:
    """Per drafter (macro): τ, round cost in AR steps, speedup — and the τ each would need for 2x at its round cost."""
    lines = ["| T | drafter | τ | round cost (AR steps) | speedup | τ for 2.0x at this round cost |", "|---|---|---|---|---|---|"]
    for (d, ds, t), r in sorted(runs.items(), key=lambda kv: (kv[0][2], kv[0][0])):
        if ds == "macro":
            lines.append(f"| {t:g} | {d} | {r['tau']:.2f} | {r['round_cost']:.2f} | {r['speedup']:.2f}x | {2 * r['round_cost']:.2f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path, help="dspark eval output directories (results.json, journal.jsonl)")
    args = ap.parse_args()
    runs, peers, rounds = load_runs(args.dirs)
    checks, calibration = targets(runs, rounds)
    out = args.dirs[0]
    (out / "targets.json").write_text(json.dumps({"targets": checks, "calibration": calibration}, indent=2) + "\n")
    lines = ["# The shipped drafter against its targets", "", "From " + ", ".join(f"`{d}`" for d in args.dirs)
             + " (`benchmarks/check_eval_targets.py`).", "", "| target | goal | measured | met |", "|---|---|---|---|"]
    lines += [f"| {c['target']} | {c['goal']} | {c['measured']:.3g} | {'yes' if c['met'] else 'no'} |" for c in checks]
    lines += ["", "## Speed, side by side (decode tok/s, same prompts, same run)", ""] + speed_rows(runs, peers)
    lines += ["", "## What limits the speed: speedup = τ / round cost (macro)", ""] + cost_rows(runs)
    if calibration:
        lines += ["", "## Calibration at T = 0, pooled over every prompt (raw → STS)", "",
                  "| position | rounds | ECE | AUC |", "|---|---|---|---|"]
        for raw, sts in zip(calibration["raw"]["per_position"], calibration["after_sts"]["per_position"]):
            lines.append(f"| {raw['position']} | {raw['count']} | {100 * raw['ece']:.2f}% → {100 * sts['ece']:.2f}% "
                         f"| {raw['auc']:.3f} → {sts['auc']:.3f} |")
    (out / "targets.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
