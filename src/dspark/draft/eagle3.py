"""EAGLE-3 baseline drafter (DESIGN.md §3): an autoregressive one-layer drafter on fused target
features, trained with the training-time test (unrolled on its own hidden states).

Pairs. Position t of the drafter reads the pair (feature f_t, token x_{t+1}) and predicts x_{t+2}:
its layer input is [input_norm(embed(x_{t+1})) ; hidden_norm(f_t)], the residual stream is f_t.
Context pairs use the fused target feature g_t = fc([taps of t]); when drafting, step k ≥ 1 uses
the layer's own output at the previous position as its feature and the token just drafted.

Training unrolls the same chains: step 0 runs every pair of the sequence causally; each anchor p
starts a chain at t = p - 1 whose step k (t + k) attends the step-0 keys up to t and its own
chain keys, exactly what inference sees after the context up to the anchor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dspark.draft.base import DraftBlock, token_picker
from dspark.draft.config import DraftConfig
from dspark.draft.layers import DraftAttention, DraftMLP, DraftModelBase, ModelDrafter, RMSNorm
from dspark.draft.tree import DraftTree, TreeLimits, grow_tree
from dspark.model.target import Target
from dspark.sampling import SamplingParams


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        t = cfg.target
        self.self_attn = DraftAttention(cfg, in_features=2 * t.hidden_size)
        self.mlp = DraftMLP(t)
        self.input_layernorm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(t.hidden_size, t.rms_norm_eps)


class Eagle3Model(DraftModelBase):
    """Trainable EAGLE-3 weights (tensor names as our DSpark checkpoints: fc, hidden_norm, layers.0, norm)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__(cfg)
        H = cfg.target.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.target.rms_norm_eps)
        self.layers = nn.ModuleList([Eagle3Layer(cfg)])
        self.norm = RMSNorm(H, cfg.target.rms_norm_eps)
        self.ttt_steps = cfg.block_size  # chain length unrolled in training (the trainer may change it)
        self.reset_parameters()

    @property
    def train_slots(self) -> int:
        return self.ttt_steps

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """Tapped target features [..., m, H] -> fused feature g [..., H]."""
        return self.fc(taps.flatten(-2).to(self.dtype))

    def pair_step(self, feat, emb, pos, past_k, past_v, mask):
        """Run pairs (feat, emb) [B, q, H] at positions pos [B, q] against past keys/values.

        Returns the layer output (the next feature) [B, q, H] and the pairs' own keys/values."""
        layer = self.layers[0]
        cos, sin = self.rope(pos)
        x = torch.cat([layer.input_layernorm(emb), self.hidden_norm(feat)], dim=-1)
        attn = layer.self_attn
        q, k, v = attn.qkv(x, cos, sin)
        out = attn.attend(q, torch.cat([past_k, k], 2), torch.cat([past_v, v], 2), mask)
        h = feat + out
        return h + layer.mlp(layer.post_attention_layernorm(h)), k, v

    def forward_train(self, taps, ids, anchors, embed_weight, lm_head_weight):
        """Training-time test for a batch: taps [B, S, m, H], ids [B, S], anchors [B, A] (p ≥ 1).

        Returns logits [B, A, K, V]: step k of anchor p predicts position p + k + 1 (the same
        supervision as DSpark block slot k), and None (no confidence head)."""
        B, S = ids.shape
        A, K = anchors.shape[1], self.ttt_steps
        dev = ids.device
        if taps.is_inference():
            taps = taps.clone()
        g = self.fuse(taps)
        nxt = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # x_{t+1} (the last pair is never used)
        pos0 = torch.arange(S, device=dev).expand(B, S)
        causal = torch.ones(S, S, dtype=torch.bool, device=dev).tril()
        empty = g.new_zeros(B, self.layers[0].self_attn.nkv, 0, self.cfg.target.head_dim)
        h0, k0, v0 = self.pair_step(g, F.embedding(nxt, embed_weight).to(self.dtype), pos0, empty, empty, causal)

        t = (anchors - 1).clamp(min=0)  # chain start: the pair (f_{p-1}, x_p)
        feat = h0.gather(1, t[..., None].expand(-1, -1, h0.shape[-1]))
        outs = [feat]
        sees_ctx = torch.arange(S, device=dev)[None, None, :] <= t[..., None]  # [B, A, S]
        same = torch.eye(A, dtype=torch.bool, device=dev).expand(B, A, A)
        ks, vs = [k0], [v0]
        for k in range(1, K):
            tok = ids.gather(1, (anchors + k).clamp(max=S - 1))  # x_{p+k}: the token step k-1 drafted
            mask = torch.cat([sees_ctx] + [same] * k, dim=-1)[:, None]
            feat, kk, vv = self.pair_step(feat, F.embedding(tok, embed_weight).to(self.dtype), t + k,
                                          torch.cat(ks, 2), torch.cat(vs, 2), mask)
            ks.append(kk)
            vs.append(vv)
            outs.append(feat)
        hidden = self.norm(torch.stack(outs, dim=2))  # [B, A, K, H]
        return F.linear(hidden, self.draft_lm_head(lm_head_weight).to(hidden.dtype)), None


