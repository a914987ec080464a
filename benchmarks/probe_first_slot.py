"""Issue 47, item 1: what the DSpark drafter's heads contribute at each block slot, measured on the held-out
validation set exactly as training validates (teacher-forced, every anchor, T = 1 acceptance 1 − TV and
T = 0 acceptance argmax = the target's argmax).

Variants of the same trained weights: the DSpark drafter as shipped; its backbone alone (the Markov bias
dropped at every slot); the bias dropped at slot 0 only; and the DFlash drafter trained beside it.

    python benchmarks/probe_first_slot.py --out benchmarks/results/ablations/first_slot_probe

Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import torch
from ablation import ROOT

from dspark.draft.dspark import DSparkModel
from dspark.train.config import load_config
from dspark.train.trainer import Trainer
from dspark.util.platform import cpu_flags


@contextlib.contextmanager
def markov_bias_at(model: DSparkModel, slots: str):
    """Within the block, apply the Markov bias at "all" slots (as trained), "none", or all "but0"."""
    head, original = model.markov_head, model.apply_heads
    if slots == "none":
        model.markov_head = None
    elif slots == "but0":
        def apply_heads(h, base, prev):
            logits, conf = original(h, base, prev)
            logits[..., 0, :] = base[..., 0, :]
            return logits, conf
        model.apply_heads = apply_heads
    try:
        yield
    finally:
        model.markov_head = head
        model.apply_heads = original


def validate(name: str, out: Path) -> Trainer:
    cfg = load_config(ROOT / f"configs/{name}-smollm2.toml",
                      [f"init={ROOT}/checkpoints/smollm2-bf16/{name}/final", f"out={out / name}",
                       f"data={ROOT}/data/regen/smollm2-train", f"val_data={ROOT}/data/regen/val-smollm2-t0"])
    return Trainer(cfg, progress=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="OUT.json / OUT.md")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        dspark = validate("dspark", Path(tmp))
        dspark.model.confidence_head = None  # it reads W1[prev], gone without the head; logits never read it
        for variant in ("all", "none", "but0"):
            with markov_bias_at(dspark.model, variant):
                rows[f"dspark, Markov bias at slots: {variant}"] = dspark.validate()
        rows["dflash"] = validate("dflash", Path(tmp)).validate()
    keep = ("alpha", "alpha_greedy", "expected_tau", "expected_tau_greedy")
    rows = {k: {f: v[f] for f in keep} for k, v in rows.items()}
    command = "python benchmarks/probe_first_slot.py " + " ".join(sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"command": command, "cpu_flags": cpu_flags(),
                                                         "variants": rows}, indent=1) + "\n")
    lines = [f"Command: `{command}`", "", "Per-slot acceptance on the validation set (T = 0 | T = 1):", "",
             "| variant | " + " | ".join(f"k={k}" for k in range(8)) + " | E[τ] T=0 / T=1 |",
             "|---|" + "---|" * 9]
    for name, r in rows.items():
        cells = " | ".join(f"{g:.3f} \\| {a:.3f}" for g, a in zip(r["alpha_greedy"], r["alpha"]))
        lines.append(f"| {name} | {cells} | {r['expected_tau_greedy']:.3f} / {r['expected_tau']:.3f} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
