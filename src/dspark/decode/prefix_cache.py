"""Prompt-prefix caching for the engine: the K/V (and the drafter's tapped features) of prompt blocks
already prefilled, reused by later prompts that begin with the same tokens — a chat's system prompt,
a conversation's earlier turns. What vLLM calls automatic prefix caching and llama-server its prompt
cache.

Prompts are cut into blocks of `BLOCK` tokens. A block is keyed by its tokens and the key of the
block before it, so a key stands for the whole prefix up to its end; a lookup walks a prompt's blocks
from the first and stops at the first one not held. A prompt reuses at most its blocks before its last
token (whose logits the prefill must produce). Blocks are evicted least recently used first, leaves
before the blocks they hang from, within a byte budget.

Exactness: a position's K/V (and taps) depend only on the tokens up to it, and the target's products
give each row the same result whatever the number of rows beside it (the premise of the greedy
identity tests), so a prompt prefilled on a cached prefix gets the logits it would get whole
(tests/test_decode_prefix_cache.py checks it token for token)."""

from __future__ import annotations

import collections
import dataclasses

import torch

BLOCK = 16  # tokens a block: vLLM's default block size


@dataclasses.dataclass(eq=False)
class _Block:
    parent: int | None  # the key of the block before it (None: the prompt's first)
    tokens: tuple[int, ...]
    kv: torch.Tensor  # [layers, 2 * kv_heads, BLOCK, head_dim]
    taps: torch.Tensor | None  # [BLOCK, taps, hidden]: what a drafter's context is built from

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (self.taps.nbytes if self.taps is not None else 0)


class PrefixCache:
    """K/V of prompt blocks seen before, up to `capacity_bytes`; `with_taps`: blocks also keep the
    target's tapped features (an engine that drafts needs them for every prompt position)."""

    def __init__(self, capacity_bytes: int, with_taps: bool = False):
        self.capacity_bytes, self.with_taps = capacity_bytes, with_taps
        self._blocks: collections.OrderedDict[int, _Block] = collections.OrderedDict()  # oldest first
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def restore(self, ids: list[int], view) -> tuple[int, torch.Tensor | None]:
        """Copy the K/V of `ids`'s longest cached prefix into the one-row cache `view` and set its length:
        (tokens restored, their taps [n, taps, hidden] or None)."""
        held = []
        for key, parent, tokens in _chain(ids, (len(ids) - 1) // BLOCK):
            block = self._blocks.get(key)
            if block is None or block.parent != parent or block.tokens != tokens:  # a hash collision is a miss
                break
            held.append((key, block))
        for key, _ in reversed(held):  # the first block ends most recent: leaves go first
            self._blocks.move_to_end(key)
        n = len(held) * BLOCK
        view.lengths.fill_(n)
        if not held:
            return 0, None
        kv = torch.cat([b.kv for _, b in held], dim=2)
        for layer, cached in zip(view.kv, kv):
            layer[0, :, :n] = cached
        return n, torch.cat([b.taps for _, b in held]) if self.with_taps else None

    def store(self, ids: list[int], view, taps: torch.Tensor | None, start: int = 0) -> None:
        """Keep the whole blocks of `ids` from token `start` on (a multiple of BLOCK: what `restore`
        did not bring), from the one-row cache `view` that has just prefilled them; `taps`
        [len(ids), taps, hidden] when the cache keeps taps."""
        if self.with_taps and taps is None:
            raise ValueError("this prefix cache keeps taps: store() needs the prompt's taps")
        chain = list(_chain(ids, len(ids) // BLOCK))
        for i, (key, parent, tokens) in enumerate(chain):
            lo = i * BLOCK
            if lo < start or key in self._blocks:
                continue
            kv = torch.stack([layer[0, :, lo : lo + BLOCK] for layer in view.kv])
            block = _Block(parent, tokens, kv, taps[lo : lo + BLOCK].clone() if self.with_taps else None)
            self._blocks[key] = block
            self.bytes += block.nbytes
        for key, _, _ in reversed(chain):  # a prompt's first block ends most recent: leaves go first
            if key in self._blocks:
                self._blocks.move_to_end(key)
        while self.bytes > self.capacity_bytes:
            self.bytes -= self._blocks.popitem(last=False)[1].nbytes


def _chain(ids: list[int], blocks: int):
    """(key, parent key, tokens) of the first `blocks` blocks of `ids`."""
    parent = None
    for i in range(blocks):
        tokens = tuple(ids[i * BLOCK : (i + 1) * BLOCK])
        key = hash((parent, tokens))
        yield key, parent, tokens
        parent = key
