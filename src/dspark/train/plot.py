"""Training curves: loss terms and validation acceptance, as a PNG."""

from __future__ import annotations

import json
from pathlib import Path

from dspark.util.plotting import pyplot


def plot_training(log_path: str | Path, png_path: str | Path) -> None:
    plt = pyplot()

    train, val = [], []
    for line in Path(log_path).read_text().splitlines():
        rec = json.loads(line)
        (val if "val" in rec else train).append(rec)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    for key in ("loss", "ce", "tv", "conf"):
        if train and any(r[key] for r in train):
            ax.plot([r["step"] for r in train], [r[key] for r in train], label=f"train {key}", lw=0.8)
    for key in ("loss",):
        if val:
            ax.plot([r["step"] for r in val], [r["val"][key] for r in val], "o-", label=f"val {key}")
    ax.set_xlabel("step")
    ax.set_title("losses")
    ax.legend()
    ax = axes[1]
    if val:
        ax.plot([r["step"] for r in val], [r["val"]["expected_tau"] for r in val], "o-")
    ax.set_xlabel("step")
    ax.set_title("validation expected τ = 1 + Σ_k Π_{i≤k} α_i")
    ax = axes[2]
    if val:
        for rec in (val[0], val[-1]) if len(val) > 1 else val[:1]:
            ax.plot(range(len(rec["val"]["alpha"])), rec["val"]["alpha"], "o-", label=f"step {rec['step']}")
        ax.legend()
    ax.set_xlabel("block position k")
    ax.set_title("validation acceptance α_k = 1 − ½‖p_d − p_t‖₁")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
