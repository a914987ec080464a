"""Batched DSpark drafting for the engine: one backbone + LM-head pass for all active slots, the
sequential head vectorised across slots, each slot sampling with its own parameters and generator.

Each engine slot keeps its own context K/V (rows of per-layer buffers); a block attends to its
slot's committed context (masked to the slot's length) and bidirectionally to itself.
"""

from __future__ import annotations

import dataclasses

import torch

from dspark.draft.base import BatchDrafter, DraftBlock
from dspark.draft.dspark import DSparkModel, markov_logits, markov_w1, markov_w2t, tree_expand
from dspark.draft.tree import DraftTree, TreeGrowth, TreeLimits, grow_forest
from dspark.draft.vocab import DraftHead
from dspark.model.kernels import fast_linears
from dspark.model.target import Target
from dspark.sampling import SamplingParams, argmax_rows, probs_from_logits, sample


class BatchedDSparkDrafter(BatchDrafter):
    """`slots` rows of context K/V, each up to `max_len` positions; `temperatures`: STS calibration."""

    def __init__(self, model: DSparkModel, target: Target, slots: int, max_len: int, temperatures: list[float] | None = None):
        self.model = fast_linears(model).eval()  # prepacked projections
        self.target = target
        self.cfg = model.cfg
        self.block_size = self.max_drafts = model.cfg.block_size
        self.tree_rows = slots  # every row of a step grows its tree in the same pass
        self.tap_layers = tuple(model.cfg.target_layer_ids)
        attn = model.layers[0].self_attn
        shape = (slots, attn.nkv, max_len, attn.hd)
        self.k = [model.norm.weight.new_zeros(shape) for _ in model.layers]
        self.v = [model.norm.weight.new_zeros(shape) for _ in model.layers]
        self.lengths = [0] * slots
        self.pending: list[list[torch.Tensor]] = [[] for _ in range(slots)]  # taps not yet in the K/V
        self.max_len = max_len
        self.temperatures = temperatures
        head = model.markov_head
        self._w2t = markov_w2t(head) if head is not None else None
        self._w1 = markov_w1(head) if head is not None else None
        self.vocab_head = DraftHead(model.draft_ids, target)  # LM head over the draft vocabulary

    def start(self, row, prompt_ids, taps) -> None:
        self.lengths[row] = 0
        self.pending[row] = [taps]

    def observe(self, row, tokens, taps) -> None:
        """Queue the committed positions' taps [n, m, H] of `row`; their context K/V is computed at
        the row's next drafting pass, in one go (steps that skip drafting pay nothing for it)."""
        self.pending[row].append(taps)

    @torch.inference_mode()
    def catch_up(self, rows: list[int]) -> None:
        """The context K/V of every listed row's queued taps, in one pass: a context position depends on
        its own taps and position alone, so the rows' queues run as one sequence."""
        rows = [r for r in rows if self.pending[r]]
        if not rows:
            return
        taps = torch.cat([t for r in rows for t in self.pending[r]])
        counts = [sum(t.shape[0] for t in self.pending[r]) for r in rows]
        slot = torch.tensor(rows).repeat_interleave(torch.tensor(counts))
        pos = torch.cat([torch.arange(self.lengths[r], self.lengths[r] + n) for r, n in zip(rows, counts)])
        for buf_k, buf_v, (k, v) in zip(self.k, self.v, self.model.context_kv(self.model.context(taps[None]), pos[None])):
            buf_k[slot, :, pos] = k[0].transpose(0, 1)
            buf_v[slot, :, pos] = v[0].transpose(0, 1)
        for r, n in zip(rows, counts):
            self.lengths[r] += n
            self.pending[r] = []

    @torch.inference_mode()
    def propose(self, slots: list[int], anchors: list[int], budgets: list[int], params: list[SamplingParams],
                generators: list[torch.Generator]) -> list[DraftBlock | None]:
        """One backbone + LM-head pass over the blocks of all drafting rows (`slots`)."""
        rows = [i for i, n in enumerate(budgets) if n > 0]
        out: list[DraftBlock | None] = [None] * len(slots)
        if not rows:
            return out
        m, g = self.model, self.block_size
        h, base = self._block_pass([slots[i] for i in rows], [anchors[i] for i in rows])

        R = len(rows)
        tokens = torch.zeros(R, g, dtype=torch.long)  # draft-vocabulary indices
        probs = [[] for _ in range(R)]
        greedy = [j for j, i in enumerate(rows) if params[i].greedy]
        groups: dict[SamplingParams, list[int]] = {}
        for j, i in enumerate(rows):
            if not params[i].greedy:
                groups.setdefault(params[i], []).append(j)
        head, conf_head = m.markov_head, m.confidence_head
        prev = torch.tensor([anchors[i] for i in rows])
        state = head.initial_state(h[:, 0]) if head is not None else None
        embeds = []
        for k in range(g):
            logits = base[:, k]
            if head is not None:
                e = head.markov_w1.weight[prev]
                u, state = head.step(h[:, k], e, state)
                logits = markov_logits(logits, u, self._w2t)
                embeds.append(e)
            if greedy:
                tokens[greedy, k] = torch.tensor(argmax_rows(logits[greedy]))
            for p, members in groups.items():
                pk = probs_from_logits(logits[members], p)
                u01 = torch.stack([torch.rand((), generator=generators[rows[j]]) for j in members])
                tokens[members, k] = sample(pk, u01)
                for t, j in enumerate(members):
                    probs[j].append(pk[t])
            prev = self.vocab_head.to_target(tokens[:, k])
        tokens = self.vocab_head.to_target(tokens)
        conf = None
        if conf_head is not None:
            conf = conf_head(h, torch.stack(embeds, dim=1) if embeds else None).float()
        for j, i in enumerate(rows):
            n = min(g, budgets[i])
            out[i] = DraftBlock(tokens[j, :n].tolist(),
                                self.vocab_head.full_probs(torch.stack(probs[j][:n])) if probs[j] else None,
                                None if conf is None else conf[j, :n])
        return out

    @torch.inference_mode()
    def propose_trees(self, slots: list[int], anchors: list[int], limits: list[TreeLimits],
                      params: list[SamplingParams], generators: list[torch.Generator], admit,
                      branches=None) -> list[DraftTree]:
        """One backbone + LM-head pass over every row's block, then the rows' trees grown together,
        best-first across rows while `admit` says so (`grow_forest`); `branches`: each row's given path."""
        h, base = self._block_pass(slots, anchors)
        head = self.model.markov_head
        tables = (self._w1, self._w2t) if head is not None else None
        growths = [TreeGrowth(tree_expand(head, h[j], base[j], tables), anchors[j],
                              dataclasses.replace(lim, depth=min(lim.depth, self.block_size)), params[j],
                              generators[j], self.vocab_head.ids, branches[j] if branches else ())
                   for j, lim in enumerate(limits)]
        return grow_forest(growths, admit)

    def _block_pass(self, slots: list[int], anchors: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [R, γ, H] and base logits [R, γ, K] of the blocks [anchor, MASK x (γ-1)] of
        `slots`, each attending to its slot's committed context and bidirectionally to itself."""
        g = self.block_size
        self.catch_up(slots)
        lens = torch.tensor([self.lengths[s] for s in slots])
        ctx = int(lens.max())
        ids = torch.tensor([[a] + [self.cfg.mask_token_id] * (g - 1) for a in anchors])
        pos = lens[:, None] + torch.arange(g)
        index = torch.tensor(slots)
        ctx_kv = [(k[index, :, :ctx], v[index, :, :ctx]) for k, v in zip(self.k, self.v)]
        sees_ctx = (torch.arange(ctx)[None, :] < lens[:, None])[:, None, :].expand(-1, g, -1)
        mask = torch.cat([sees_ctx, torch.ones(len(slots), g, g, dtype=torch.bool)], dim=-1)[:, None]
        h = self.model.block_hidden(self.target.model.embed(ids), pos, ctx_kv, mask)  # [R, γ, H]
        return h, self.vocab_head.logits(h)
