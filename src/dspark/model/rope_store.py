"""RoPE on a layer's new queries and keys and its K/V cache write, in one C++ call (rope_store.cpp): what the
fp32 block modes' layers run (transformer.py) where eager PyTorch runs ~10 small ops a layer, each a few
microseconds of dispatch on a CPU. The rotated rows are bit for bit `apply_rope`'s.

Built on first use by PyTorch Inductor's own C++ toolchain and code cache, as the block kernels are; where
it cannot be built, `built()` says no and the layers keep the eager ops.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger("dspark.model")

SOURCE = Path(__file__).with_name("rope_store.cpp")


@functools.cache
def _built():
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    argtypes = ["const float*", "const float*", "const float*", "const int64_t*", "const int64_t*", "const int64_t*",
                "float*", "float*"] + ["int64_t"] * 6
    try:
        return CppPythonBindingsCodeCache.load_pybinding(argtypes, SOURCE.read_text())
    except Exception as e:  # no compiler or an unsupported toolchain: the eager ops serve instead
        log.warning("the RoPE / K/V-store kernel could not be built (%s: %s); using eager ops", type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "")
        return None


def built() -> bool:
    return _built() is not None


class RopeStore:
    """One forward's tokens: token t at RoPE position pos[t], its K/V to slot slots[t] of cache row
    rows[t] (all [N] int64), checked once against the tables and the cache; called once a layer."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor,
                 slots: torch.Tensor, cache_rows: int, cache_len: int):
        if cos.dtype != torch.float32 or cos.shape != sin.shape:
            raise ValueError("RoPE tables: fp32 cos and sin [positions, head_dim]")
        self.cos, self.sin = cos.contiguous(), sin.contiguous()
        self.pos, self.rows, self.slots = (t.to(torch.int64).contiguous() for t in (pos, rows, slots))
        n = self.pos.shape[0]
        if self.rows.shape[0] != n or self.slots.shape[0] != n:
            raise ValueError(f"{n} positions, {self.rows.shape[0]} rows, {self.slots.shape[0]} slots")
        if n and not (0 <= int(self.pos.min()) and int(self.pos.max()) < cos.shape[0]
                      and 0 <= int(self.rows.min()) and int(self.rows.max()) < cache_rows
                      and 0 <= int(self.slots.min()) and int(self.slots.max()) < cache_len):
            raise ValueError(f"tokens at positions {self.pos.tolist()} (slots {self.slots.tolist()}, rows "
                             f"{self.rows.tolist()}) outside {cos.shape[0]} positions or a cache of {cache_rows} "
                             f"rows x {cache_len}")
        self.cache_rows, self.cache_len = cache_rows, cache_len

    def __call__(self, qkv: torch.Tensor, kvc: torch.Tensor, heads: int) -> torch.Tensor:
        """qkv [N, heads + 2 kv_heads, d] fp32 -> the rotated queries [N, heads, d]; the rotated keys and
        the values written into kvc [cache rows, 2 kv_heads, cache len, d] (K heads, then V heads)."""
        n, width, d = qkv.shape
        rows, kv2, length, _ = kvc.shape
        if (kvc.dtype != torch.float32 or kvc.stride(3) != 1 or kvc.stride(2) != d or (rows, length) != (
                self.cache_rows, self.cache_len) or width != heads + kv2 or n != self.pos.shape[0]
                or self.cos.shape[1] != d):
            raise ValueError(f"qkv {tuple(qkv.shape)} and cache {tuple(kvc.shape)} do not fit these tokens")
        qkv = qkv.contiguous()
        q = torch.empty(n, heads, d, dtype=torch.float32)
        _built()(qkv, self.cos, self.sin, self.pos, self.rows, self.slots, q, kvc, n, heads, kv2 // 2, d,
                 kvc.stride(0), kvc.stride(1))
        return q