class Eagle3Drafter(ModelDrafter):
    """Inference: pair KV cache of the context + γ autoregressive draft steps with exact p_d."""

    def __init__(self, model: Eagle3Model, target: Target, num_draft_tokens: int | None = None):
        super().__init__(model, target, num_draft_tokens)
        self.begin([])

    def begin(self, prompt_ids: list[int]) -> None:
        attn = self.model.layers[0].self_attn
        self._k = torch.empty(1, attn.nkv, 0, attn.hd, dtype=self.model.dtype)
        self._v = torch.empty_like(self._k)
        self.pending: torch.Tensor | None = None  # fused feature of the last observed position
        self.pending_paired = False  # its pair (pending, next token) is already in the cache
        self.length = 0  # pairs in the cache (= position of the next pair)

    def _append_pairs(self, feat: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """Add pairs (feat[i], tokens[i]) at the next positions; returns their layer outputs."""
        n = len(tokens)
        pos = torch.arange(self.length, self.length + n)[None]
        emb = self.target.model.embed(torch.tensor([tokens])).to(self.model.dtype)
        causal = torch.ones(n, self.length + n, dtype=torch.bool).tril(self.length)
        h, k, v = self.model.pair_step(feat[None], emb, pos, self._k, self._v, causal)
        self._k, self._v = torch.cat([self._k, k], 2), torch.cat([self._v, v], 2)
        self.length += n
        return h[0]

    @torch.inference_mode()
    def observe(self, tokens: list[int], taps: torch.Tensor | None) -> None:
        g = self.model.fuse(taps)
        if self.pending is not None and not self.pending_paired:
            self._append_pairs(self.pending[None], tokens[:1])
        if len(tokens) > 1:
            self._append_pairs(g[:-1], tokens[1:])
        self.pending, self.pending_paired = g[-1], False

    @torch.inference_mode()
    def draft_logits(self, anchor: int, steps: int, pick) -> tuple[list[int], torch.Tensor]:
        """Draft `steps` tokens after `anchor`; `pick` maps logits [1, K] to [draft-vocabulary index]."""
        if self.pending_paired:
            raise RuntimeError("propose called twice without observe")
        feat = self._append_pairs(self.pending[None], [anchor])[-1]
        self.pending_paired = True
        ks, vs = self._k, self._v
        tokens, rows = [], []
        pos = self.length - 1
        for step in range(steps):
            logits = self.vocab_head.logits(self.model.norm(feat)[None])
            tok = self.vocab_head.tokens(pick(logits))[0]
            tokens.append(tok)
            rows.append(logits)
            if step == steps - 1:
                break
            pos += 1
            emb = self.target.model.embed(torch.tensor([[tok]])).to(self.model.dtype)
            h, k, v = self.model.pair_step(feat[None, None], emb, torch.tensor([[pos]]), ks, vs, None)
            ks, vs = torch.cat([ks, k], 2), torch.cat([vs, v], 2)
            feat = h[0, 0]
        return tokens, torch.cat(rows)

    @torch.inference_mode()
    def propose_tree(self, anchor: int, limits: TreeLimits, params: SamplingParams,
                     generator: torch.Generator, branch: Sequence[tuple[int, float]] = ()) -> DraftTree:
        """A tree within `limits` by expanding the top-k of each step: a node's children come from one
        pair step on its parent's feature and its own token, attending to the context's pairs and its
        ancestors' (each node's path K/V is its parent's plus its own)."""
        if self.pending_paired:
            raise RuntimeError("propose called twice without observe")
        anchor_feat = self._append_pairs(self.pending[None], [anchor])[-1]
        self.pending_paired = True

        def expand(node: int, depth: int, token: int, parent):  # parent: (its feature, its path's K, V)
            if node < 0:
                state = (anchor_feat, self._k, self._v)
            else:
                feat, ks, vs = parent
                emb = self.target.model.embed(torch.tensor([[token]])).to(self.model.dtype)
                pos = torch.tensor([[self.length - 1 + depth]])
                h, k, v = self.model.pair_step(feat[None, None], emb, pos, ks, vs, None)
                state = (h[0, 0], torch.cat([ks, k], 2), torch.cat([vs, v], 2))
            return self.vocab_head.logits(self.model.norm(state[0])[None])[0], state

        limits = dataclasses.replace(limits, depth=min(limits.depth, self.num_draft_tokens))
        return grow_tree(expand, anchor, limits, params, generator, self.vocab_head.ids, branch)

    def propose(self, anchor: int, max_tokens: int, params: SamplingParams, generator: torch.Generator) -> DraftBlock:
        pick, probs = token_picker(params, generator)
        tokens, _ = self.draft_logits(anchor, min(self.num_draft_tokens, max_tokens), pick)
        return DraftBlock(tokens, self.vocab_head.full_probs(torch.cat(probs)) if probs else None, None)
