"""Projections that read a GGUF file's 4- and 8-bit blocks as stored: the kernels of the `q4f32` and
`q4q8` precision modes (two small C++ kernels, block_linear.cpp and block_linear_q8.cpp).

The float32 mode of a GGUF target dequantises its Q4_1 / Q8_0 blocks once and reads 4 bytes a weight
at every step; on a CPU without bf16 units that is what bounds decoding (SmolLM2: 538 MB a token).
These kernels keep the blocks' codes (with each block's d and m as fp32: 0.75 bytes a weight for Q4,
1.25 for Q8_0) and multiply them with fp32 activations, two ways:

* f32 (`q4f32`): dequantise a few weight rows at a time into an L1 scratch exactly as gguf-py does (so
  the weights are bit for bit the float32 mode's) and multiply them in fp32;
* q8 (`q4q8`): quantise each row of activations to 8 bits per block of 32 and take integer dot
  products with the codes, as llama.cpp's CPU kernels do: no dequantisation, so ~1.9x faster for one
  row on an AVX2-only EPYC, ~1.1x slower from ~9 rows on (its int8 multiplies, not its memory, bound
  it there), and llama.cpp's numerics rather than float32's (benchmarks/results/README.md, "q4q8").

No PyTorch kernel fits, measured on that EPYC (benchmarks/results/README.md, "q4f32"):
`_weight_int4pack_mm_for_cpu` wants bf16 activations and bf16 scales (rounding the file's fp16 ones) and
costs ~6x for 9 rows what it costs for one; `_weight_int8pack_mm` has per-row scales only and ran at
1.5 GB/s with fp32 activations; Inductor's weight-only GEMM templates need bf16 activations, and ran
slower than the eager bf16 model on that CPU; oneDNN's prepacked fp32 product reads
the dequantised weights (4 bytes each).

Both fuse a decoder layer's glue around the product (block_glue.h, `BlockLinear.__call__`): an RMSNorm or
SiLU(gate) * up of the input rows, the residual added to the output.

In both, each output is one fp32 accumulator per row, fed in a fixed order and summed across vector
lanes one fixed way, whatever the number of rows: a token's logits do not depend on how many tokens
share its forward, so greedy speculative output is token-identical to plain decoding in these modes.

Built on first use by PyTorch Inductor's own C++ toolchain and code cache, as decode_attention.py's
kernel is (seconds, once per machine and kind of block); `built` says whether one builds here.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger("dspark.model")

SOURCES = {"f32": Path(__file__).with_name("block_linear.cpp"), "q8": Path(__file__).with_name("block_linear_q8.cpp")}
GLUE = Path(__file__).with_name("block_glue.h")  # what both kernels fuse around the product (`BlockLinear.__call__`)
AS_IS, RMS_NORM, GLU = 0, 1, 2  # block_glue.h's Prologue
BLOCK = 32
OFFSET = {"Q4_0": -8, "Q4_1": 0, "Q8_0": 0}  # w = (q + offset) * d + m
BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # a block as the file stores it


@functools.cache
def _built(kind: str, activations: str = "f32"):
    """The kernel for one kind of block and of activations (`SOURCES`), or None (logged once) where it
    cannot be built."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    code = "const uint8_t*" if BITS[kind] == 4 else "const int8_t*"
    argtypes = ["const float*", code, "const float*", "const float*", "float*", "int64_t", "int64_t", "int64_t",
                "int64_t", "int64_t", "const float*", "float", "const float*", "int64_t"]
    source = (f"#define BITS {BITS[kind]}\n#define OFFSET {OFFSET[kind]}\n" + GLUE.read_text()
              + SOURCES[activations].read_text())
    try:
        return CppPythonBindingsCodeCache.load_pybinding(argtypes, source)
    except Exception as e:  # no compiler, an unsupported toolchain or CPU: the mode is refused with the reason
        log.warning("the GGUF block kernel (%s activations) could not be built (%s: %s)", activations,
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


def built(kind: str, activations: str = "f32") -> bool:
    """Whether the kernel for `kind` blocks and `activations` builds (and is built) here."""
    return _built(kind, activations) is not None


class BlockLinear:
    """A weight [N, K] as GGUF blocks of one kind (`OFFSET`'s keys), called like `F.linear` on fp32 rows.
    `rows`: the file's raw blocks [N, K / 32, bytes per block] uint8 (rows of several tensors stacked
    for a fused projection must share the kind). `activations`: "f32" or "q8" (the module docstring)."""

    def __init__(self, kind: str, rows: np.ndarray, bias: torch.Tensor | None = None, activations: str = "f32"):
        if kind not in OFFSET:
            raise ValueError(f"{kind} blocks are not supported; the kernel reads {sorted(OFFSET)}")
        if activations not in SOURCES:
            raise ValueError(f"activations {activations!r}: choose one of {sorted(SOURCES)}")
        n, blocks, nbytes = rows.shape
        if nbytes != BYTES[kind]:
            raise ValueError(f"{kind} blocks are {BYTES[kind]} bytes, got {nbytes}")
        self.kind, self.activations, self.out_features, self.in_features = kind, activations, n, blocks * BLOCK
        self.d = _fp16_field(rows[..., 0:2])
        self.m = _fp16_field(rows[..., 2:4]) if kind == "Q4_1" else torch.zeros_like(self.d)
        if activations == "q8":  # what a block adds per unit of x (Q4_0: w = (q - 8) d), padded to 8 blocks
            added = -8 * self.d if kind == "Q4_0" else self.m
            self.m = F.pad(added, (0, -blocks % 8)).contiguous() if BITS[kind] == 4 else torch.zeros(1)
        codes = np.ascontiguousarray(rows[..., nbytes - (16 if BITS[kind] == 4 else 32):])
        self.codes = torch.from_numpy(codes if BITS[kind] == 4 else codes.view(np.int8))
        self.bias = bias
        self._kernel = _built(kind, activations)

    def __call__(self, x: torch.Tensor, *, norm: torch.Tensor | None = None, eps: float = 0.0, glu: bool = False,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, W, bias), or with a decoder layer's glue fused (block_glue.h): of `F.rms_norm(x,
        norm.shape, norm, eps)` where `norm` is given, of `F.silu(gate) * up` where `glu` (x is then
        [..., 2 * in_features], gate then up), plus `residual` [..., out_features] where given."""
        width = 2 * self.in_features if glu else self.in_features
        if x.dtype != torch.float32 or x.shape[-1] != width:
            raise TypeError(f"BlockLinear runs fp32 activations of {width} features here, got {x.dtype} "
                            f"{tuple(x.shape)}")
        rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, width).contiguous()
        n, out = rows.shape[0], torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        if norm is not None and (glu or norm.shape != (self.in_features,) or not norm.is_contiguous()):
            raise ValueError(f"a product's rows are normed (by a contiguous [{self.in_features}] weight) or gated, "
                             "not both")
        if residual is not None:
            if self.bias is not None:
                raise ValueError("a product with a bias adds no residual")
            if residual.dim() != 2 or not residual.is_contiguous():
                residual = residual.reshape(-1, self.out_features).contiguous()
            if residual.shape[0] != n or residual.shape[1] != self.out_features or residual.dtype != torch.float32:
                raise ValueError(f"a residual of {n} fp32 rows of {self.out_features}, got {tuple(residual.shape)}")
        self._kernel(rows, self.codes, self.d, self.m, out, n, self.out_features, self.in_features,
                     torch.get_num_threads(), RMS_NORM if norm is not None else GLU if glu else AS_IS,
                     rows if norm is None else norm, eps, out if residual is None else residual,
                     residual is not None)
        if x.dim() != 2:
            out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def dequantised(self) -> torch.Tensor:
        """The fp32 weight [N, K] the f32 kernel multiplies with (one-hot rows through the kernel itself)."""
        if self.activations != "f32":
            raise ValueError("dequantised() reads the f32 kernel's weights; q8 activations round one-hot rows")
        return self(torch.eye(self.in_features)).t().contiguous()


def _fp16_field(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))
