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
        records, bad_line = read_records(self.path, cut=True)
        for i, obj in enumerate(records):
            if not isinstance(obj, dict) or ("settings" if i == 0 else "key") not in obj:
                bad_line = i + 1
                break
            if i == 0 and obj["settings"] != settings:
                raise DsparkError(
                    f"{self.path} belongs to a run with other settings ({_diff(obj['settings'], settings)}); "
                    "use another --out, or delete the file to start over")
            if i > 0:
                self.done[tuple(obj["key"])] = obj["value"]
        if bad_line is not None:
            raise DsparkError(f"{self.path}:{bad_line}: not a journal record; delete the file to start the run over")
        if not records:  # killed before the settings line was complete: nothing to keep
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


def read_records(path: Path, cut: bool = False) -> tuple[list, int | None]:
    """The JSON values of `path`'s lines, in order, up to a last line that a kill cut short (no
    newline; with `cut`, it is removed from the file so that appending stays valid). Returns them and
    the number of the first complete line that is not JSON (None when all are), where reading stopped."""
    data = path.read_bytes() if path.exists() else b""
    records, keep, bad = [], 0, None
    for i, line in enumerate(data.split(b"\n")[:-1]):  # the part after the last newline is torn or empty
        try:
            records.append(json.loads(line))
        except ValueError:
            bad = i + 1
            break
        keep += len(line) + 1
    if cut and bad is None and keep != len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    return records, bad
