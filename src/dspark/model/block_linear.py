"""Projections that read a GGUF file's 4- and 8-bit blocks as stored, in fp32 arithmetic: the `q4f32`
precision mode's kernel (a small C++ kernel, block_linear.cpp).

The float32 mode of a GGUF target dequantises its Q4_1 / Q8_0 blocks once and reads 4 bytes a weight
at every step; on a CPU without bf16 units that is what bounds decoding (SmolLM2: 538 MB a token).
This kernel keeps the blocks' codes (with each block's d and m as fp32: 0.75 bytes a weight for Q4,
1.25 for Q8_0), dequantises a few weight rows at a time into an L1 scratch exactly as gguf-py does (so
the weights are bit for bit the float32 mode's) and multiplies them with fp32 activations. No PyTorch
kernel fits, measured on an AVX2-only EPYC (benchmarks/results/README.md, "q4f32"):
`_weight_int4pack_mm_for_cpu` wants bf16 activations and bf16 scales (rounding the file's fp16 ones) and
costs ~6x for 9 rows what it costs for one; `_weight_int8pack_mm` has per-row scales only and ran at
1.5 GB/s with fp32 activations; Inductor's weight-only GEMM templates need bf16 activations, and ran
slower than the eager bf16 model on that CPU; oneDNN's prepacked fp32 product reads
the dequantised weights (4 bytes each).

Each output is one fp32 accumulator per row, fed in order of k and summed across vector lanes one fixed
way, whatever the number of rows: a token's logits do not depend on how many tokens share its forward,
so greedy speculative output is token-identical to plain decoding in this mode.

Built on first use by PyTorch Inductor's own C++ toolchain and code cache, as decode_attention.py's
kernel is (seconds, once per machine and kind of block); `built` says whether it builds here.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("dspark.model")

SOURCE = Path(__file__).with_name("block_linear.cpp")
BLOCK = 32
OFFSET = {"Q4_0": -8, "Q4_1": 0, "Q8_0": 0}  # w = (q + offset) * d + m
BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # a block as the file stores it


@functools.cache
def _built(kind: str):
    """The kernel for one kind of block, or None (logged once) where it cannot be built."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    code = "const uint8_t*" if BITS[kind] == 4 else "const int8_t*"
    argtypes = ["const float*", code, "const float*", "const float*", "float*", "int64_t", "int64_t", "int64_t",
                "int64_t"]
    source = f"#define BITS {BITS[kind]}\n#define OFFSET {OFFSET[kind]}\n" + SOURCE.read_text()
    try:
        return CppPythonBindingsCodeCache.load_pybinding(argtypes, source)
    except Exception as e:  # no compiler or an unsupported toolchain: the mode is refused with the reason
        log.warning("the GGUF block kernel could not be built (%s: %s)", type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "")
        return None


def built(kind: str) -> bool:
    """Whether the kernel for `kind` blocks builds (and is built) here."""
    return _built(kind) is not None


class BlockLinear:
    """A weight [N, K] as GGUF blocks of one kind (`OFFSET`'s keys), called like `F.linear` on fp32 rows.
    `rows`: the file's raw blocks [N, K / 32, bytes per block] uint8 (rows of several tensors stacked
    for a fused projection must share the kind)."""

    def __init__(self, kind: str, rows: np.ndarray, bias: torch.Tensor | None = None):
        if kind not in OFFSET:
            raise ValueError(f"{kind} blocks are not supported; the kernel reads {sorted(OFFSET)}")
        n, blocks, nbytes = rows.shape
        if nbytes != BYTES[kind]:
            raise ValueError(f"{kind} blocks are {BYTES[kind]} bytes, got {nbytes}")
        self.kind, self.out_features, self.in_features = kind, n, blocks * BLOCK
        self.d = _fp16_field(rows[..., 0:2])
        self.m = _fp16_field(rows[..., 2:4]) if kind == "Q4_1" else torch.zeros_like(self.d)
        codes = np.ascontiguousarray(rows[..., nbytes - (16 if BITS[kind] == 4 else 32):])
        self.codes = torch.from_numpy(codes if BITS[kind] == 4 else codes.view(np.int8))
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32:
            raise TypeError(f"BlockLinear runs fp32 activations, got {rows.dtype}")
        rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        _built(self.kind)(rows, self.codes, self.d, self.m, out, rows.shape[0], self.out_features, self.in_features,
                          torch.get_num_threads())
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def dequantised(self) -> torch.Tensor:
        """The fp32 weight [N, K] the kernel multiplies with (one-hot rows through the kernel itself)."""
        return self(torch.eye(self.in_features)).t().contiguous()


def _fp16_field(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))
