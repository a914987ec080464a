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
    rows[t] (all [N] int64), checked once against the RoPE tables and the layers' caches `kv` (each
    [cache rows, 2 kv_heads, cache len, d] fp32, K heads then V heads: KVCache.kv); called once a layer."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor,
                 slots: torch.Tensor, kv: list[torch.Tensor]):
        self.cos, self.sin, self.kv = cos.contiguous(), sin.contiguous(), kv
        self.pos, self.rows, self.slots = (t.to(torch.int64).contiguous() for t in (pos, rows, slots))
        shape, strides = kv[0].shape, kv[0].stride()
        positions, d = cos.shape
        if (cos.dtype != torch.float32 or sin.shape != cos.shape or shape[3] != d or strides[3] != 1
                or strides[2] != d or any(t.dtype != torch.float32 or t.shape != shape or t.stride() != strides
                                          for t in kv)):
            raise ValueError(f"RoPE tables {tuple(cos.shape)} and caches {tuple(shape)} (strides {strides}): "
                             "fp32, one layout for every layer, a head's positions contiguous")
        pos_, rows_, slots_ = self.pos.tolist(), self.rows.tolist(), self.slots.tolist()
        if not len(pos_) == len(rows_) == len(slots_):
            raise ValueError(f"{len(pos_)} positions, {len(rows_)} rows, {len(slots_)} slots")
        if pos_ and not (0 <= min(pos_) and max(pos_) < positions and 0 <= min(rows_) and max(rows_) < shape[0]
                         and 0 <= min(slots_) and max(slots_) < shape[2]):
            raise ValueError(f"tokens at positions {pos_} (slots {slots_}, rows {rows_}) outside {positions} "
                             f"positions or a cache of {shape[0]} rows x {shape[2]}")
        self.kv_heads, self.strides = shape[1] // 2, strides[:2]

    def __call__(self, qkv: torch.Tensor, layer: int) -> torch.Tensor:
        """qkv [N, heads + 2 kv_heads, d] fp32 -> the rotated queries [N, heads, d]; the rotated keys and
        the values written into layer `layer`'s cache."""
        n, width, d = qkv.shape
        heads = width - 2 * self.kv_heads
        if n != self.pos.shape[0] or d != self.cos.shape[1] or heads <= 0 or qkv.dtype != torch.float32:
            raise ValueError(f"qkv {tuple(qkv.shape)} does not fit these {self.pos.shape[0]} tokens and caches")
        q = torch.empty(n, heads, d, dtype=torch.float32)
        _built()(qkv.contiguous(), self.cos, self.sin, self.pos, self.rows, self.slots, q, self.kv[layer], n, heads,
                 self.kv_heads, d, *self.strides)
        return q
