"""Attention of a batched decode step: every row one query token over its own number of cached positions.

Why dspark carries its own small kernel (model/decode_attention.py) for this: each way PyTorch offers,
timed on the same inputs, against the kernel. Shapes are SmolLM2-135M's layer (9 query heads, 3 K/V
heads, head dim 64) in the precision `--dtype auto` picks, 64 rows of 150-900 positions (uniform, as in
a regeneration batch at its steady state), cache of 1,290 positions:

  * `sdpa-masked`: one SDPA call, boolean mask, keys up to the longest row (query heads folded);
  * `sdpa-per-row`: one SDPA call a row over its own keys;
  * `flex`: FlexAttention compiled (its CPU template), a block mask that skips blocks past each row;
  * `inductor`: the same arithmetic as reductions (`torch.compile`, dynamic length);
  * `kernel`: model/decode_attention.py.

Then whole engine steps (the target's forward plus the LM head over every token), SDPA (the shipped
rule) against the kernel: 64 one-token rows of 150-900 positions (regeneration), 32 one-token rows and
32 / 8 rows of 4 tokens (a verify step) of 150-350 positions (the server's chats). Round-robin over `--reps`, medians; the CPU flags are recorded.

    python benchmarks/bench_decode_attention.py --out benchmarks/results/decode_attention.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dspark.model import decode_attention as da
from dspark.model.attention import attention, attention_per_row
from dspark.model.loading import load_target
from dspark.util.platform import cpu_flags

ROWS, MAX_LEN, FLEX_BLOCK = 64, 1290, 128


def reductions(q, k, v, lengths):
    """Decode attention as broadcasts and reductions, for Inductor to generate."""
    B, nh, d = q.shape
    nkv, length = k.shape[1], k.shape[2]
    qf = q.view(B, nkv, nh // nkv, 1, d).float()
    s = (k[:, :, None].float() * qf).sum(-1) / math.sqrt(d)  # [B, nkv, g, L]
    valid = torch.arange(length)[None, None, None, :] < lengths.view(B, 1, 1, 1)
    p = torch.softmax(s.masked_fill(~valid, float("-inf")), -1)
    return (p[..., None] * v[:, :, None].float()).sum(-2).to(q.dtype).reshape(B, nh, d)


def flex_block_mask(lengths: torch.Tensor, length: int) -> BlockMask:
    """Each row's blocks up to its length: the full ones, then one partial block under the mask."""
    B, blocks = lengths.shape[0], (length + FLEX_BLOCK - 1) // FLEX_BLOCK
    full = (lengths // FLEX_BLOCK).to(torch.int32)
    partial = (lengths % FLEX_BLOCK > 0).to(torch.int32)
    index = torch.arange(blocks, dtype=torch.int32).expand(B, 1, 1, blocks).contiguous()
    return BlockMask.from_kv_blocks(partial.view(B, 1, 1), (full.view(B, 1, 1, 1) + 0 * index).contiguous(),
                                    full.view(B, 1, 1), index, BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=lambda b, h, qi, ki: ki < lengths[b], seq_lengths=(1, length))


def attention_arms(cfg, dtype) -> tuple[dict, float]:
    g = torch.Generator().manual_seed(0)
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    lengths = torch.randint(150, 901, (ROWS,), generator=g)
    kv = torch.randn(ROWS, 2 * nkv, MAX_LEN, d, generator=g).to(dtype)
    q = torch.randn(ROWS, nh, d, generator=g).to(dtype)
    longest = int(lengths.max())
    k, v = kv[:, :nkv, :longest], kv[:, nkv:, :longest]
    mask = (torch.arange(longest)[None, :] < lengths[:, None])[:, None, None, :]
    compiled_flex = torch.compile(flex_attention, dynamic=False)
    compiled_reductions = torch.compile(reductions, dynamic=True, fullgraph=True)
    block_mask = flex_block_mask(lengths, MAX_LEN)
    arms = {
        "sdpa-masked": lambda: attention(q[:, :, None], k, v, mask),
        "sdpa-per-row": lambda: attention_per_row(q[:, :, None], k, v, lengths.tolist()),
        "flex": lambda: compiled_flex(q[:, :, None], kv[:, :nkv], kv[:, nkv:], block_mask=block_mask, enable_gqa=True),
        "inductor": lambda: compiled_reductions(q, k, v, lengths),
        "kernel": lambda: da.decode_attention(q[:, None], kv[:, :, :longest], lengths - 1, torch.ones_like(lengths)),
    }
    for fn in arms.values():  # compile outside the timing
        fn()
    megabytes = float(lengths.sum()) * 2 * nkv * d * kv.element_size() / 1e6
    return arms, megabytes


STEPS = {  # name -> (rows, tokens a row, shortest and longest row)
    "64x1 (regeneration)": (64, 1, 150, 900),
    "32x1 (server decode)": (32, 1, 150, 350),
    "32x4 (server verify)": (32, 4, 150, 350),
    "8x4 (server verify)": (8, 4, 150, 350),
}


def step_arms(target) -> dict:
    """Engine steps of the target (forward + LM head over every token), SDPA against the kernel."""
    model = target.model
    arms = {}
    for name, (rows, tokens, shortest, longest) in STEPS.items():
        cache = model.new_cache(rows, longest + tokens)
        for layer in cache.kv:
            layer.normal_()
        lengths = torch.randint(shortest, longest + 1, (rows,), generator=torch.Generator().manual_seed(1))

        def step(kernel: str, cache=cache, lengths=lengths, rows=rows, tokens=tokens):
            os.environ["DSPARK_DECODE_KERNEL"] = kernel
            cache.lengths = lengths.clone()
            hidden = model(torch.randint(0, 1000, (rows, tokens)), cache).hidden
            model.logits(hidden.reshape(rows * tokens, -1))

        arms[f"step {name}, sdpa"] = lambda step=step: step("0")
        arms[f"step {name}, kernel"] = lambda step=step: step("1")
    return arms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = load_target(None, dtype="auto")
    arms, megabytes = attention_arms(target.model.cfg, target.model.dtype)
    arms.update(step_arms(target))
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.reps):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    os.environ.pop("DSPARK_DECODE_KERNEL")
    ms = {name: round(1000 * statistics.median(t), 3) for name, t in times.items()}
    report = {"command": "python benchmarks/bench_decode_attention.py " + " ".join(sys.argv[1:]),
              "machine": {"flags": cpu_flags(), "threads": 2, "precision": str(target.model.dtype)},
              "rows": ROWS, "kv_megabytes_read_by_the_kernel": round(megabytes, 1), "median_ms": ms,
              "kernel_gb_per_s": round(megabytes / ms["kernel"], 1)}
    for name, t in ms.items():
        print(f"{name:>40}: {t:8.2f} ms")
    print(f"kernel: {report['kernel_gb_per_s']} GB/s of K/V ({megabytes:.1f} MB)")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
