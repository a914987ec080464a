"""The kit every drafter model is built from: RMSNorm, the draft attention (queries from the block,
keys / values from the injected context and the block), the MLP, the pre-norm layer, the model base
(the target's RoPE, init, draft vocabulary) and `ModelDrafter`, the Drafter around such a model.
DSpark / DFlash (`dspark.py`) and EAGLE-3 (`eagle3.py`) share them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.draft import vocab
from dspark.draft.base import Drafter
from dspark.draft.config import DraftConfig
from dspark.errors import DsparkError
from dspark.model.attention import attention
from dspark.model.config import TargetConfig
from dspark.model.kernels import StackedKernel, fast_linears
from dspark.model.target import Target
from dspark.model.transformer import apply_rope, rms_norm, rope_inv_freq


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
        self.own_context_projections = cfg.layerwise_fusion
        if self.own_context_projections:  # DFlare: the context's keys / values get projections of their own
            self.k_proj_target = nn.Linear(d_in, self.nkv * self.hd, bias=cfg.layer_qkv_bias)
            self.v_proj_target = nn.Linear(d_in, self.nkv * self.hd, bias=cfg.layer_qkv_bias)
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
        """Context features x [B, q, d_in] -> RoPE'd keys and values [B, nkv, q, hd]."""
        k, v = self._heads(self._kv(x, *self._context_linears()), 2 * self.nkv).chunk(2, dim=1)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), v

    def _context_linears(self) -> tuple[nn.Module, nn.Module]:
        if self.own_context_projections:
            return self.k_proj_target, self.v_proj_target
        return self.k_proj, self.v_proj

    def attend(self, q, k, v, mask) -> torch.Tensor:
        out = attention(q, k, v, mask)
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
        return self.norm.weight.dtype

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


class ModelDrafter(Drafter):
    """A Drafter backed by a drafter model sharing the target's embedding and LM head."""

    def __init__(self, model: DraftModelBase, target: Target, num_draft_tokens: int | None = None):
        self.model = fast_linears(model).eval()  # prepacked projections for the inference passes
        self.target = target
        self.cfg = model.cfg
        self.tap_layers = tuple(model.cfg.target_layer_ids)
        self.block_size = model.cfg.block_size
        self.num_draft_tokens = self.max_drafts = min(num_draft_tokens or self.block_size, self.block_size)
        self.temperatures: list[float] | None = None  # STS calibration (DESIGN.md §6), from the checkpoint
        self.has_confidence = model.cfg.enable_confidence_head
        self.vocab_head = vocab.DraftHead(model.draft_ids, target)  # LM head over the draft vocabulary
