"""Seeded random streams that depend on named parts only (seed, step, prompt id, ...), never on the
order in which work happens, so resumed and parallel runs draw exactly what one uninterrupted run
draws."""

from __future__ import annotations

import hashlib

import torch


def derived_generator(*parts) -> torch.Generator:
    """A CPU generator seeded from a hash of `parts`."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)
