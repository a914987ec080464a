"""Atomic directory writes: readers see the old directory or the complete new one, never a mix."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


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
