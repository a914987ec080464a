"""Append-only journal of finished generations, so a long `dspark eval` resumes after a kill.

The first line holds the settings; every later line is one (temperature, dataset, prompt, engine)
generation. Reopening with other settings is an error; a line cut short by a kill is dropped."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dspark.errors import DsparkError

Key = tuple[float, str, int, str]  # temperature, dataset, prompt index, engine


class EvalJournal:
    def __init__(self, path: Path, settings: dict):
        self.path = Path(path)
        self.done: dict[Key, dict] = {}
        if self.path.exists():
            self._load(settings)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._append({"settings": settings})

    def _load(self, settings: dict) -> None:
        lines = self.path.read_bytes().split(b"\n")
        keep = 0  # bytes of complete lines
        for i, line in enumerate(lines):
            complete = i < len(lines) - 1
            try:
                obj = json.loads(line) if complete else None
            except json.JSONDecodeError:
                obj = None
            if obj is None:
                if complete:
                    raise DsparkError(f"{self.path}:{i + 1}: not valid JSON; delete the file to start the evaluation over")
                break  # a kill cut the last line short
            if i == 0:
                if obj.get("settings") != settings:
                    raise DsparkError(
                        f"{self.path} belongs to an evaluation with other settings ({_diff(obj.get('settings'), settings)}); "
                        "use another --out, or delete the file to start over")
            else:
                self.done[(obj["temperature"], obj["dataset"], obj["index"], obj["engine"])] = obj
            keep += len(line) + 1
        if keep == 0:
            raise DsparkError(f"{self.path} has no settings line; delete it to start the evaluation over")
        with open(self.path, "r+b") as f:
            f.truncate(keep)

    def _append(self, obj: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(obj) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def add(self, key: Key, record: dict) -> dict:
        temperature, dataset, index, engine = key
        record = {"temperature": temperature, "dataset": dataset, "index": index, "engine": engine, **record}
        self._append(record)
        self.done[key] = record
        return record


def _diff(old, new: dict) -> str:
    if not isinstance(old, dict):
        return "unreadable settings"
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return "differs in " + ", ".join(keys)
