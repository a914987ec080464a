"""Training ablations as one joint `dspark train` run: arms written as configs from a shipped one plus
overrides, trained on the same batches with one target pass a step, their validation read back."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def arm_config(out: Path, arm: str, shipped: str, **overrides) -> Path:
    """OUT/configs/ARM.toml: configs/SHIPPED-smollm2.toml (flattened, paths made absolute) with `overrides`,
    training into OUT/ARM."""
    flat: dict = {}
    for key, value in tomllib.loads((ROOT / f"configs/{shipped}-smollm2.toml").read_text()).items():
        flat.update(value if isinstance(value, dict) else {key: value})
    flat.update(data=str(ROOT / flat["data"]), val_data=str(ROOT / flat["val_data"]), out=str(out / arm))
    flat.update(overrides)
    path = out / "configs" / f"{arm}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in flat.items()))
    return path


def train_arms(configs: list[Path], resume: bool) -> None:
    """`dspark train` over the configs (two or more at once: one target pass a step); --resume continues them."""
    cmd = [sys.executable, "-m", "dspark.cli", "train", *(x for c in configs for x in ("--config", str(c)))]
    subprocess.run(cmd + (["--resume"] if resume else []), check=True)


def validations(run: Path) -> list[dict]:
    """The run's validation records, in step order: {"step", "val": {...}}."""
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return [r for r in records if "val" in r]
