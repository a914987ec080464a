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

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dspark.decode.sampling import SamplingParams
from dspark.draft import vocab
from dspark.draft.base import DraftBlock, Drafter, token_picker
from dspark.draft.config import DraftConfig
from dspark.draft.heads import ConfidenceHead, SequentialHead
from dspark.errors import DsparkError
from dspark.target.config import TargetConfig
from dspark.target.kernels import StackedKernel, fast_linears
from dspark.target.model import apply_rope, rms_norm, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_inference_mode_enabled():  # one call instead of ~8; in bf16 within an ulp of the HF form
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


class DraftAttention(nn.Module):
    """Target-shaped attention whose keys/values cover [context ; block tokens].

    `in_features` is the width of its input: the hidden size, or 2x for EAGLE-3's
    [embedding ; feature] input. q, k and v (k and v for context features) run as one product."""

    def __init__(self, cfg: DraftConfig, in_features: int | None = None):
        super().__init__()
        t = cfg.target
        d_in = in_features or t.hidden_size
        self.nh, self.nkv, self.hd = t.num_attention_heads, t.num_key_value_heads, t.head_dim
        self.q_proj = nn.Linear(d_in, self.nh * self.hd, bias=cfg.layer_qkv_bias)
        self.k_proj = nn.Linear(d_in, self.nkv * self.hd, bias=cfg.layer_qkv_bias)
        self.v_proj = nn.Linear(d_in, self.nkv * self.hd, bias=cfg.layer_qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, t.hidden_size, bias=cfg.layer_o_bias)
        if cfg.layer_qk_norm:
            self.q_norm = RMSNorm(self.hd, t.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, t.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self._qkv, self._kv = StackedKernel(), StackedKernel()

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], n, self.hd).transpose(-2, -3)  # [B, n, q, hd]

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, q, d_in] -> RoPE'd queries [B, nh, q, hd], RoPE'd keys and values [B, nkv, q, hd]."""
        nh, nkv = self.nh, self.nkv
        qk, v = self._heads(self._qkv(x, self.q_proj, self.k_proj, self.v_proj), nh + 2 * nkv).split((nh + nkv, nkv), 1)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :nh]), self.k_norm(qk[:, nh:])], dim=1)
        q, k = apply_rope(qk, cos, sin).split((nh, nkv), dim=1)
        return q, k, v

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, q, d_in] -> RoPE'd keys and values [B, nkv, q, hd]."""
        k, v = self._heads(self._kv(x, self.k_proj, self.v_proj), 2 * self.nkv).chunk(2, dim=1)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), v

    def attend(self, q, k, v, mask) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.nkv != self.nh)
        return self.o_proj(out.transpose(1, 2).flatten(-2))

    def forward(self, x, cos, sin, ctx_kv, mask) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        return self.attend(q, *append_block(ctx_kv, k, v), mask)


