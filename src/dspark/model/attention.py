"""Scaled dot-product attention with grouped K/V heads, shaped for decoding on a CPU.

Both the target and the drafters call `attention`. Decode-shaped queries (a few tokens per row:
plain decoding, verification, a draft block) fold each K/V head's group of query heads into its
query rows, so SDPA sees one [group * q, L] problem per K/V head instead of `enable_gqa`. On a
CPU, PyTorch's flash kernel runs 1-token queries ~7x faster that way (32 rows x 400 positions,
bf16: 0.98 ms vs 6.8 ms; benchmarks/results/README.md, "batched step"), with the same result: each
query row still attends to the same keys and values. Long query blocks (prefill, training) keep
`enable_gqa`, which is as fast there and needs no copied mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.model.kernels import cpu_has_native_bf16

FOLD_MAX_QUERIES = 16  # fold the query-head groups up to this many query tokens per row
# one-token rows attend a row at a time once the longest exceeds the mean by this many positions: a
# masked call costs ~0.11 us per row and position of the longest row, a row's own call ~19 us more than
# its positions (64 rows, bf16, AMX Xeon; equal at a spread of ~165)
PER_ROW_SPREAD = 160


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [B, nh, q, d], k / v [B, nkv, L, d], mask None or bool (True: attend) broadcastable to
    [B, nh, q, L] as SDPA's -> [B, nh, q, d]."""
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and not cpu_has_native_bf16():
        # CPU SDPA is ~10x slower in bf16 than fp32 without native bf16 units; the upcast is cheap
        return attention(q.float(), k.float(), v.float(), mask).to(q.dtype)
    B, nh, n, d = q.shape
    nkv = k.shape[1]
    if mask is not None and mask.dim() < 4:
        mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
    per_head_mask = mask is not None and mask.shape[1] != 1
    if nkv == nh or n > FOLD_MAX_QUERIES or per_head_mask:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nkv != nh)
    group = nh // nkv
    if mask is not None and mask.shape[2] > 1:  # row r of the folded queries is query token r % n
        mb, length = mask.shape[0], mask.shape[3]
        mask = mask[:, :, None].expand(mb, 1, group, n, length).reshape(mb, 1, group * n, length)
    out = F.scaled_dot_product_attention(q.reshape(B, nkv, group * n, d), k, v, attn_mask=mask)
    return out.view(B, nh, n, d)


def attention_per_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """One-token queries of ragged rows: q [B, nh, 1, d], row b attending to its first `lengths[b]`
    keys of k / v [B, nkv, L, d] (0: a row without a query, whose output is zeros). One unmasked call
    per row, each exactly a lone request's (query-head groups folded as in `attention`): on a CPU the
    flash kernel's boolean mask costs what the longest row costs, for every row."""
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and not cpu_has_native_bf16():
        return attention_per_row(q.float(), k.float(), v.float(), lengths).to(q.dtype)
    B, nh, _, d = q.shape
    nkv = k.shape[1]
    folded = q.view(B, nkv, nh // nkv, d)  # one token: row r of a K/V head's group is query head r
    out = torch.zeros_like(folded)
    for b, n in enumerate(lengths):
        if n:
            out[b] = F.scaled_dot_product_attention(folded[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n])[0]
    return out.view(B, nh, 1, d)
