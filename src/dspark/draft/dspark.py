"""The DSpark drafter (DESIGN.md §3): a DFlash-style parallel block backbone conditioned on target
features, plus the sequential and confidence heads.

`DSparkModel` holds the trainable weights and both forward paths:
  * training: many anchors per sequence packed into one forward under a block attention mask,
    heads teacher-forced (`forward_train`);
  * inference: `DSparkDrafter` keeps an incremental KV cache of the context and samples each
    block semi-autoregressively (`propose`).
The target's token embedding and LM head are shared and frozen: they are passed in (training) or
read from the target (inference), never stored in the module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dspark.draft.base import DraftBlock, token_picker
from dspark.draft.config import DraftConfig
from dspark.draft.heads import ConfidenceHead, SequentialHead
from dspark.draft.layers import DraftLayer, DraftModelBase, ModelDrafter, RMSNorm
from dspark.draft.tree import DraftTree, Expand, TreeLimits, grow_tree
from dspark.model.target import Target
from dspark.sampling import SamplingParams


class DSparkModel(DraftModelBase):
    """Trainable drafter weights; tensor names follow the DeepSpec layout (DESIGN.md §8)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__(cfg)
        t = cfg.target
        H = t.hidden_size
        if cfg.layerwise_fusion:  # per draft layer, softmax weights over the tapped layers
            self.layer_fusion_weights = nn.Parameter(torch.empty(cfg.num_hidden_layers, len(cfg.target_layer_ids)))
        else:
            self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, t.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, t.rms_norm_eps)
        self.markov_head = (
            SequentialHead(cfg.markov_head_type, t.vocab_size, H, cfg.markov_rank, cfg.draft_vocab_size or t.vocab_size)
            if cfg.has_sequential_head else None
        )
        self.confidence_head = (
            ConfidenceHead(H, cfg.head_rank, cfg.confidence_head_with_markov) if cfg.enable_confidence_head else None
        )
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """HF-style init; layer-wise fusion weights as DFlare starts them: draft layer i of D puts logit 2
        on tapped layer ⌊i·m / D⌋ of m (its share of the depth), 0 on the others."""
        super().reset_parameters(std)
        if self.cfg.layerwise_fusion:
            D, m = self.layer_fusion_weights.shape
            with torch.no_grad():
                self.layer_fusion_weights.zero_()
                for i in range(D):
                    self.layer_fusion_weights[i, min(m - 1, i * m // D)] = 2.0

    # ---- shared pieces -------------------------------------------------------------------------
    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """Tapped target features [..., m, H] -> context features H_ctx: [..., H] (shared fusion) or
        [..., D, H], one per draft layer (layer-wise)."""
        taps = taps.to(self.dtype)
        if self.cfg.layerwise_fusion:
            mix = torch.softmax(self.layer_fusion_weights.float(), dim=-1).to(self.dtype)  # [D, m]
            return self.hidden_norm(torch.einsum("...mh,dm->...dh", taps, mix))
        return self.hidden_norm(self.fc(taps.flatten(-2)))

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft layer, keys and values [B, nkv, n, hd] of context features ctx from `context` ([B, n, H]
        or [B, n, D, H])."""
        cos, sin = self.rope(pos)
        layerwise = self.cfg.layerwise_fusion
        return [layer.self_attn.keys_values(ctx[..., i, :] if layerwise else ctx, cos, sin)
                for i, layer in enumerate(self.layers)]

    def block_hidden(self, x: torch.Tensor, pos: torch.Tensor, ctx_kv, mask: torch.Tensor | None) -> torch.Tensor:
        """Embedded block tokens x [B, q, H] at positions pos [B, q] -> final hidden states h [B, q, H].
        `ctx_kv`: per draft layer, its context keys and values (see `append_block`)."""
        cos, sin = self.rope(pos)
        for layer, layer_kv in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, layer_kv, mask)
        return self.norm(x)

    def apply_heads(
        self, h: torch.Tensor, base_logits: torch.Tensor, prev: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher-forced heads: h [..., γ, H], U [..., γ, V], prev [..., γ] -> (logits, confidence logits)."""
        logits, prev_embed = base_logits, None
        if self.markov_head is not None:
            bias, prev_embed = self.markov_head.teacher_forced(h, prev)
            logits = base_logits + bias.to(base_logits.dtype)
        conf = self.confidence_head(h, prev_embed) if self.confidence_head is not None else None
        return logits, conf

    # ---- training path -------------------------------------------------------------------------
    @property
    def train_slots(self) -> int:
        """Predictions per anchor in training (block slots)."""
        return self.cfg.block_size

    def forward_train(
        self,
        taps: torch.Tensor,
        ids: torch.Tensor,
        anchors: torch.Tensor,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All anchors of a batch of sequences in one forward.

        taps [B, S, m, H]: tapped target features of every position; ids [B, S]: the tokens (the
        heads are teacher-forced with them: prev_k is the true token at anchor + k); anchors
        [B, A]: anchor positions (any value for padding slots: they see no context and the caller
        masks them out of the loss).
        Returns logits [B, A, γ, V] (slot k predicts position anchor + k + 1) and confidence logits
        [B, A, γ] (None without a confidence head).
        """
        B, S = taps.shape[:2]
        A, g = anchors.shape[1], self.cfg.block_size
        dev = taps.device
        idx = (anchors[..., None] + torch.arange(g, device=dev)).clamp(max=S - 1)
        prev_tokens = ids.gather(1, idx.flatten(1)).view(B, A, g)
        if taps.is_inference():  # target features computed under inference_mode
            taps = taps.clone()
        ctx = self.context(taps)
        ctx_kv = self.context_kv(ctx, torch.arange(S, device=dev).expand(B, S))

        block_ids = torch.full((B, A, g), self.cfg.mask_token_id, dtype=torch.long, device=dev)
        block_ids[..., 0] = prev_tokens[..., 0]
        x = F.embedding(block_ids.flatten(1), embed_weight).to(self.dtype)
        pos = (anchors[..., None] + torch.arange(g, device=dev)).flatten(1)  # [B, A*γ]
        # context strictly before the anchor; bidirectional inside the own block only
        sees_ctx = torch.arange(S, device=dev)[None, None, :] < anchors[..., None]  # [B, A, S]
        sees_ctx = sees_ctx.repeat_interleave(g, dim=1)  # [B, A*γ, S]
        block_of = torch.arange(A * g, device=dev) // g
        sees_block = (block_of[:, None] == block_of[None, :]).expand(B, -1, -1)
        mask = torch.cat([sees_ctx, sees_block], dim=-1)[:, None]  # [B, 1, A*γ, S + A*γ]

        h = self.block_hidden(x, pos, ctx_kv, mask).view(B, A, g, -1)
        base = F.linear(h, self.draft_lm_head(lm_head_weight).to(h.dtype))
        return self.apply_heads(h, base, prev_tokens)


def markov_w2t(head: SequentialHead) -> torch.Tensor:
    """W2 for the per-slot product u · W2ᵀ of inference: transposed ([r, K] rows: ~2x faster) and in
    fp32 (a one-row bf16 product measured 63 us against 7 us in fp32 for r = 32, K = 8192)."""
    return head.markov_w2.weight.detach().t().float().contiguous()


def markov_logits(base: torch.Tensor, u: torch.Tensor, w2t: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """A slot's logits U + W2·u in fp32, one call: base [n, K] fp32, u [n, r], w2t from `markov_w2t`."""
    return torch.addmm(base, u if u.dtype == torch.float32 else u.float(), w2t, out=out)


def markov_w1(head: SequentialHead) -> torch.Tensor:
    """W1 for inference lookups: the vanilla head's u is W1[prev] itself, and an fp32 table spares a
    conversion per slot."""
    return head.markov_w1.weight.detach().float() if head.kind == "vanilla" else head.markov_w1.weight


def tree_expand(head: SequentialHead | None, h: torch.Tensor, base: torch.Tensor,
                tables: tuple[torch.Tensor, torch.Tensor] | None) -> Expand:
    """`grow_tree`'s expand over one block pass (h [slots, H], base logits [slots, K]): block slot d
    gives the children of every node at depth d, the Markov head conditioning them on the node's
    token (its state carried down the path); DFlash (no head): U_d. `tables`: (`markov_w1`, `markov_w2t`)."""
    def expand(node: int, depth: int, token: int, state):
        if head is None:
            return base[depth], None
        w1, w2t = tables
        u, state = head.step(h[depth : depth + 1], w1[token : token + 1],
                             state if state is not None else head.initial_state(h[:1]))
        return markov_logits(base[depth : depth + 1], u, w2t)[0], state

    return expand


class DSparkDrafter(ModelDrafter):
    """Inference wrapper: incremental context KV cache + the semi-autoregressive sampling loop."""

    def __init__(self, model: DSparkModel, target: Target, num_draft_tokens: int | None = None):
        super().__init__(model, target, num_draft_tokens)
        self._w2t: torch.Tensor | None = None  # inference copies of the Markov head's W2ᵀ and W1 (`run_heads`)
        self._w1: torch.Tensor | None = None
        self.begin([])

    def begin(self, prompt_ids: list[int]) -> None:
        m = self.model
        attn = m.layers[0].self_attn
        shape = (1, attn.nkv, 0, attn.hd)  # per layer [k, v] buffers [1, nkv, capacity, hd]
        self._kv = [[m.inv_freq.new_empty(shape, dtype=m.dtype) for _ in "kv"] for _ in m.layers]
        self.length = 0  # committed context positions held in the cache

    def _reserve(self, end: int) -> None:
        """Buffers for at least `end` positions (grown geometrically, the committed ones kept)."""
        for buf in self._kv:
            for i, t in enumerate(buf):
                if end > t.shape[2]:
                    grown = t.new_empty(*t.shape[:2], max(2 * end, 64), t.shape[3])
                    grown[:, :, : self.length] = t[:, :, : self.length]
                    buf[i] = grown

    @torch.inference_mode()
    def observe(self, tokens: list[int], taps: torch.Tensor | None) -> None:
        end = self.length + taps.shape[0]
        pos = torch.arange(self.length, end, device=taps.device)[None]
        new = self.model.context_kv(self.model.context(taps[None]), pos)
        self._reserve(end)
        for buf, kv in zip(self._kv, new):
            for i, t in enumerate(kv):
                buf[i][:, :, self.length : end] = t
        self.length = end

    @torch.inference_mode()
    def block_outputs(self, anchor: int, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Backbone pass for the block [anchor, MASK x (γ-1)] at positions length..length+γ-1.

        Returns hidden states h [num_slots, H] and base logits U [num_slots, K] (fp32; K = V with
        the full vocabulary)."""
        g, n = self.block_size, self.length
        dev = self.model.inv_freq.device
        ids = torch.tensor([[anchor] + [self.cfg.mask_token_id] * (g - 1)], device=dev)
        pos = torch.arange(n, n + g, device=dev)[None]
        self._reserve(n + g)  # the block's keys / values go after the context's (see `append_block`)
        ctx_kv = [(k, v, n) for k, v in self._kv]
        h = self.model.block_hidden(self.target.model.embed(ids), pos, ctx_kv, None)[0, :num_slots]
        return h, self.vocab_head.logits(h)

    @torch.inference_mode()
    def run_heads(
        self, h: torch.Tensor, base_logits: torch.Tensor, anchor: int, pick: Callable[[torch.Tensor], list[int]]
    ) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
        """The sequential stage: logits_k = U_k + B(prev_k, ...), and `pick` chooses d_k from them.

        `pick` maps logits [k, K] to k draft-vocabulary indices; without a sequential head every slot
        is picked at once. Returns the chosen (target) tokens, the logits they were chosen from
        [slots, K] and confidence logits."""
        head, conf_head = self.model.markov_head, self.model.confidence_head
        if head is None:
            conf = conf_head(h, None) if conf_head is not None else None
            return self.vocab_head.tokens(pick(base_logits)), base_logits, conf
        self._inference_tables()
        logits = torch.empty_like(base_logits)  # filled slot by slot, in place
        rows, base_rows = logits.split(1), base_logits.split(1)
        tokens, embeds = [], []
        prev, state = anchor, head.initial_state(h[:1])
        for k in range(h.shape[0]):
            e = self._w1[prev : prev + 1]
            u, state = head.step(h[k : k + 1], e, state)
            markov_logits(base_rows[k], u, self._w2t, out=rows[k])
            prev = self.vocab_head.tokens(pick(rows[k]))[0]
            tokens.append(prev)
            embeds.append(e)
        conf = conf_head(h, torch.cat(embeds)) if conf_head is not None else None
        return tokens, logits, conf

    def _inference_tables(self) -> None:
        if self._w2t is None:
            self._w2t, self._w1 = markov_w2t(self.model.markov_head), markov_w1(self.model.markov_head)

    def propose_tree(self, anchor: int, limits: TreeLimits, params: SamplingParams,
                     generator: torch.Generator, branch: Sequence[tuple[int, float]] = ()) -> DraftTree:
        """A tree within `limits` from one backbone pass (`tree_expand`; `branch`: `grow_tree`'s)."""
        h, base = self.block_outputs(anchor, min(self.num_draft_tokens, limits.depth))
        head = self.model.markov_head
        if head is not None:
            self._inference_tables()
        expand = tree_expand(head, h, base, (self._w1, self._w2t) if head is not None else None)
        limits = dataclasses.replace(limits, depth=h.shape[0])
        return grow_tree(expand, anchor, limits, params, generator, self.vocab_head.ids, branch)

    def propose(self, anchor: int, max_tokens: int, params: SamplingParams, generator: torch.Generator) -> DraftBlock:
        h, base = self.block_outputs(anchor, min(self.num_draft_tokens, max_tokens))
        pick, probs = token_picker(params, generator)
        tokens, _, conf = self.run_heads(h, base, anchor, pick)
        return DraftBlock(tokens, self.vocab_head.full_probs(torch.cat(probs)) if probs else None,
                          None if conf is None else conf.float())
