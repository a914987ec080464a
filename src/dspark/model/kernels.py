"""Weight kernels for the target's projections: one object per weight, called like `F.linear`.

Which kernel a weight gets is decided once, at load, from the precision mode and the CPU
(measured in benchmarks/results/README.md, "runner"):

  * `Dense`: `F.linear` on a plain tensor (GPU, and CPUs without oneDNN);
  * `Packed`: a oneDNN-prepacked fp32 or bf16 copy (CPU): 1.2-1.6x faster than `F.linear` for the
    1- and 9-row products of decoding and verification, at a ~14 us fixed cost per call;
  * `Int4`: group-wise int4 weights (`_weight_int4pack_mm_for_cpu`): the GGUF's Q4_0 / Q4_1 blocks,
    and its Q8_0 LM head as two nibbles (PyTorch's `_weight_int8pack_mm` has per-row scales only, so
    it cannot hold Q8_0's per-block ones, and measured 2.5 ms against 2.2 ms cold for that head).

`StackedKernel` gives a drafter's linears the same choice for its inference passes, several linears of
one input as one product; `FastLinear` is an `nn.Linear` that runs through one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.util.platform import cpu_flags


def cpu_has_native_bf16() -> bool:
    flags = cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def can_pack(dtype: torch.dtype) -> bool:
    """oneDNN prepacking: fp32 on any x86 CPU, bf16 only where the CPU has bf16 matrix units
    (elsewhere oneDNN emulates bf16 and the plain path is faster)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_native_bf16())


class Dense:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Packed:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def dense_kernel(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Dense | Packed:
    """The fastest kernel for a plain weight on its device."""
    if weight.device.type == "cpu" and can_pack(weight.dtype):
        return Packed(weight, bias)
    return Dense(weight, bias)


class Int4:
    """W[n, k] = (q[n, k] - 8) * scale[k // group, n] + zero[k // group, n], q in 0..15 (the kernel's
    convention; GGUF Q4_1 `d * q + m` is scale d, zero m + 8d). Activations and scales are bf16.

    `repeats` > 1: the weight is `repeats` int4 parts side by side along k, and the input is
    repeated to match, so one product sums them (an int8 weight as two int4 nibbles, see quant.py)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                 bias: torch.Tensor | None = None, repeats: int = 1):
        self.out_features, k = q.shape
        self.in_features, self.repeats = k // repeats, repeats
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.scales_zeros = torch.stack([scale, zero], dim=-1).to(torch.bfloat16).contiguous()
        self.group, self.bias = group, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.repeats > 1:
            rows = rows.repeat(1, self.repeats)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scales_zeros)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


class StackedKernel:
    """The product of one input with several linears' weights stacked along the output dim (q, k and v;
    gate and up): one call where there were several, each ~14 us plus its Python and dispatch cost.

    Under `torch.inference_mode` the stacked weight is one `dense_kernel` (prepacked on CPUs with
    oneDNN), rebuilt when any weight or bias is replaced or changed in place (a `.to(dtype)`, a
    `load_state_dict`, an optimiser step); otherwise it is `F.linear` of the concatenated weights, so
    training sees the same product and gradients reach every linear."""

    def __init__(self):
        self._kernel, self._built_for = None, None

    def __call__(self, x: torch.Tensor, *linears: nn.Module) -> torch.Tensor:
        if not torch.is_inference_mode_enabled():
            weight, bias = _stacked(linears)
            return F.linear(x, weight, bias)
        state = tuple((t.data_ptr(), t._version, t.dtype) for lin in linears for t in (lin.weight, lin.bias)
                      if t is not None)
        if state != self._built_for:
            weight, bias = _stacked(linears)
            self._kernel = dense_kernel(weight.detach(), None if bias is None else bias.detach())
            self._built_for = state
        return self._kernel(x)


def _stacked(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The linears' weights (and biases, zero where one has none) concatenated along the output dim."""
    weights = [lin.weight for lin in linears]
    weight = weights[0] if len(weights) == 1 else torch.cat(weights)
    if all(lin.bias is None for lin in linears):
        return weight, None
    biases = [lin.bias if lin.bias is not None else w.new_zeros(w.shape[0]) for lin, w in zip(linears, weights)]
    return weight, biases[0] if len(biases) == 1 else torch.cat(biases)


class FastLinear(nn.Module):
    """An `nn.Linear` (the same parameters, so the same state dict) whose forward is a one-linear
    `StackedKernel`: `dense_kernel` of its weight under `torch.inference_mode`, plain `F.linear`
    otherwise, so training through it is unchanged.

    Drafters pass 8 rows through each projection right after the target's forward has evicted their
    weights from the caches: a prepacked bf16 weight took 0.12-0.36 ms there against 0.6-0.8 ms for
    `F.linear` (benchmarks/results/README.md, issue 20)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self._kernel = StackedKernel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, self)


def fast_linears(module: nn.Module) -> nn.Module:
    """Make every `nn.Linear` inside `module` a `FastLinear`, in place (idempotent); returns `module`."""
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            setattr(module, name, FastLinear(child))
        else:
            fast_linears(child)
    return module
