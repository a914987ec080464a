"""GGUF's quantised blocks, read as they are stored, for the `q4`, `q4f32` and `q4q8` precision modes.

q4f32 and q4q8 keep every block as the file stores it (`BlockLinear`): q4f32 multiplies the float32
mode's weights with fp32 activations, q4q8 takes integer dot products with activations quantised to 8
bits as llama.cpp does (`BLOCK_ACTIVATIONS`). q4 turns them into PyTorch's int4 kernels (bf16 activations):

Q4_0 (w = d * (q - 8)) and Q4_1 (w = d * q + m) blocks of 32 become `Int4` kernels with group 32
(scale d, zero m + 8d; d and m are fp16 in the file and bf16 in the kernel, the one rounding this
mode adds). A Q8_0 LM head (w = d * q, q in -128..127, blocks of 32) becomes two int4 nibbles side by
side, q = 16 * hi + lo: lo in 0..15 with scale d, zero 8d, and hi + 8 in 0..15 with scale 16d, zero 0,
summed by one int4 product; PyTorch's int8 kernel has only per-row scales and measured slower.
The embedding and norms are dequantised as `gguf_file.py` does.
"""

from __future__ import annotations

import numpy as np
import torch

from dspark.errors import DsparkError
from dspark.model import block_linear
from dspark.model.block_linear import BlockLinear
from dspark.model.gguf_file import read_gguf, stored_tensors, unpermute_qk
from dspark.model.kernels import Int4, dense_kernel
from dspark.model.transformer import QuantisedWeights, TargetModel

BLOCK = 32
INT4_TYPES = ("Q4_0", "Q4_1")
BLOCK_ACTIVATIONS = {"q4f32": "f32", "q4q8": "q8"}  # the block modes and how each multiplies (block_linear.py)


def _blocks(t, bytes_per_block: int) -> np.ndarray:
    """The raw blocks of tensor `t` as [rows, blocks per row, bytes per block] uint8."""
    rows = int(np.prod([int(d) for d in t.shape[1:]]))
    return np.asarray(t.data, dtype=np.uint8).reshape(rows, -1, bytes_per_block)


def _fp16(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0])


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """16 bytes per block -> 32 values: low nibbles are elements 0..15, high nibbles 16..31."""
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, blocks, 32]
    return torch.from_numpy(q.reshape(q.shape[0], -1).astype(np.int32))


def int4_parts(t) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] 0..15, scale [K/32, N], zero [K/32, N]) of a Q4_0 / Q4_1 GGUF tensor, fp32 scales."""
    kind = t.tensor_type.name
    if kind == "Q4_1":
        b = _blocks(t, 20)
        d, m, q = _fp16(b[..., 0:2]), _fp16(b[..., 2:4]), _nibbles(b[..., 4:])
        zero = m + 8 * d
    elif kind == "Q4_0":
        b = _blocks(t, 18)
        d, q = _fp16(b[..., 0:2]), _nibbles(b[..., 2:])
        zero = torch.zeros_like(d)
    else:
        raise ValueError(f"{t.name} is {kind}, not one of {INT4_TYPES}")
    return q, d.t().contiguous(), zero.t().contiguous()


def dequantise_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The fp32 weight of `int4_parts` (what the file stores, before any bf16 rounding)."""
    s = scale.t().repeat_interleave(BLOCK, dim=1)
    z = zero.t().repeat_interleave(BLOCK, dim=1)
    return (q - 8) * s + z


