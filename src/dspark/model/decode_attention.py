"""Decode-shaped attention of a batch of ragged rows: the engine's steps, on a small C++ kernel.

In a batched decode step every row brings one query token (a verify step: a few) and attends to its
own number of cached positions. PyTorch offers no kernel that fits on a CPU (measured: 64 one-token rows
of 150-900 positions, SmolLM2's 3 K/V heads x 3 query heads x 64, bf16, 2 threads, AVX512-BF16 EPYC;
benchmarks/results/README.md, "ragged decode attention"): SDPA's flash kernel reads up to the longest
row for every row under a mask, or pays ~20 us a call a row at a time, and in both spends its time in
tiny-GEMM calls (7.7-8.6 ms a layer); FlexAttention's compiled CPU template with a block mask 13.8 ms;
Inductor's code for the same arithmetic written as reductions 7.3 ms. This kernel (decode_attention.cpp)
reads each row's K and V once, up to what each token sees: 1.8 ms.

It is built on first use by PyTorch Inductor's own C++ toolchain and code cache (the compiler and the
vector ISA flags `torch.compile` already uses; a few seconds once per machine, cached on disk). Where
it cannot be built or does not apply (another device, dtype, head size or GQA group), `supports` says
no and the caller keeps SDPA. `DSPARK_DECODE_KERNEL=0` turns it off.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("dspark.model")

SOURCE = Path(__file__).with_name("decode_attention.cpp")
C_TYPES = {torch.bfloat16: "bfloat16", torch.float32: "float"}
MAX_GROUP = 8  # query heads per K/V head (decode_attention.cpp)
MAX_HEAD_DIM = 256
MAX_QUERIES = 16  # tokens a row; longer blocks (prefills) go to SDPA
MAX_TREE_NODES = 63  # a token tree's row: its visibility is a 64-bit mask a token


def enabled() -> bool:
    return os.environ.get("DSPARK_DECODE_KERNEL", "1") != "0"


@functools.cache
def _built(dtype: torch.dtype, head_dim: int) -> Callable | None:
    """The kernel for one element type and head size, or None (logged once) where it cannot be built."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    c_type = C_TYPES[dtype]
    source = f"#define DSPARK_T {c_type}\n#define DSPARK_D {head_dim}\n" + SOURCE.read_text()
    pointer, value = f"const {c_type}*", "int64_t"
    argtypes = [pointer, pointer, "const int64_t*", "const int64_t*", "const int64_t*", f"{c_type}*"] + [value] * 6 + [
        "float", value, value]
    try:
        return CppPythonBindingsCodeCache.load_pybinding(argtypes, source)
    except Exception as e:  # no compiler, an unsupported ISA or torch version: SDPA serves instead
        log.warning("the ragged decode-attention kernel could not be built (%s: %s); using SDPA",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


def _vector_width() -> int:
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    return isa.nelements(torch.float32) if isa else 0


def supports(dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether `decode_attention` runs these shapes: CPU, fp32 or bf16, a head size the CPU's vector
    width divides, at most MAX_GROUP query heads per K/V head, and a kernel that builds."""
    if not enabled() or device.type != "cpu" or dtype not in C_TYPES:
        return False
    width = _vector_width()
    if not width or head_dim % width or head_dim > MAX_HEAD_DIM or heads % kv_heads or heads // kv_heads > MAX_GROUP:
        return False
    return _built(dtype, head_dim) is not None


def checked_rows(start: torch.Tensor, count: torch.Tensor, queries: int, positions: int,
                 visible: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """`start` / `count` (and a batch of token trees' `visible` [B, queries, queries] bool) as the kernel
    reads them (int64, contiguous; `visible` as a bitmask a token), refused where a row's tokens do not
    fit the `queries` slots or the cache's `positions`. Once a forward: every layer reuses them."""
    start, count = start.to(torch.int64).contiguous(), count.to(torch.int64).contiguous()
    end = start + count
    if int(count.max()) > queries or int(count.min()) < 0 or int(start.min()) < 0 or int(end.max()) > positions:
        raise ValueError(f"rows of {count.tolist()} tokens at {start.tolist()} outside the cache's {positions} "
                         f"positions or the {queries} query slots")
    if visible is None:
        return start, count
    if queries > MAX_TREE_NODES or visible.shape != (start.shape[0], queries, queries):
        raise ValueError(f"tree visibility {tuple(visible.shape)} for {start.shape[0]} rows of {queries} tokens "
                         f"(at most {MAX_TREE_NODES})")
    bits = torch.ones(queries, dtype=torch.int64).bitwise_left_shift(torch.arange(queries))
    return start, count, (visible.to(torch.int64) * bits).sum(-1).contiguous()


def run(q: torch.Tensor, kv: torch.Tensor, start: torch.Tensor, count: torch.Tensor,
        seen: torch.Tensor | None = None) -> torch.Tensor:
    """`decode_attention` on rows already `checked_rows`."""
    B, Q, nh, d = q.shape
    nkv = kv.shape[1] // 2
    if kv.stride(3) != 1 or kv.stride(2) != d:
        raise ValueError("decode_attention needs each K/V head's positions contiguous")
    q = q.contiguous()
    out = torch.empty_like(q)
    _built(q.dtype, d)(q, kv, start, count, start if seen is None else seen, out, B, Q, nkv, nh // nkv, kv.stride(0),
                       kv.stride(1), 1 / math.sqrt(d), int(seen is not None), torch.get_num_threads())
    return out


def decode_attention(q: torch.Tensor, kv: torch.Tensor, start: torch.Tensor, count: torch.Tensor,
                     visible: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Q, nh, d]: row b's `count[b]` (<= Q) query tokens first, at positions start[b], start[b] + 1, ...,
    their K/V already in the cache; kv [B, 2 * nkv, L, d]: a layer's cache (K heads, then V heads;
    positions contiguous) -> [B, Q, nh, d]: token i of row b attends to the row's first start[b] + i + 1
    positions (causal), or, given token trees' `visible` [B, Q, Q], to the row's first start[b] positions
    and to its tokens j < count[b] that visible[b, i, j] marks (their K/V in slots start[b] + j); zeros
    where i >= count[b]. Only `supports`ed shapes."""
    return run(q, kv, *checked_rows(start, count, q.shape[1], kv.shape[2], visible))
