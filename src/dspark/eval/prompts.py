"""Evaluation prompt sets: the five bundled with dspark (package data, `eval/data/`, for evaluation only,
never training; licences in its README) or any JSONL file of {"turns": ["user message", ...]}."""

from __future__ import annotations

from pathlib import Path

from dspark.errors import DsparkError
from dspark.util.jsonl import read_jsonl

BUNDLED_EVAL_DIR = Path(__file__).resolve().parent / "data"  # package data: GSM8K, MATH-500, HumanEval, MBPP, MT-Bench


def load_eval_prompts(path: str | Path) -> list[str]:
    """First user turn of every line ({"turns": [...]}); a malformed line stops with its number."""
    prompts = []
    path = resolve_dataset(path)
    for lineno, obj in read_jsonl(path):
        turns = obj.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise DsparkError(f"{path}:{lineno}: expected {{\"turns\": [\"user message\", ...]}}")
        prompts.append(turns[0])
    if not prompts:
        raise DsparkError(f"{path} holds no prompts")
    return prompts


def resolve_dataset(name: str | Path) -> Path:
    """A --dataset value: a JSONL file, or the name of a bundled set (`gsm8k`, `mt-bench`, ...)."""
    path = Path(name).expanduser()
    bundled = BUNDLED_EVAL_DIR / f"{name}.jsonl"
    if not path.exists() and "/" not in str(name) and bundled.is_file():
        return bundled
    return path


def default_datasets() -> list[Path]:
    """The bundled evaluation sets."""
    files = sorted(BUNDLED_EVAL_DIR.glob("*.jsonl"))
    if not files:
        raise DsparkError("no --dataset given and the bundled evaluation sets were not found; pass --dataset FILE")
    return files
