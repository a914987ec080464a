"""Evaluation plots: conditional acceptance, reliability diagrams, confidence-threshold sweep."""

from __future__ import annotations

import statistics
from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
        positions = len(runs[0]["calibration"]["per_position"])
        fig, axes = plt.subplots(1, positions, figsize=(2.6 * positions, 2.9), squeeze=False, sharey=True)
        for k, ax in enumerate(axes[0]):
            for label, key, style in (("raw", "uncalibrated", "x--"), ("STS", None, "o-")):
                pts = []
                for r in runs:
                    cal = r["calibration"][key] if key else r["calibration"]
                    pts += cal["per_position"][k]["bins"]
                pts.sort(key=lambda b: b["score"])
                if pts:
                    ax.plot([b["score"] for b in pts], [b["accept"] for b in pts], style, ms=3, lw=0.8, label=label)
            ax.plot([0, 1], [0, 1], color="grey", lw=0.5)
            ax.set(title=f"k = {k}", xlabel="predicted survival", xlim=(0, 1), ylim=(0, 1))
        axes[0][0].set_ylabel("observed prefix acceptance")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"reliability of the prefix-survival product: {name} (all datasets and temperatures)")
        fig.tight_layout()
        fig.savefig(out / f"reliability_{name}.png", dpi=110)
        plt.close(fig)

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
