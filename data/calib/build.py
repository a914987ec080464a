"""Rebuild prompts.jsonl: held-out calibration prompts for `dspark calibrate`.

Training prompts that the regenerated training data can never contain (positions 3000+ of the
same seed-0 shuffle that `dspark data regenerate --shuffle 0 --limit 3000` uses) and whose text is
in none of the evaluation sets. Run from the repository root: python data/calib/build.py
"""

import json
import random
from pathlib import Path

from dspark.eval.runner import default_datasets, load_eval_prompts
from dspark.train.data import load_prompts

COUNT, FIRST = 64, 3000

prompts = load_prompts("data/train/prompts.jsonl")
random.Random(0).shuffle(prompts)
evaluation = {p.strip() for d in default_datasets() for p in load_eval_prompts(d)}
held_out = [p for p in prompts[FIRST:] if p.text.strip() not in evaluation][:COUNT]
with open(Path(__file__).parent / "prompts.jsonl", "w", encoding="utf-8") as f:
    for p in held_out:
        f.write(json.dumps({"id": p.id, "turns": [p.text]}) + "\n")
print(f"wrote {len(held_out)} prompts")
