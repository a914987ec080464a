"""Evaluation plots: conditional acceptance, reliability diagrams, confidence-threshold sweep."""

from __future__ import annotations

import statistics
from pathlib import Path

from dspark.eval.metrics import CALIBRATION_BINS
from dspark.util.plotting import pyplot


def _plt():
    plt = pyplot()

    return plt


MIN_BIN_COUNT = 10  # reliability points from fewer rounds are noise


def _pooled_bins(calibrations: list[dict], k: int) -> list[tuple[float, float, int]]:
    """Position k's reliability bins (metrics.reliability_bins) merged over datasets, weighted by count:
    (mean score, observed acceptance, rounds) for bins with at least MIN_BIN_COUNT rounds."""
    pooled: dict[int, list[float]] = {}
    for cal in calibrations:
        for b in cal["per_position"][k]["bins"]:
            bin_index = min(int(b["score"] * CALIBRATION_BINS), CALIBRATION_BINS - 1)
            acc = pooled.setdefault(bin_index, [0, 0.0, 0.0])
            acc[0] += b["count"]
            acc[1] += b["score"] * b["count"]
            acc[2] += b["accept"] * b["count"]
    return [(s / n, a / n, n) for _, (n, s, a) in sorted(pooled.items()) if n >= MIN_BIN_COUNT]


def _plot_reliability(plt, name: str, runs: list[dict], temps: list[float], out: Path) -> None:
    """One row per temperature, one panel per block position with data; raw and STS-calibrated."""
    positions = len(runs[0]["calibration"]["per_position"])
    raw, sts = {}, {}  # (temperature, position) -> pooled bins
    for temp in temps:
        cals = [r["calibration"] for r in runs if r["temperature"] == temp]
        for k in range(positions):
            raw[temp, k] = _pooled_bins([c["uncalibrated"] for c in cals], k)
            sts[temp, k] = _pooled_bins(cals, k)
    shown = [k for k in range(positions) if any(sts[t, k] for t in temps)] or [0]
    fig, axes = plt.subplots(len(temps), len(shown), figsize=(2.8 * len(shown), 2.9 * len(temps)),
                             squeeze=False, sharex=True, sharey=True)
    for row, temp in zip(axes, temps):
        for ax, k in zip(row, shown):
            for label, pts, style in (("raw", raw[temp, k], "x--"), ("STS", sts[temp, k], "o-")):
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, ms=3, lw=0.8, label=label)
            ax.plot([0, 1], [0, 1], color="grey", lw=0.5)
            n = sum(p[2] for p in sts[temp, k])
            ax.set(title=f"T = {temp}, k = {k} ({n} rounds)", xlim=(0, 1), ylim=(0, 1))
            ax.title.set_fontsize(9)
        row[0].set_ylabel("observed prefix acceptance")
    for ax in axes[-1]:
        ax.set_xlabel("predicted survival")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"reliability of the prefix-survival product: {name}\n"
                 f"(all datasets pooled; bins with >= {MIN_BIN_COUNT} rounds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / f"reliability_{name}.png", dpi=110)
    plt.close(fig)


def plot_eval(results: dict, out: Path) -> None:
    plt = _plt()
    temps = results["config"]["temperatures"]
    macro = [r for r in results["runs"] if r["dataset"] == "macro"]

    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        for r in (r for r in macro if r["temperature"] == temp):
            ks = [k for k, v in enumerate(r["cond_accept"]) if v is not None]
            ax.plot(ks, [r["cond_accept"][k] for k in ks], "o-", label=f"{r['drafter']} (τ {r['tau']:.2f})")
        ax.set(title=f"conditional acceptance, T = {temp}", xlabel="block position k",
               ylabel="P(accept k | 0..k-1 accepted)", ylim=(0, 1))
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "cond_accept.png", dpi=110)
    plt.close(fig)

    calibrated = [r for r in results["runs"] if r["calibration"] and r["dataset"] != "macro"]
    if not calibrated:
        return
    for name in sorted({r["drafter"] for r in calibrated}):
        runs = [r for r in calibrated if r["drafter"] == name]
        _plot_reliability(plt, name, runs, temps, out)

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for temp in temps:
            sweeps = [r["calibration"]["threshold_sweep"] for r in runs if r["temperature"] == temp]
            if not sweeps:
                continue
            th = [p["threshold"] for p in sweeps[0]]
            for ax, key in zip(axes, ("tokens_per_step", "acceptance_rate")):
                vals = [statistics.fmean(s[i][key] for s in sweeps if i < len(s)) for i in range(len(th))]
                ax.plot(th, vals, "o-", ms=3, label=f"T = {temp}")
        axes[0].set(title=f"{name}: tokens committed per step", xlabel="confidence threshold C")
        axes[1].set(title=f"{name}: acceptance rate of verified drafts", xlabel="confidence threshold C")
        for ax in axes:
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"threshold_sweep_{name}.png", dpi=110)
        plt.close(fig)
