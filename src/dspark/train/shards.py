"""A regenerated-data store: token ids in sealed safetensors shards of bounded size, plus a manifest.

    <dir>/manifest.json       format, regeneration settings, per-shard sample / token counts and sha256,
                              throughput of every regeneration run, and the store's digest
    <dir>/shard-00000.safetensors
                              `tokens` (uint16 when the vocabulary fits, else int32): every sample's
                              prompt ids then response ids, back to back; `offsets` (int64, N + 1)
                              where each sample starts; `prompt_lens` (int32, N); metadata `ids` and
                              `finish_reasons` (JSON lists)
    <dir>/pending.jsonl       finished replies not yet sealed (local work in progress; not committed)
    <dir>/writer.lock         held (flock) by the one process appending to the store (not committed)

A shard is written once and never changed, so a growing store commits as new files of bounded size
and one replaced manifest. Readers see only sealed shards, each checked against its sha256, so
training refuses data that changed under it. A kill loses nothing: pending replies survive in the
journal, a shard written but not yet in the manifest is rewritten, and replies already sealed are
dropped from the journal when it is read back. One writer at a time: a second regeneration into
the same store is refused while the first runs (two would answer the same prompts twice).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dspark.errors import DsparkError
from dspark.util.journal import json_digest, read_records

FORMAT = "dspark-regen-shards/1"
MANIFEST = "manifest.json"
PENDING = "pending.jsonl"
LOCK = "writer.lock"
_WRITER_LOCKS: dict[Path, object] = {}  # store root -> its lock file, held by this process


def is_store(path: str | Path) -> bool:
    return (Path(path).expanduser() / MANIFEST).is_file()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


class ShardStore:
    def __init__(self, root: str | Path, settings: dict | None = None, shard_size: int = 1024):
        """Open the store at `root`; with `settings`, create it if absent and refuse one made with others."""
        self.root = Path(root).expanduser()
        self.shard_size = shard_size
        if shard_size < 1:
            raise DsparkError("shard size must be >= 1")
        if (self.root / MANIFEST).is_file():
            try:
                self.manifest = json.loads((self.root / MANIFEST).read_text())
            except ValueError:
                raise DsparkError(f"{self.root / MANIFEST} is not valid JSON; restore it from git") from None
            if not isinstance(self.manifest, dict) or self.manifest.get("format") != FORMAT:
                raise DsparkError(f"{self.root} is not a {FORMAT} store")
            if settings is not None:
                settings = json.loads(json.dumps(settings))
                if self.manifest["settings"] != settings:
                    diff = sorted(k for k in set(settings) | set(self.manifest["settings"])
                                  if settings.get(k) != self.manifest["settings"].get(k))
                    raise DsparkError(f"{self.root} was regenerated with other settings (differs in "
                                      f"{', '.join(diff)}); use another --out or the same settings")
        elif settings is None:
            raise DsparkError(f"{self.root} is not a regenerated-data store (no {MANIFEST}); "
                              "make one with `dspark data regenerate --out DIR`")
        else:
            if self.root.exists() and any(self.root.iterdir()):
                raise DsparkError(f"{self.root} exists and is not an empty directory; choose another --out")
            self.root.mkdir(parents=True, exist_ok=True)
            self.manifest = {"format": FORMAT, "settings": json.loads(json.dumps(settings)), "shards": [],
                             "runs": [], "digest": json_digest([])}
            _write_json(self.root / MANIFEST, self.manifest)
        self._sealed_ids: set[str] | None = None
        self.pending: list[dict] = []
        if settings is not None:
            self._take_writer_lock()
            self._read_pending()

    def _take_writer_lock(self) -> None:
        """Hold the store's writer lock for the rest of this process (the OS drops it when the process
        ends); a second process that asks for it is refused."""
        key = self.root.resolve()
        if key in _WRITER_LOCKS:
            return
        f = open(self.root / LOCK, "a+", encoding="utf-8")  # noqa: SIM115 (held until the process ends)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            f.close()
            raise DsparkError(f"another process (pid {holder}) is writing to {self.root}; wait for it to "
                              "finish or stop it, then rerun to resume") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        _WRITER_LOCKS[key] = f

    # ---- reading ---------------------------------------------------------------------------------
    @property
    def digest(self) -> str:
        return self.manifest["digest"]

    def totals(self) -> dict:
        shards = self.manifest["shards"]
        return {k: sum(s[k] for s in shards) for k in ("samples", "prompt_tokens", "response_tokens")}

    def _shard_path(self, entry: dict) -> Path:
        path = self.root / entry["file"]
        if not path.is_file():
            raise DsparkError(f"{path} is missing (listed in {self.root / MANIFEST}); restore it from git")
        return path

    def read_shard(self, entry: dict, verify: bool = True) -> list[dict]:
        path = self._shard_path(entry)
        if verify and _sha256(path) != entry["sha256"]:
            raise DsparkError(f"{path} does not match its sha256 in {self.root / MANIFEST}: the data changed; "
                              "restore it from git or regenerate into a new store")
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            tokens, offsets, prompt_lens = (f.get_tensor(k).long().tolist() for k in ("tokens", "offsets", "prompt_lens"))
        ids, reasons = json.loads(meta["ids"]), json.loads(meta["finish_reasons"])
        out = []
        for i, sid in enumerate(ids):
            seq = tokens[offsets[i] : offsets[i + 1]]
            out.append({"id": sid, "prompt_ids": seq[: prompt_lens[i]], "response_ids": seq[prompt_lens[i] :],
                        "finish_reason": reasons[i]})
        return out

    def records(self, verify: bool = True) -> list[dict]:
        """Every sealed sample, in shard order."""
        return [r for entry in self.manifest["shards"] for r in self.read_shard(entry, verify)]

    def sealed_ids(self) -> set[str]:
        if self._sealed_ids is None:  # from the shards' metadata: no token is read
            self._sealed_ids = set()
            for entry in self.manifest["shards"]:
                with safe_open(str(self._shard_path(entry)), "pt") as f:
                    self._sealed_ids.update(json.loads(f.metadata()["ids"]))
        return self._sealed_ids

    def done_ids(self) -> set[str]:
        return self.sealed_ids() | {r["id"] for r in self.pending}

    # ---- writing ---------------------------------------------------------------------------------
    def _read_pending(self) -> None:
        path = self.root / PENDING
        records, bad_line = read_records(path, cut=True)
        if bad_line is not None or not all(isinstance(r, dict) and "id" in r for r in records):
            raise DsparkError(f"{path}:{bad_line or '?'}: not a regeneration record; fix or delete the file")
        seen = set(self.sealed_ids())
        self.pending = []
        for r in records:  # sealed ones: killed after sealing, before the journal was cleared
            if r["id"] not in seen:
                seen.add(r["id"])
                self.pending.append(r)
        if len(self.pending) != len(records):
            self._rewrite_pending()

    def _rewrite_pending(self) -> None:
        path = self.root / PENDING
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in self.pending:
                f.write(json.dumps(r) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def add(self, record: dict) -> None:
        """Journal one finished reply ({id, prompt_ids, response_ids, finish_reason}); seal a full shard."""
        with open(self.root / PENDING, "a", encoding="utf-8") as f:
            f.write(json.dumps({k: record[k] for k in ("id", "prompt_ids", "response_ids", "finish_reason")}) + "\n")
            f.flush()
        self.pending.append(record)
        if len(self.pending) >= self.shard_size:
            self.seal()

    def seal(self) -> None:
        """Write the journalled replies (at most `shard_size`) as the next shard and list it."""
        while self.pending:
            batch, rest = self.pending[: self.shard_size], self.pending[self.shard_size :]
            seqs = [r["prompt_ids"] + r["response_ids"] for r in batch]
            top = max((max(s) for s in seqs if s), default=0)
            dtype = torch.uint16 if top < 2**16 else torch.int32
            lengths = torch.tensor([0] + [len(s) for s in seqs])
            name = f"shard-{len(self.manifest['shards']):05d}.safetensors"
            path = self.root / name
            tmp = path.with_name(name + ".tmp")
            save_file({"tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int64).to(dtype),
                       "offsets": lengths.cumsum(0), "prompt_lens": torch.tensor([len(r["prompt_ids"]) for r in batch],
                                                                                 dtype=torch.int32)},
                      str(tmp), metadata={"ids": json.dumps([r["id"] for r in batch]),
                                          "finish_reasons": json.dumps([r["finish_reason"] for r in batch])})
            os.replace(tmp, path)
            self.manifest["shards"].append({
                "file": name, "samples": len(batch), "prompt_tokens": sum(len(r["prompt_ids"]) for r in batch),
                "response_tokens": sum(len(r["response_ids"]) for r in batch), "sha256": _sha256(path)})
            self.manifest["digest"] = json_digest([s["sha256"] for s in self.manifest["shards"]])
            self.manifest["totals"] = self.totals()
            _write_json(self.root / MANIFEST, self.manifest)
            self.sealed_ids().update(r["id"] for r in batch)
            self.pending = rest
            self._rewrite_pending()

    def log_run(self, index: int, run: dict) -> None:
        """Record (or update) regeneration run number `index`'s throughput in the manifest."""
        runs = self.manifest.setdefault("runs", [])
        runs[index:index + 1] = [run]
        _write_json(self.root / MANIFEST, self.manifest)