def append_block(ctx_kv: tuple, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of [context ; block] from the block's k, v [B, nkv, q, hd] and `ctx_kv`: either
    (k, v) of the context [B, nkv, n, hd], copied together with the block's, or (k_buffer, v_buffer, n),
    buffers whose first n positions hold the context and whose capacity covers the block: the block is
    written at n..n+q-1 (scratch past the committed context) and no context is copied."""
    if len(ctx_kv) == 2:
        return torch.cat([ctx_kv[0], k], dim=2), torch.cat([ctx_kv[1], v], dim=2)
    k_buf, v_buf, n = ctx_kv
    end = n + k.shape[2]
    k_buf[:, :, n:end] = k
    v_buf[:, :, n:end] = v
    return k_buf[:, :, :end], v_buf[:, :, :end]


class DraftMLP(nn.Module):
    def __init__(self, t: TargetConfig):
        super().__init__()
        self.gate_proj = nn.Linear(t.hidden_size, t.intermediate_size, bias=False)
        self.up_proj = nn.Linear(t.hidden_size, t.intermediate_size, bias=False)
        self.down_proj = nn.Linear(t.intermediate_size, t.hidden_size, bias=False)
        self._gate_up = StackedKernel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._gate_up(x, self.gate_proj, self.up_proj).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        t = cfg.target
        self.self_attn = DraftAttention(cfg)
        self.mlp = DraftMLP(t)
        self.input_layernorm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(t.hidden_size, t.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_kv, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DraftModelBase(nn.Module):
    """What every drafter model shares: the target's RoPE, init, dtype."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        t = cfg.target
        self.register_buffer("inv_freq", rope_inv_freq(t), persistent=False)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # inference: (cos, sin) [P, hd]
        if cfg.draft_vocab_size:  # EAGLE-3's mapping (draft/vocab.py); the tokens are set by `set_draft_vocab`
            first = torch.arange(cfg.draft_vocab_size)  # until set: the first K token ids
            self.register_buffer("d2t", vocab.to_d2t(first))
            self.register_buffer("t2d", vocab.to_t2d(first, t.vocab_size))

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """The target token id of each draft-vocabulary index [K] (None: the full vocabulary)."""
        return vocab.from_d2t(self.d2t) if self.cfg.draft_vocab_size else None

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """Draft over these K target tokens (sorted, distinct; K = cfg.draft_vocab_size)."""
        vocab.check_ids(ids, self.cfg.target.vocab_size)
        if ids.numel() != self.cfg.draft_vocab_size:
            raise DsparkError(f"{ids.numel()} draft tokens for a drafter of draft_vocab_size {self.cfg.draft_vocab_size}")
        self.d2t.copy_(vocab.to_d2t(ids))
        self.t2d.copy_(vocab.to_t2d(ids, self.cfg.target.vocab_size))

    def draft_lm_head(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """The LM head over the draft vocabulary: the target's rows for its tokens (or all of them)."""
        ids = self.draft_ids
        return lm_head_weight if ids is None else lm_head_weight[ids.to(lm_head_weight.device)]

    def reset_parameters(self, std: float = 0.02) -> None:
        """HF-style init: normal(0, std) matrices, zero biases, unit norms."""
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, std)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [B, q] absolute positions -> cos, sin [B, 1, q, hd] (same values as the target's tables).

        Under inference mode they are looked up in a table of positions 0..P-1 (grown as needed),
        two gathers in place of the ~10 small ops that compute them, which a draft pass right after
        the target's forward pays dearly for; the values are the same bit for bit."""
        if not torch.is_inference_mode_enabled():
            return self.rope_values(pos)
        need = int(pos.max()) + 1
        table = self._rope_table
        if table is None or table[0].shape[0] < need or table[0].dtype != self.dtype or table[0].device != pos.device:
            size = max(need, 256, 2 * table[0].shape[0] if table is not None else 0)
            cos, sin = self.rope_values(torch.arange(size, device=pos.device)[None])
            table = self._rope_table = (cos[0, 0], sin[0, 0])
        return table[0][pos][:, None], table[1][pos][:, None]

    def rope_values(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        emb = pos.float()[..., None] * self.inv_freq
        emb = torch.cat((emb, emb), dim=-1)
        return emb.cos().to(self.dtype)[:, None], emb.sin().to(self.dtype)[:, None]

    def forward(self, *args, **kwargs):
        """The training path (what DistributedDataParallel calls)."""
        return self.forward_train(*args, **kwargs)


class DSparkModel(DraftModelBase):
    """Trainable drafter weights; tensor names follow the DeepSpec layout (DESIGN.md §8)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__(cfg)
        t = cfg.target
        H = t.hidden_size
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

    # ---- shared pieces -------------------------------------------------------------------------
    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """Tapped target features [..., m, H] -> context features H_ctx [..., H]."""
        return self.hidden_norm(self.fc(taps.flatten(-2).to(self.dtype)))

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft layer, keys and values [B, nkv, n, hd] of context features ctx [B, n, H]."""
        cos, sin = self.rope(pos)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

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


class ModelDrafter(Drafter):
    """A Drafter backed by a drafter model sharing the target's embedding and LM head."""

    def __init__(self, model: DraftModelBase, target, num_draft_tokens: int | None = None):
        self.model = fast_linears(model).eval()  # prepacked projections for the inference passes
        self.target = target
        self.cfg = model.cfg
        self.tap_layers = tuple(model.cfg.target_layer_ids)
        self.block_size = model.cfg.block_size
        self.num_draft_tokens = self.max_drafts = min(num_draft_tokens or self.block_size, self.block_size)
        self.temperatures: list[float] | None = None  # STS calibration (DESIGN.md §6), from the checkpoint
        self.has_confidence = model.cfg.enable_confidence_head
        self.vocab_head = vocab.DraftHead(model.draft_ids, target)  # LM head over the draft vocabulary


class DSparkDrafter(ModelDrafter):
    """Inference wrapper: incremental context KV cache + the semi-autoregressive sampling loop."""

    def __init__(self, model: DSparkModel, target, num_draft_tokens: int | None = None):
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
        if self._w2t is None:
            self._w2t = markov_w2t(head)
            # the vanilla head's u is W1[prev] itself: an fp32 table spares a conversion per slot
            self._w1 = head.markov_w1.weight.detach().float() if head.kind == "vanilla" else head.markov_w1.weight
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

    def propose(self, anchor: int, max_tokens: int, params: SamplingParams, generator: torch.Generator) -> DraftBlock:
        h, base = self.block_outputs(anchor, min(self.num_draft_tokens, max_tokens))
        pick, probs = token_picker(params, generator)
        tokens, _, conf = self.run_heads(h, base, anchor, pick)
        return DraftBlock(tokens, self.vocab_head.full_probs(torch.cat(probs)) if probs else None,
                          None if conf is None else conf.float())
