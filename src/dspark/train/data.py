"""Prompt sets and regenerated training data.

Prompt files are JSONL in any of three common shapes, normalised to a list of user turns:
  * dspark / DeepSpec:   {"id": ..., "turns": ["user message", ...]}
  * ShareGPT:            {"id": ..., "conversations": [{"from": "human", "value": ...}, ...]}
  * Alpaca:              {"instruction": ..., "input": ...}
Only the first user turn is used for regeneration (the target writes its own replies).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from pathlib import Path

from dspark.errors import DsparkError
from dspark.util.jsonl import read_jsonl

_USER_ROLES = ("human", "user")


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: str
    text: str  # first user turn


def _user_text(obj: dict) -> str | None:
    if isinstance(obj.get("turns"), list) and obj["turns"]:
        return obj["turns"][0]
    if isinstance(obj.get("conversations"), list):
        for turn in obj["conversations"]:
            if isinstance(turn, dict) and turn.get("from", turn.get("role")) in _USER_ROLES:
                return turn.get("value", turn.get("content"))
        return None
    if "instruction" in obj:
        extra = obj.get("input") or ""
        return f"{obj['instruction']}\n\n{extra}" if extra.strip() else obj["instruction"]
    return None


def load_prompts(path: str | Path) -> list[Prompt]:
    """Read a prompt file, dropping exact duplicates (same normalised text); ids default to
    `<file stem>-<line>`."""
    prompts, seen = [], set()
    path = Path(path).expanduser()
    for lineno, obj in read_jsonl(path):
        text = _user_text(obj)
        if not isinstance(text, str) or not text.strip():
            raise DsparkError(
                f"{path}:{lineno}: no user prompt found; expected 'turns', ShareGPT 'conversations' "
                "or Alpaca 'instruction'"
            )
        key = " ".join(text.split()).lower()
        if key in seen:
            continue
        seen.add(key)
        prompts.append(Prompt(str(obj.get("id", f"{path.stem}-{lineno}")), text))
    if not prompts:
        raise DsparkError(f"{path} holds no prompts")
    return prompts


def is_validation(prompt_id: str, fraction: float) -> bool:
    """Stable split by id hash: the same prompt is on the same side in every run and file order."""
    h = int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


@dataclasses.dataclass
class Sample:
    """One regenerated conversation: prompt tokens (chat template applied) + the target's reply."""

    id: str
    prompt_ids: list[int]
    response_ids: list[int]


def load_samples(path: str | Path) -> list[Sample]:
    """Read what `dspark data regenerate` wrote: a JSONL file or a shard store (its sealed shards)."""
    path = Path(path).expanduser()
    if path.is_dir():
        from dspark.train.shards import ShardStore

        samples = [Sample(r["id"], r["prompt_ids"], r["response_ids"]) for r in ShardStore(path).records()]
    else:
        samples = [_jsonl_sample(path, lineno, obj) for lineno, obj in read_jsonl(path)]
    samples = [s for s in samples if len(s.response_ids) >= 2]  # anchors need two response tokens
    if not samples:
        raise DsparkError(f"{path} holds no regenerated samples with a response of 2+ tokens")
    return samples


def _jsonl_sample(path: Path, lineno: int, obj: dict) -> Sample:
    try:
        return Sample(str(obj["id"]), [int(t) for t in obj["prompt_ids"]], [int(t) for t in obj["response_ids"]])
    except (KeyError, TypeError, ValueError):
        raise DsparkError(
            f"{path}:{lineno}: expected a regenerated sample with 'id', 'prompt_ids' and 'response_ids' "
            "(made by `dspark data regenerate`)"
        ) from None


def select_prompts(paths: list[str | Path], shuffle: int | None = None, limit: int | None = None,
                   skip_validation_fraction: float = 0.0) -> list[Prompt]:
    """Prompts of several files, first occurrence of each id kept; without those the trainer's id-hash
    split holds out as validation; shuffled with seed `shuffle` (if given), then the first `limit`."""
    if not 0 <= skip_validation_fraction < 1:
        raise DsparkError("--skip-validation-fraction must be in [0, 1)")
    prompts, seen = [], set()
    for path in paths:
        for p in load_prompts(path):
            if p.id not in seen and not is_validation(p.id, skip_validation_fraction):
                seen.add(p.id)
                prompts.append(p)
    if shuffle is not None:
        random.Random(shuffle).shuffle(prompts)
    return prompts[:limit]
