"""Append-only journal of finished work items, so a long run (`dspark eval`, `dspark bench serve`)
resumes after a kill.

The first line holds the run's settings; every later line is one finished item under its key (a
tuple of JSON scalars). Reopening with other settings is an error; a line cut short by a kill is
dropped."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from dspark.errors import DsparkError

Key = tuple  # of JSON scalars


def json_digest(obj) -> str:
    """Short stable fingerprint of a JSON-able value (settings, prompt lists, cache keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


class Journal:
    def __init__(self, path: Path, settings: dict):
        self.path = Path(path)
        self.done: dict[Key, object] = {}
        settings = json.loads(json.dumps(settings))  # as it reads back (tuples become lists)
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
            if not isinstance(obj, dict) or ("settings" if i == 0 else "key") not in obj:
                obj = None
            if obj is None:
                if complete:
                    raise DsparkError(f"{self.path}:{i + 1}: not a journal record; delete the file to start the run over")
                break  # a kill cut the last line short
            if i == 0:
                if obj.get("settings") != settings:
                    raise DsparkError(
                        f"{self.path} belongs to a run with other settings ({_diff(obj.get('settings'), settings)}); "
                        "use another --out, or delete the file to start over")
            else:
                self.done[tuple(obj["key"])] = obj["value"]
            keep += len(line) + 1
        with open(self.path, "r+b") as f:
            f.truncate(keep)
        if keep == 0:  # killed before the settings line was complete: nothing to keep
            self._append({"settings": settings})

    def _append(self, obj: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(obj) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def add(self, key: Key, value) -> None:
        self._append({"key": list(key), "value": value})
        self.done[tuple(key)] = value


def _diff(old, new: dict) -> str:
    if not isinstance(old, dict):
        return "unreadable settings"
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return "differs in " + ", ".join(keys)