def q8_0_parts(t) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q8_0 GGUF tensor [N, K] as int4 parts [N, 2K] (lo nibbles, then hi nibbles): the two halves of
    `dequantise_int4` of them sum to the stored weight exactly."""
    b = _blocks(t, 34)
    d = _fp16(b[..., 0:2])  # [N, blocks]
    q8 = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).astype(np.int32))  # [N, blocks, 32]
    lo, hi = q8 & 0x0F, (q8 >> 4) + 8  # q8 = 16 * (hi - 8) + lo
    q = torch.cat([lo.flatten(1), hi.flatten(1)], dim=1)
    scale = torch.cat([d, 16 * d], dim=1).t().contiguous()
    zero = torch.cat([8 * d, torch.zeros_like(d)], dim=1).t().contiguous()
    return q, scale, zero


def int4_kernel(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], bias=None) -> Int4:
    """One kernel for row-stacked weights (fused qkv or gate|up) that share the input dimension."""
    q = torch.cat([p[0] for p in parts])
    scale = torch.cat([p[1] for p in parts], dim=1)
    zero = torch.cat([p[2] for p in parts], dim=1)
    return Int4(q, scale, zero, BLOCK, bias)


def _qkv_order(model: TargetModel) -> torch.Tensor:
    """Rows of the GGUF's q|k|v stacked -> the model's fused qkv order (llama files store Q / K permuted for
    RoPE; the bf16 fast path interleaves their pairs)."""
    c = model.cfg
    nq, nk = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    order = torch.arange(nq + 2 * nk)
    if c.family == "llama":
        order = torch.cat([unpermute_qk(order[:nq, None], c.num_attention_heads)[:, 0],
                           unpermute_qk(order[nq : nq + nk, None], c.num_key_value_heads)[:, 0], order[nq + nk :]])
    return model.interleave_qk_rows(order) if model.fast else order


def quantised_weights(gguf_path, model: TargetModel) -> QuantisedWeights:
    """The q4 kernels of `model` (a bf16 `TargetModel` loaded from the same file) from its GGUF blocks."""
    tensors = {t.name: t for t in read_gguf(gguf_path).tensors}

    def parts(name: str):
        t = tensors[name]
        if t.tensor_type.name not in INT4_TYPES:
            raise DsparkError(
                f"--dtype q4 runs Q4_0 / Q4_1 GGUF tensors, but {name} in {gguf_path} is {t.tensor_type.name}; "
                f"use --dtype bfloat16 or float32 for this file")
        return int4_parts(t)

    order = _qkv_order(model)
    layers = []
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        q, s, z = (torch.cat(x, dim=d) for x, d in zip(zip(*(parts(p + f"attn_{n}.weight") for n in "qkv")), (0, 1, 1)))
        bias = None if layer.bqkv is None else model.interleave_qk_rows(layer.bqkv.detach())
        qkv = Int4(q[order], s[:, order], z[:, order], BLOCK, bias)
        o = int4_kernel([parts(p + "attn_output.weight")])
        gate_up = int4_kernel([parts(p + "ffn_gate.weight"), parts(p + "ffn_up.weight")])
        down = int4_kernel([parts(p + "ffn_down.weight")])
        layers.append((qkv, o, gate_up, down))
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    if head.tensor_type.name == "Q8_0":
        lm_head = Int4(*q8_0_parts(head), BLOCK, repeats=2)
    elif head.tensor_type.name in INT4_TYPES:
        lm_head = int4_kernel([int4_parts(head)])
    else:  # F16 / BF16 / F32: the plain weight the model already holds
        lm_head = dense_kernel(model.lm_head)
    return QuantisedWeights(layers=layers, lm_head=lm_head, precision="q4")


def _layer_groups(tensors: dict) -> list[list[list[str]]]:
    """Per layer, the GGUF tensors of each fused projection: [q, k, v], [o], [gate, up], [down]."""
    layers = sorted({int(n.split(".")[1]) for n in tensors if n.startswith("blk.")})
    return [[[f"blk.{i}.attn_{n}.weight" for n in "qkv"], [f"blk.{i}.attn_output.weight"],
             [f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"], [f"blk.{i}.ffn_down.weight"]] for i in layers]


def _block_kind(tensors: dict, names: list[str]) -> str | None:
    """The one kind of block the q4f32 kernel reads that all of `names` are stored in, else None."""
    kinds = {tensors[n].kind for n in names}
    return kinds.pop() if len(kinds) == 1 and kinds <= set(block_linear.OFFSET) else None


def runs_as_blocks(gguf_path, precision: str = "q4f32") -> bool:
    """Whether the block mode `precision` runs this GGUF file: each fused projection stored in one kind of
    block its kernel reads, and the kernel builds here."""
    tensors = stored_tensors(gguf_path)
    kinds = [_block_kind(tensors, names) for layer in _layer_groups(tensors) for names in layer]
    activations = BLOCK_ACTIVATIONS[precision]
    return None not in kinds and all(block_linear.built(kind, activations) for kind in set(kinds))


def block_weights(gguf_path, model: TargetModel, precision: str = "q4f32") -> QuantisedWeights:
    """The `precision` mode's kernels (q4f32 / q4q8) of `model` (a float32 `TargetModel` loaded from the same
    file): each projection's GGUF blocks as stored (Q4_0 / Q4_1 / Q8_0, one kind for the tensors of a
    fused projection)."""
    tensors = stored_tensors(gguf_path)
    activations = BLOCK_ACTIVATIONS[precision]

    def kernel(names: list[str], order: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> BlockLinear:
        kind = _block_kind(tensors, names)
        if kind is None:
            stored = ", ".join(f"{n} {tensors[n].kind}" for n in names)
            raise DsparkError(f"--dtype {precision} runs {' / '.join(block_linear.OFFSET)} GGUF tensors, one kind "
                              f"for the parts of a fused projection; {gguf_path} stores {stored}: use --dtype float32")
        if not block_linear.built(kind, activations):
            raise DsparkError(f"--dtype {precision} needs its C++ kernel, which could not be built here (see the "
                              "warning above: a C++ compiler such as g++ is required, and for q4q8 an AVX2 CPU); "
                              "use --dtype float32")
        rows = np.concatenate([tensors[n].raw(gguf_path).reshape(tensors[n].shape[1], -1, block_linear.BYTES[kind])
                               for n in names])
        return BlockLinear(kind, rows if order is None else rows[order.numpy()], bias, activations)

    order = _qkv_order(model)
    layers = [(kernel(qkv, order, None if layer.bqkv is None else layer.bqkv.detach()), kernel(o), kernel(gate_up),
               kernel(down)) for layer, (qkv, o, gate_up, down) in zip(model.layers, _layer_groups(tensors))]
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    # an F16 / BF16 / F32 head: the plain weight the model already holds
    lm_head = kernel([head]) if _block_kind(tensors, [head]) else dense_kernel(model.lm_head)
    # the block kernels are row-invariant, but a dense head's oneDNN product is not
    return QuantisedWeights(layers=layers, lm_head=lm_head, precision=precision,
                            row_invariant=isinstance(lm_head, BlockLinear), fuses_glue=True)
