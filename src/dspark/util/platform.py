"""What this CPU offers: the instruction-set flags that decide kernels and change every speed figure."""

from __future__ import annotations

import functools
from pathlib import Path

SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


@functools.cache
def cpu_flags() -> list[str]:
    """The flags of SPEED_FLAGS that /proc/cpuinfo lists (empty where it cannot be read)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return sorted(f for f in SPEED_FLAGS if f in flags)
