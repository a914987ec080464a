"""JSON Lines input files (prompts, replies, evaluation sets)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from dspark.errors import DsparkError


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line; a malformed line is a clear error."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DsparkError(f"data file {path} does not exist")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DsparkError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise DsparkError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj
