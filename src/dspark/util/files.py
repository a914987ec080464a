"""Output paths: fail before any work when one cannot be written; atomic directory writes (readers
see the old directory or the complete new one, never a mix)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from dspark.errors import DsparkError


def check_writable(path: str | Path, kind: str = "directory", what: str = "output") -> Path:
    """Fail with one clear line when `path` (a `kind` = directory or file to create or replace)
    cannot be written: an existing path of the other kind, an ancestor that is a file, or an
    ancestor directory where files cannot be created. Probes with a temporary file that it removes,
    so nothing is left behind; parents are not created."""
    path = Path(path).expanduser()
    if path.exists():
        if kind == "directory" and not path.is_dir():
            raise DsparkError(f"{what} {path} exists and is not a directory; choose another path")
        if kind == "file" and path.is_dir():
            raise DsparkError(f"{what} {path} is a directory; give a file path")
    probe = path if path.is_dir() else path.parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise DsparkError(f"cannot write {what} {path}: {probe} is a file, not a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".dspark-write-check-", dir=probe)
    except OSError as e:
        raise DsparkError(f"cannot write {what} {path}: {probe}: {e.strerror}; choose a writable location") from None
    os.close(fd)
    os.unlink(tmp)
    return path


@contextlib.contextmanager
def atomic_directory(out: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `out` (files get umask modes)."""
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        for p in tmp.rglob("*"):
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace the file `path` with `text` atomically: a reader sees the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
