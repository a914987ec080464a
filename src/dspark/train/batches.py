"""The data order of a training run: the train / validation split, each epoch's permutation
(length-grouped), each step's sequences and anchors, and a rank's micro-batches.

Every choice is a pure function of (seed, step): a resumed or a multi-process run sees exactly what
an uninterrupted single-process run sees.
"""

from __future__ import annotations

import hashlib
import math

import torch

from dspark.errors import DsparkError
from dspark.train.config import ALL_ANCHORS, TrainConfig
from dspark.train.data import Sample, is_validation, load_samples
from dspark.util.seeding import derived_generator

GROUP_STEPS = 16  # group_by_length sorts this many steps' sequences at a time
Item = tuple[Sample, list[int]]  # a sequence and its anchor positions


def sample_anchors(sample: Sample, max_seq_len: int, count: int | str, gen: torch.Generator) -> list[int]:
    """Up to `count` distinct anchors p with p and p+1 both response tokens (within max_seq_len);
    `count` "all": every such p."""
    n = min(len(sample.prompt_ids) + len(sample.response_ids), max_seq_len)
    lo, hi = len(sample.prompt_ids), n - 2  # inclusive range of valid anchors
    if hi < lo:
        return []
    if count == ALL_ANCHORS:
        return list(range(lo, hi + 1))
    valid = hi - lo + 1
    pick = torch.randperm(valid, generator=gen)[:count]
    return sorted((lo + pick).tolist())


def split_data(cfg: TrainConfig, vocab_size: int) -> tuple[list[Sample], list[Sample]]:
    """(training samples, validation samples) of `cfg.data` (and `cfg.val_data` when given). The
    id-hash split holds out prompts, so every reply to a held-out prompt is held out, in every source."""
    keep = [s for path in cfg.data_paths for s in _load_data(path, cfg.max_seq_len, vocab_size)]
    train_set = [s for s in keep if not is_validation(s.id, cfg.val_fraction)]
    val_set = [s for s in keep if is_validation(s.id, cfg.val_fraction)]
    if cfg.val_data:
        val_set = _load_data(cfg.val_data, cfg.max_seq_len, vocab_size)
        held_out = {s.id for s in val_set}
        train_set = [s for s in train_set if s.id not in held_out]
    if not train_set:
        raise DsparkError(f"{', '.join(cfg.data_paths)}: no training samples left after the validation split")
    return train_set, val_set[: cfg.val_max_samples]


def _load_data(path: str, max_seq_len: int, vocab_size: int) -> list[Sample]:
    keep = [s for s in load_samples(path) if len(s.prompt_ids) <= max_seq_len - 2]
    for s in keep[:50]:  # cheap sanity check that the data was made by this target's tokenizer
        if max(s.prompt_ids + s.response_ids) >= vocab_size:
            raise DsparkError(f"{path}: token ids exceed the target's vocabulary ({vocab_size}); "
                              "was it regenerated with another target?")
    return keep


def data_fingerprint(train_set: list[Sample]) -> str:
    """Identifies the training samples (ids, lengths, split): resuming on other data is refused."""
    h = hashlib.sha256()
    for s in train_set:
        h.update(f"{s.id}:{len(s.prompt_ids)}:{len(s.response_ids)};".encode())
    return f"{len(train_set)}:{h.hexdigest()[:16]}"


class DataOrder:
    """Which sequences and anchors each step trains on."""

    def __init__(self, cfg: TrainConfig, train_set: list[Sample]):
        self.cfg, self.train_set = cfg, train_set
        self._epoch: int | None = None  # the epoch whose permutation is cached
        self._perm = torch.empty(0, dtype=torch.long)

    def global_batch(self, step: int) -> list[Item]:
        """The step's sequences (same on every rank) with their anchors."""
        n, B = len(self.train_set), self.cfg.batch_size
        out = []
        for i in range(B):
            epoch, j = divmod(step * B + i, n)
            s = self.train_set[int(self.permutation(epoch)[j])]
            out.append((s, sample_anchors(s, self.cfg.max_seq_len, self.cfg.anchors_per_seq,
                                          derived_generator(self.cfg.seed, "anchors", step, i))))
        return out

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of the training samples in `epoch`."""
        if self._epoch != epoch:
            gen = derived_generator(self.cfg.seed, "epoch", epoch)
            perm = torch.randperm(len(self.train_set), generator=gen)
            if self.cfg.group_by_length:
                perm = self._group_by_length(perm, gen)
            self._perm, self._epoch = perm, epoch
        return self._perm

    def _group_by_length(self, perm: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Within mega-batches of GROUP_STEPS steps, batch sequences of similar length together (less
        padding in the target's forward), then shuffle the batches."""
        B, c = self.cfg.batch_size, self.cfg.max_seq_len
        length = lambda i: min(len(self.train_set[i].prompt_ids) + len(self.train_set[i].response_ids), c)  # noqa: E731
        out = []
        for start in range(0, len(perm), B * GROUP_STEPS):
            chunk = sorted(perm[start : start + B * GROUP_STEPS].tolist(), key=length, reverse=True)
            batches = [chunk[i : i + B] for i in range(0, len(chunk), B)]
            out += [x for k in torch.randperm(len(batches), generator=gen).tolist() for x in batches[k]]
        return torch.tensor(out)


def validation_batches(cfg: TrainConfig, val_set: list[Sample], batch_size: int) -> list[list[Item]]:
    """The validation set in batches, with anchors fixed by the seed (the same at every validation)."""
    return [[(s, sample_anchors(s, cfg.max_seq_len, cfg.anchors_per_seq, derived_generator(cfg.seed, "val", i + j)))
             for j, s in enumerate(val_set[i : i + batch_size])]
            for i in range(0, len(val_set), batch_size)]


def micro_batches(items: list[Item], rank: int, world: int, grad_accum: int) -> list[list[Item]]:
    """This rank's share of a step's items, in `grad_accum` micro-batches."""
    mine = items[rank::world]
    micro = max(1, math.ceil(len(mine) / grad_accum))
    return [mine[i : i + micro] for i in range(0, len(mine), micro)]


def slot_weights(items: list[Item], weights: list[float], slots: int, max_seq_len: int) -> float:
    """Σ w_k over the supervised slots of `items` (the step's global loss normaliser)."""
    total = 0.0
    for s, anchors in items:
        n = min(len(s.prompt_ids) + len(s.response_ids), max_seq_len)
        for p in anchors:
            total += sum(weights[: min(slots, n - 1 - p)])
    return total
