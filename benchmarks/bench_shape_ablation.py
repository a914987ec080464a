"""Issue 47, item 3: which DSpark shape to train, by measurement. Each arm changes one thing of the shipped
drafter (configs/dspark-smollm2.toml: 1 layer, Markov rank 32, block 8, one shared projection of 5 tapped
layers): Markov rank 128 / 256, 2 / 3 draft layers, block 16, DFlare's layer-wise fusion of 9 tapped layers.
All arms train from scratch on the same batches for the same steps (one joint run, one target pass a step),
then a full-block draft pass of each arm's shape is timed round-robin beside the target's forwards (bf16 where
the CPU has it; freshly initialised drafters: latency does not depend on the weights). The judge is what a round gains against what it costs:

    est. speedup = E[τ] · t(1-token forward) / (t(γ+1-token forward) + t(draft pass))

with E[τ] the validation expected accepted length at T = 0 (and T = 1) over the arm's own block.

    python benchmarks/bench_shape_ablation.py --runs runs/shape-ablation --steps 450 [--resume]
    python benchmarks/bench_shape_ablation.py --runs runs/shape-ablation --steps 450 --report-only

Writes RESULTS/NAME.{json,md,png} (NAME default shape_ablation) (default benchmarks/results/ablations); the runs (final
drafters, logs, resume checkpoints) stay in RUNS.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from ablation import ROOT, arm_config, train_arms, validations
from bench_draft_vocab import DATA, draft_pass_latency, drafter_for

from dspark.model.loading import load_target
from dspark.train.data import load_samples
from dspark.util.platform import cpu_flags

ARMS = {  # arm -> (shipped config, what the arm changes in it)
    "shipped": ("dspark", {}),
    "rank128": ("dspark", {"markov_rank": 128}),
    "rank256": ("dspark", {"markov_rank": 256}),
    "layers2": ("dspark", {"layers": 2}),
    "layers3": ("dspark", {"layers": 3}),
    "block16": ("dspark", {"block_size": 16}),
    "layerwise": ("dspark", {"context_fusion": "layerwise"}),
    "noconf": ("dspark", {"conf_weight": 0.0}),  # item 1: no confidence BCE at all
    "confalone": ("dspark", {"conf_into_backbone": False}),  # item 1: the BCE trains the confidence head alone
    "dflash": ("dflash", {}),  # item 1: the DFlash baseline at the same budget
}


def configs(runs: Path, arms: list[str], steps: int, batch: int, anchors: int, common: dict) -> list[Path]:
    return [arm_config(runs, arm, ARMS[arm][0], steps=steps, batch_size=batch, anchors_per_seq=anchors,
                       eval_every=max(1, steps // 6), checkpoint_every=25, **{**common, **ARMS[arm][1]})
            for arm in arms]


def curves(runs: Path, arms: list[str]) -> dict:
    out = {}
    for arm in arms:
        vals = validations(runs / arm)
        out[arm] = {"step": [v["step"] for v in vals],
                    "tau_t0": [v["val"]["expected_tau_greedy"] for v in vals],
                    "tau_t1": [v["val"]["expected_tau"] for v in vals],
                    "alpha_t0": vals[-1]["val"]["alpha_greedy"], "alpha_t1": vals[-1]["val"]["alpha"]}
    return out


def shape(arm: str) -> dict:
    """`drafter_for`'s arguments for the arm's drafter shape."""
    shipped, overrides = ARMS[arm]
    return {"layers": overrides.get("layers", 1), "rank": overrides.get("markov_rank", 32),
            "block": overrides.get("block_size", 8), "fusion": overrides.get("context_fusion", "shared"),
            "head": "none" if shipped == "dflash" else "vanilla"}


def costs(arms: list[str], reps: int) -> dict:
    """Median ms of a full-block pass (T = 0 / T = 1) of each arm's drafter shape, and of the target's
    forwards. A pass's latency does not depend on the weights: the drafters are freshly initialised, so
    the measurement runs on its own, with nothing else on the CPU."""
    target = load_target(None, dtype="auto")
    replies = [s.response_ids for s in load_samples(DATA)]  # picks the K draft tokens; latency is the same
    drafters = {arm: drafter_for(target, 8192, replies, **shape(arm)) for arm in arms}
    sizes = sorted({1} | {d.block_size + 1 for d in drafters.values()})
    ms = draft_pass_latency(target, drafters, reps, forwards=sizes)
    params = {arm: sum(p.numel() for p in d.model.parameters()) / 1e6 for arm, d in drafters.items()}
    return {"precision": target.model.precision, "ms": ms, "params_m": params}


def judge(curve: dict, cost: dict, arms: list[str]) -> dict:
    ms, rows = cost["ms"], {}
    one = ms["target 1-token forward"]
    for arm in arms:
        block = len(curve[arm]["alpha_t0"])
        verify = ms[f"target {block + 1}-token forward"]
        row = {"block": block, "tau_t0": curve[arm]["tau_t0"][-1], "tau_t1": curve[arm]["tau_t1"][-1]}
        for t in ("t0", "t1"):
            draft = ms[f"draft {arm} T={t[1]}"]
            row[f"draft_ms_{t}"] = draft
            row[f"est_speedup_{t}"] = row[f"tau_{t}"] * one / (verify + draft)
        rows[arm] = dict(row, verify_ms=verify, params_m=cost["params_m"][arm])
    return rows


def plot(curve: dict, rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm, c in curve.items():
        line, = a.plot(c["step"], c["tau_t0"], marker="o", ms=3, label=f"{arm} T=0")
        a.plot(c["step"], c["tau_t1"], ls="--", color=line.get_color())
        b.scatter(rows[arm]["draft_ms_t0"], rows[arm]["tau_t0"], color=line.get_color())
        b.annotate(arm, (rows[arm]["draft_ms_t0"], rows[arm]["tau_t0"]), fontsize=8)
    a.set(xlabel="step", ylabel="validation expected τ (solid T=0, dashed T=1)", title="DSpark shape ablation")
    a.legend(fontsize=7)
    b.set(xlabel="draft pass, ms (T=0)", ylabel="final expected τ (T=0)", title="what a round gains vs costs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(rows: dict, cost: dict, command: str) -> str:
    machine = (f"CPU flags {' '.join(cpu_flags())}, 2 threads, drafters timed in {cost['precision']}; target "
               f"1-token forward {cost['ms']['target 1-token forward']:.1f} ms.")
    lines = [f"Command: `{command}`", "", machine, "",
             "| arm | block | params (M) | τ T=0 | τ T=1 | draft ms T=0 / T=1 | verify ms | est. speedup T=0 / T=1 |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, r in rows.items():
        lines.append(f"| {arm} | {r['block']} | {r['params_m']:.1f} | {r['tau_t0']:.3f} | {r['tau_t1']:.3f} "
                     f"| {r['draft_ms_t0']:.1f} / {r['draft_ms_t1']:.1f} | {r['verify_ms']:.1f} "
                     f"| {r['est_speedup_t0']:.2f} / {r['est_speedup_t1']:.2f} |")
    return "\n".join(lines) + "\n"


def _option(item: str) -> tuple[str, object]:
    key, _, value = item.partition("=")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, required=True, help="directory of the arms' runs (not committed)")
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "ablations")
    ap.add_argument("--name", default="shape_ablation", help="results file stem (a second run keeps the first's)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {', '.join(ARMS)}")
    ap.add_argument("--steps", type=int, default=450, help="optimiser steps of every arm")
    ap.add_argument("--batch", type=int, default=8, help="replies a step")
    ap.add_argument("--anchors", type=int, default=32, help="anchors sampled per reply")
    ap.add_argument("--reps", type=int, default=30, help="timed rounds of the cost measurement")
    ap.add_argument("--resume", action="store_true", help="continue the runs in RUNS")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a training option for every arm (JSON value, else a string), e.g. --set target_dtype=auto")
    ap.add_argument("--report-only", action="store_true",
                    help="train no more: measure costs and report the runs' last validations (a stopped run's too)")
    args = ap.parse_args()
    arms = args.arms.split(",")
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        ap.error(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")
    if not args.report_only:
        common = dict(_option(item) for item in args.set)
        train_arms(configs(args.runs, arms, args.steps, args.batch, args.anchors, common), args.resume)
    torch.set_num_threads(2)
    curve, cost = curves(args.runs, arms), costs(arms, args.reps)
    rows = judge(curve, cost, arms)
    command = "python benchmarks/bench_shape_ablation.py " + " ".join(sys.argv[1:])
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{args.name}.json").write_text(json.dumps(
        {"command": command, "machine": {"flags": cpu_flags(), "threads": 2}, "cost_ms": cost, "arms": rows,
         "curves": curve}, indent=1) + "\n")
    (args.results / f"{args.name}.md").write_text(markdown(rows, cost, command))
    plot(curve, rows, args.results / f"{args.name}.png")
    print(markdown(rows, cost, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
