"""The two forwards of a training step, as typed results: the frozen target's pass over a micro-batch
(once, shared by every drafter trained on it) and a drafter's pass over a span of its anchors.

Shapes: b sequences of at most S tokens, A anchors per sequence (padded), γ slots per anchor (block
slots, or EAGLE-3's training-time-test steps), m tapped layers of width H, K the draft vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from dspark.model.transformer import TargetModel
from dspark.train.batches import Item
from dspark.train.losses import TargetDist


def clock(device: torch.device) -> float:
    """Wall time, after the device has finished the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclasses.dataclass
class TargetPass:
    """What the frozen target gives the drafters for one micro-batch."""

    ids: torch.Tensor  # [b, S] token ids (0-padded)
    anchors: torch.Tensor  # [b, A] anchor positions (0 where `valid` is False)
    sup: torch.Tensor  # [b, A, γ] bool: slot k of anchor a is supervised (its target token is a response token)
    labels: torch.Tensor  # [b, A, γ] the token each slot should predict
    rows: torch.Tensor  # [b, A, γ] each slot's row in `dist` (-1 where not supervised)
    taps: torch.Tensor  # [b, S, m, H] tapped hidden states of the layers `tap_ids`
    tap_ids: tuple[int, ...]
    dist: TargetDist  # the target's distribution at each distinct position a supervised slot reads
    tokens: int  # real tokens in the micro-batch
    blocks: int  # real anchors
    seconds: float  # the forward's wall time

    def view(self, taps: tuple[int, ...], slots: int) -> "TargetPass":
        """The part of a pass computed for more taps or slots that one drafter (`taps`, `slots`) reads."""
        if self.tap_ids == taps and self.sup.shape[-1] == slots:
            return self
        columns = [self.tap_ids.index(x) for x in taps]
        return dataclasses.replace(self, sup=self.sup[..., :slots], labels=self.labels[..., :slots],
                                   rows=self.rows[..., :slots], taps=self.taps[:, :, columns], tap_ids=taps)

    def anchor_spans(self, chunk: int) -> list[tuple[int, int]]:
        """[start, end) ranges of at most `chunk` anchors: a drafter's pass and backward take one at a time."""
        A = self.anchors.shape[1]
        return [(a, min(a + chunk, A)) for a in range(0, A, chunk)]


@dataclasses.dataclass
class DrafterPass:
    """A drafter's predictions for a span of anchors, beside what the losses compare them with."""

    logits: torch.Tensor  # [b, A', γ, K] draft logits
    conf: torch.Tensor | None  # [b, A', γ] confidence logits (None without a confidence head)
    target: TargetDist  # the target's distribution at the supervised slots, in `sup` order
    labels: torch.Tensor  # [b, A', γ]
    sup: torch.Tensor  # [b, A', γ] bool
    w: torch.Tensor  # [b, A', γ] position weight w_k where supervised, else 0


def _pack(items: list[Item], max_seq_len: int):
    """(ids [b, S], lengths [b], anchors [b, A], valid [b, A]) of a micro-batch."""
    A = max(1, max(len(a) for _, a in items))
    seqs = [(s.prompt_ids + s.response_ids)[:max_seq_len] for s, _ in items]
    b, S = len(seqs), max(len(x) for x in seqs)
    ids = torch.zeros(b, S, dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(x)
    anchors = torch.zeros(b, A, dtype=torch.long)
    valid = torch.zeros(b, A, dtype=torch.bool)
    for i, (_, a) in enumerate(items):
        anchors[i, : len(a)] = torch.tensor(a, dtype=torch.long)
        valid[i, : len(a)] = True
    return ids, torch.tensor([len(x) for x in seqs]), anchors, valid


def target_pass(model: TargetModel, items: list[Item], taps: tuple[int, ...], slots: int, max_seq_len: int,
                device: torch.device, draft_ids: torch.Tensor | None) -> TargetPass:
    """The frozen target's forward over a micro-batch, with its distribution once per input position
    a slot reads (anchors' blocks overlap: with every anchor, each position is read by up to γ slots)."""
    ids, lengths, anchors, valid = (t.to(device) for t in _pack(items, max_seq_len))
    b, S = ids.shape
    t0 = clock(device)
    out = model(ids, model.new_cache(b, S), taps=taps)
    pos = anchors[..., None] + torch.arange(slots, device=device)  # each slot's input; predicts pos + 1
    sup = valid[..., None] & (pos + 1 < lengths[:, None, None])
    at = pos.clamp(max=S - 1)
    labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1).gather(1, at.flatten(1)).view_as(at)
    flat = torch.arange(b, device=device)[:, None, None] * S + at  # index into the [b * S] positions
    needed = torch.unique(flat[sup])
    row_of = torch.full((b * S,), -1, dtype=torch.long, device=device)
    row_of[needed] = torch.arange(needed.numel(), device=device)
    dist = _distributions(model, out.hidden.reshape(b * S, -1)[needed], draft_ids, device)
    return TargetPass(ids=ids, anchors=anchors, sup=sup, labels=labels, rows=row_of[flat], taps=out.taps,
                      tap_ids=taps, dist=dist, tokens=int(lengths.sum()), blocks=int(valid.sum()),
                      seconds=clock(device) - t0)


def _distributions(model: TargetModel, hidden: torch.Tensor, draft_ids: torch.Tensor | None,
                   device: torch.device) -> TargetDist:
    """The target's distributions at `hidden`'s rows, as plain (non-inference) tensors, 1024 rows at a time."""
    with torch.no_grad():
        parts = [TargetDist.from_logits(model.logits(hidden[i : i + 1024]).clone(), draft_ids)
                 for i in range(0, hidden.shape[0], 1024)]
    if parts:
        return TargetDist.cat(parts)
    k = model.cfg.vocab_size if draft_ids is None else draft_ids.numel()  # no supervised slot here
    return TargetDist(torch.zeros(0, k, device=device), torch.zeros(0, device=device),
                      torch.zeros(0, dtype=torch.long, device=device))


def drafter_pass(t: TargetPass, drafter: torch.nn.Module, target: TargetModel, span: tuple[int, int],
                 weights: torch.Tensor, autocast: bool) -> DrafterPass:
    """The drafter's forward for anchors [span) of every sequence (`weights`: w_k, [γ])."""
    part = slice(*span)
    sup = t.sup[:, part]
    device = t.ids.device
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with amp:
        logits, conf = drafter(t.taps, t.ids, t.anchors[:, part], target.embed_tokens, target.lm_head)
    return DrafterPass(logits=logits, conf=conf, target=t.dist[t.rows[:, part][sup]], labels=t.labels[:, part],
                       sup=sup, w=(weights * sup).float())
