"""Issue 47, item 1: is the DSpark drafter's first-slot deficit at T = 0 a fault of its path or of its loss?

The shipped DSpark drafter trains on DeepSpec's DSpark loss (0.1 CE + 0.9 L1 to the target's distribution),
its DFlash baseline on DeepSpec's DFlash loss (CE on the regenerated token). This continues both finished
drafters (`checkpoints/smollm2-bf16/{dspark,dflash}/final`) for the same steps on the same batches, each
under its own loss and under the other's (four arms, one joint run sharing the target's pass), and reports
the validation acceptance of block slot 0 at T = 0 (the draft's argmax is the target's) and at T = 1
(1 − TV) before and after. If the loss decides slot 0, each drafter moves toward the other's slot-0 profile
when given the other's loss, and the control arms stay put. A fifth arm (`--arms dspark-kd-noconf`, trained
alone on the same batches) keeps DSpark's loss without the confidence head's BCE, whose gradient reaches
the backbone.

    python benchmarks/bench_loss_swap.py --out /tmp/loss-swap [--steps 200] [--resume]
    python benchmarks/bench_loss_swap.py --out /tmp/loss-swap --arms dspark-kd-noconf

Writes OUT/loss_swap.json and OUT/loss_swap.md (the runs' logs stay in OUT/<arm>/log.jsonl).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ablation import ROOT, arm_config, train_arms, validations

ARMS = {  # arm -> (shipped config, loss, overrides)
    "dspark-kd": ("dspark", "kd", {}),
    "dspark-ce": ("dspark", "ce", {}),
    "dflash-ce": ("dflash", "ce", {}),
    "dflash-kd": ("dflash", "kd", {}),
    "dspark-kd-noconf": ("dspark", "kd", {"conf_weight": 0.0}),  # the confidence head's BCE off the backbone
}


def write_config(arm: str, out: Path, steps: int, lr: float, anchors: int) -> Path:
    name, loss, overrides = ARMS[arm]
    return arm_config(out, arm, name, init=str(ROOT / f"checkpoints/smollm2-bf16/{name}/final"), loss=loss,
                      steps=steps, lr=lr, warmup_frac=0.0, anchors_per_seq=anchors, seed=1, eval_every=steps // 2,
                      checkpoint_every=25, **overrides)


def summarize(out: Path) -> dict:
    rows = {}
    for arm in (a for a in ARMS if (out / a / "log.jsonl").is_file()):
        vals = validations(out / arm)
        first, last = vals[0]["val"], vals[-1]["val"]
        rows[arm] = {"steps": vals[-1]["step"],
                     **{f"{k}_{when}": v[k] for when, v in (("before", first), ("after", last))
                        for k in ("alpha", "alpha_greedy", "expected_tau", "expected_tau_greedy")}}
    return rows


def markdown(rows: dict, command: str) -> str:
    header = ("| arm | slot 0 T=0 before → after | slot 0 T=1 before → after | slots 1-7 T=0 mean after "
              "| expected τ T=0 before → after | expected τ T=1 before → after |")
    lines = [f"Command: `{command}`", "", header, "|---|---|---|---|---|---|"]
    for arm, r in rows.items():
        later = sum(r["alpha_greedy_after"][1:]) / (len(r["alpha_greedy_after"]) - 1)
        lines.append(f"| {arm} | {r['alpha_greedy_before'][0]:.3f} → {r['alpha_greedy_after'][0]:.3f} "
                     f"| {r['alpha_before'][0]:.3f} → {r['alpha_after'][0]:.3f} | {later:.3f} "
                     f"| {r['expected_tau_greedy_before']:.3f} → {r['expected_tau_greedy_after']:.3f} "
                     f"| {r['expected_tau_before']:.3f} → {r['expected_tau_after']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory of the four runs and the summary")
    ap.add_argument("--steps", type=int, default=200, help="optimiser steps of every arm (4 replies each)")
    ap.add_argument("--lr", type=float, default=2e-4, help="peak learning rate (cosine to 0, no warm-up)")
    ap.add_argument("--anchors", type=int, default=128, help="anchors sampled per reply")
    ap.add_argument("--arms", default="dspark-kd,dspark-ce,dflash-ce,dflash-kd",
                    help=f"comma-separated arms to train (of {', '.join(ARMS)}); the summary covers every arm in OUT")
    ap.add_argument("--resume", action="store_true", help="continue the runs in OUT")
    args = ap.parse_args()
    arms = args.arms.split(",")
    if set(arms) - set(ARMS):
        ap.error(f"unknown arms {sorted(set(arms) - set(ARMS))}; choose from {', '.join(ARMS)}")
    train_arms([write_config(arm, args.out, args.steps, args.lr, args.anchors) for arm in arms], args.resume)
    rows = summarize(args.out)
    command = "python benchmarks/bench_loss_swap.py " + " ".join(sys.argv[1:])
    (args.out / "loss_swap.json").write_text(json.dumps({"command": command, "arms": rows}, indent=1))
    (args.out / "loss_swap.md").write_text(markdown(rows, command))
    print(markdown(rows, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
