"""The evaluation's report: results.json, report.md (tables per temperature, peers beside) and plots."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from dspark.eval.plots import plot_eval


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    cfg = results["config"]
    lines = ["# dspark eval", "",
             f"Datasets {cfg['datasets']} (prompts each), {cfg['max_new_tokens']} new tokens, seed {cfg['seed']}, "
             f"confidence threshold {cfg['confidence_threshold']}. Every drafter and plain AR ran the same prompts "
             "in rotating order; speedup = decode tok/s over AR's on the same prompts in the same run; round cost = "
             "seconds per draft-and-verify round in AR decode steps (speedup = tokens per round / round cost).",
             _machine_line(cfg.get("machine")), ""]
    for temp in cfg["temperatures"]:
        lines += [f"## T = {temp}", "",
                  "| drafter | dataset | τ | drafts / round | verify eff. | decode tok/s | AR tok/s | speedup | round cost "
                  "| ECE raw → STS | AUC raw → STS | Brier raw → STS | vocab coverage |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["runs"]:
            if r["temperature"] != temp:
                continue
            cal = _calibration_cells(r["calibration"])
            name = f"**{r['dataset']}**" if r["dataset"] == "macro" else r["dataset"]
            coverage = "–" if r.get("vocab_coverage") is None else f"{r['vocab_coverage']:.1%}"
            drafts = "–" if r.get("drafts_per_round") is None else f"{r['drafts_per_round']:.1f}"
            lines.append(f"| {r['drafter']} | {name} | {r['tau']:.2f} | {drafts} | {r['verify_efficiency']:.2f} | "
                         f"{r['decode_tok_s']:.1f} | {r['ar_decode_tok_s']:.1f} | {r['speedup']:.2f}x | {r['round_cost']:.2f} | {cal} "
                         f"| {coverage} |")
        lines += ["", "Conditional acceptance by block position (macro average):", "",
                  "| drafter | " + " | ".join(f"k={k}" for k in range(_max_positions(results, temp))) + " |",
                  "|---|" + "---|" * _max_positions(results, temp)]
        for r in results["runs"]:
            if r["temperature"] == temp and r["dataset"] == "macro":
                lines.append(f"| {r['drafter']} | " + " | ".join("–" if v is None else f"{v:.2f}"
                                                               for v in r["cond_accept"]) + " |")
        lines.append("")
        lines += _peer_lines(results, temp)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    plot_eval(results, out)


def _machine_line(machine: dict | None) -> str:
    if not machine:
        return ""
    line = (f"Machine: {machine['threads']} threads, CPU flags {' '.join(machine['cpu_flags']) or 'none of note'}, "
            f"target dtype {machine['dtype']}.")
    by_flags = machine.get("generations_by_cpu_flags", {})
    if len(by_flags) > 1:  # resumed across machines: the speed figures mix them
        line += " Generations by the CPU flags of the machine that ran them: " + "; ".join(
            f"{flags or 'none of note'}: {n}" for flags, n in sorted(by_flags.items(), key=lambda kv: -kv[1])) + "."
    return line


def _peer_lines(results: dict, temp: float) -> list[str]:
    """Other engines' plain decoding on the same prompts, and each drafter's speed over theirs."""
    peers = [r for r in results.get("peers", []) if r["temperature"] == temp]
    if not peers:
        return []
    lines = ["Other engines, plain decoding (same prompts, same rotation):", "",
             "| engine | dataset | decode tok/s | dspark AR tok/s | over dspark AR |", "|---|---|---|---|---|"]
    for r in peers:
        name = f"**{r['dataset']}**" if r["dataset"] == "macro" else r["dataset"]
        lines.append(f"| {r['engine']} | {name} | {r['decode_tok_s']:.1f} | {r['ar_decode_tok_s']:.1f} "
                     f"| {r['speedup']:.2f}x |")
    rows = {(r["drafter"], r["dataset"]): r for r in results["runs"] if r["temperature"] == temp}
    drafters = [r["drafter"] for r in results["runs"] if r["temperature"] == temp and r["dataset"] == "macro"]
    engines = [r["engine"] for r in peers if r["dataset"] == "macro"]
    lines += ["", "Decode tok/s over the other engine's, mean over the datasets:", "",
              "| | " + " | ".join(f"over {e}" for e in engines) + " |", "|---|" + "---|" * len(engines),
              "| dspark AR | " + " | ".join(f"{_mean_ratio(peers, e, lambda r: r['ar_decode_tok_s']):.2f}x"
                                           for e in engines) + " |"]
    for d in drafters:
        speed = lambda r, d=d: rows[(d, r["dataset"])]["decode_tok_s"]  # noqa: E731
        lines.append(f"| {d} | " + " | ".join(f"{_mean_ratio(peers, e, speed):.2f}x" for e in engines) + " |")
    return lines + [""]


def _mean_ratio(peers: list[dict], engine: str, speed) -> float:
    per_ds = [speed(r) / r["decode_tok_s"] for r in peers if r["engine"] == engine and r["dataset"] != "macro"
              and r["decode_tok_s"]]
    return statistics.fmean(per_ds) if per_ds else 0.0


def _calibration_cells(calibration: dict | None) -> str:
    """'raw → STS' per metric: the confidence head before and after its fitted temperatures."""
    if not calibration:
        return "– | – | –"
    raw = calibration["uncalibrated"]
    return " | ".join(f"{raw[k]:.3f} → {calibration[k]:.3f}" for k in ("ece", "auc", "brier"))


def _max_positions(results, temp) -> int:
    return max((len(r["cond_accept"]) for r in results["runs"] if r["temperature"] == temp), default=0)
