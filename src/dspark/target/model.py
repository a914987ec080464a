"""A lean forward pass for Llama-family targets (Llama/SmolLM, Qwen2, Qwen3) with a rollback KV cache.

Plain PyTorch, no HF modeling code. Projections are fused (qkv, gate|up) so one decoder layer is a
handful of kernels; that matters on a CPU where single-token forwards are bound by memory and
Python overhead.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from dspark.errors import DsparkError
from dspark.target.config import TargetConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF-compatible RMSNorm: normalise in fp32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(cfg: TargetConfig) -> torch.Tensor:
    """RoPE's per-pair inverse frequencies [head_dim / 2] (HF's default rope)."""
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))


def rope_tables(cfg: TargetConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(cfg))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, q, d]; cos/sin: [B, 1, q, d] (HF "rotate_half" convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class KVCache:
    """K/V of every layer for a batch of sequences; each row has its own committed length.

    `lengths[b]` tokens of row b are valid. A forward appends its tokens at positions
    `lengths[b] ...`; `truncate` rolls rows back to any shorter length (speculative rejection).
    """

    def __init__(self, cfg: TargetConfig, batch_size: int, max_len: int, dtype: torch.dtype, device="cpu"):
        shape = (cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def rows(self, start: int, stop: int) -> "KVCache":
        """A view of rows [start, stop) sharing this cache's K/V storage; copy `lengths` back after a forward."""
        view = KVCache.__new__(KVCache)
        view.k, view.v = self.k[:, start:stop], self.v[:, start:stop]
        view.lengths = self.lengths[start:stop].clone()
        view.max_len = self.max_len
        return view

    def row(self, b: int) -> "KVCache":
        return self.rows(b, b + 1)

    def truncate(self, lengths: torch.Tensor | list[int] | int) -> None:
        new = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device).expand_as(self.lengths)
        if bool((new > self.lengths).any()) or bool((new < 0).any()):
            raise ValueError(f"cannot roll KV cache from {self.lengths.tolist()} forward to {new.tolist()}")
        self.lengths = new.clone()


@dataclasses.dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [B, q, H] final hidden state after the last norm
    taps: torch.Tensor | None  # [B, q, m, H] HF hidden states of the tapped layers: -1 the embedding, i the
    # output of decoder layer i (the last one after the final norm, as HF's hidden_states[-1] is)


def _mkldnn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def can_pack_fp32() -> bool:
    """oneDNN prepacked fp32 GEMM: ~2x faster than the default CPU BLAS for the small-M products
    of decoding and verification on CPUs without native bf16 (measured in benchmarks/)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


class TargetModel(nn.Module):
    def __init__(self, cfg: TargetConfig, dtype: torch.dtype = torch.float32, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        c = cfg
        q_out = c.num_attention_heads * c.head_dim
        kv_out = c.num_key_value_heads * c.head_dim
        self.embed_tokens = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = (
            self.embed_tokens
            if c.tie_word_embeddings
            else nn.Parameter(torch.empty(c.vocab_size, c.hidden_size, dtype=dtype), requires_grad=False)
        )
        self.norm = nn.Parameter(torch.ones(c.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList()
        for _ in range(c.num_hidden_layers):
            layer = nn.Module()
            layer.input_norm = nn.Parameter(torch.ones(c.hidden_size, dtype=dtype), requires_grad=False)
            layer.post_norm = nn.Parameter(torch.ones(c.hidden_size, dtype=dtype), requires_grad=False)
            layer.wqkv = nn.Parameter(torch.empty(q_out + 2 * kv_out, c.hidden_size, dtype=dtype), requires_grad=False)
            layer.bqkv = (
                nn.Parameter(torch.zeros(q_out + 2 * kv_out, dtype=dtype), requires_grad=False)
                if c.attention_bias
                else None
            )
            layer.wo = nn.Parameter(torch.empty(c.hidden_size, q_out, dtype=dtype), requires_grad=False)
            layer.w_gate_up = nn.Parameter(
                torch.empty(2 * c.intermediate_size, c.hidden_size, dtype=dtype), requires_grad=False
            )
            layer.w_down = nn.Parameter(torch.empty(c.hidden_size, c.intermediate_size, dtype=dtype), requires_grad=False)
            if c.qk_norm:
                layer.q_norm = nn.Parameter(torch.ones(c.head_dim, dtype=dtype), requires_grad=False)
                layer.k_norm = nn.Parameter(torch.ones(c.head_dim, dtype=dtype), requires_grad=False)
            self.layers.append(layer)
        self.max_positions = max_positions or c.max_position_embeddings
        cos, sin = rope_tables(c, self.max_positions)
        self.register_buffer("rope_cos", cos.to(dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(dtype), persistent=False)
        self._linear = F.linear
        self._lm_head_kernel: torch.Tensor | None = None  # packed LM head, when packed

    def pack_weights(self) -> None:
        """Swap the decoder's fp32 projection weights for oneDNN-prepacked copies (CPU only).

        The packed tensors replace the plain ones (no extra memory), except the LM head, which stays
        plain too because drafters share it."""
        if self.dtype != torch.float32 or self.device.type != "cpu" or not can_pack_fp32():
            return
        pack = torch.ops.mkldnn._reorder_linear_weight
        for layer in self.layers:
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                w = layer._parameters.pop(name)
                setattr(layer, name, pack(w.detach(), 8))
        self._lm_head_kernel = pack(self.lm_head.detach(), 8)
        self._linear = _mkldnn_linear

    @property
    def packed(self) -> bool:
        """True once `pack_weights` swapped in oneDNN-prepacked fp32 weights."""
        return self._lm_head_kernel is not None

    def _attention(self, q, k, v, mask, gqa: bool) -> torch.Tensor:
        # CPU SDPA is ~10x slower in bf16 than fp32 without native bf16 units; the upcast is cheap
        if q.dtype == torch.bfloat16 and q.device.type == "cpu" and not cpu_has_native_bf16():
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=gqa)
            return out.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    # ---- weights -------------------------------------------------------------------------
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load weights named as in HF `*ForCausalLM` checkpoints (fusing qkv and gate/up)."""
        c = self.cfg

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise DsparkError(f"checkpoint is missing tensor {name!r}; is it a {c.family} model?")
            return sd[name]

        with torch.no_grad():
            self.embed_tokens.copy_(take("model.embed_tokens.weight"))
            if not c.tie_word_embeddings:
                self.lm_head.copy_(take("lm_head.weight"))
            self.norm.copy_(take("model.norm.weight"))
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                layer.input_norm.copy_(take(p + "input_layernorm.weight"))
                layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
                a = p + "self_attn."
                layer.wqkv.copy_(torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"]))
                if layer.bqkv is not None:
                    layer.bqkv.copy_(torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"]))
                layer.wo.copy_(take(a + "o_proj.weight"))
                if c.qk_norm:
                    layer.q_norm.copy_(take(a + "q_norm.weight"))
                    layer.k_norm.copy_(take(a + "k_norm.weight"))
                m = p + "mlp."
                layer.w_gate_up.copy_(torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")]))
                layer.w_down.copy_(take(m + "down_proj.weight"))

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        return KVCache(self.cfg, batch_size, max_len or self.max_positions, self.dtype, self.device)

    # ---- forward -------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits from final hidden states (call it only on the positions you need)."""
        weight = self.lm_head if self._lm_head_kernel is None else self._lm_head_kernel
        return self._linear(hidden, weight).float()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        num_new: torch.Tensor | None = None,
        taps: tuple[int, ...] = (),
    ) -> ForwardOutput:
        """Append `input_ids` [B, q] to each row of `cache` and return final hidden states.

        Row b's tokens go to positions `cache.lengths[b] + 0..q-1`. With ragged inputs, rows are
        right-padded and `num_new[b]` says how many of the q tokens are real; the cache then grows
        by `num_new[b]` for row b (padding K/V land beyond the valid length and are never read).
        """
        B, q = input_ids.shape
        start = cache.lengths
        if num_new is None:
            num_new = torch.full((B,), q, dtype=torch.long, device=input_ids.device)
        if int((start + q).max()) > cache.max_len:
            raise DsparkError(
                f"sequence of {int((start + q).max())} tokens exceeds the context window of {cache.max_len}"
            )
        pos = start[:, None] + torch.arange(q, device=input_ids.device)[None, :]  # [B, q]
        cos = self.rope_cos[pos][:, None]  # [B, 1, q, d]
        sin = self.rope_sin[pos][:, None]
        kv_len = int((start + q).max())
        single = B == 1
        rows_idx = torch.arange(B, device=input_ids.device)[:, None]  # with pos [B, q]: each row's new slots
        if q == 1 and single:
            mask = None
        else:
            mask = (torch.arange(kv_len, device=input_ids.device)[None, None, :] <= pos[:, :, None])[:, None]

        c = self.cfg
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        x = self.embed(input_ids)
        tap_set = set(taps)
        tapped = {-1: x} if -1 in tap_set else {}  # -1: the embedding output (DeepSpec's convention)
        lin = self._linear
        for li, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, c.rms_norm_eps)
            qkv = lin(h, layer.wqkv, layer.bqkv).view(B, q, nh + 2 * nkv, hd).transpose(1, 2)
            qk, vh = qkv.split((nh + nkv, nkv), dim=1)
            if c.qk_norm:
                qk = torch.cat([rms_norm(qk[:, :nh], layer.q_norm, c.rms_norm_eps),
                                rms_norm(qk[:, nh:], layer.k_norm, c.rms_norm_eps)], dim=1)
            qh, kh = apply_rope(qk, cos, sin).split((nh, nkv), dim=1)
            kc, vc = cache.k[li], cache.v[li]
            if single:
                s = int(start[0])
                kc[0, :, s : s + q] = kh[0]
                vc[0, :, s : s + q] = vh[0]
            else:  # advanced-index assignment: CPU scatter_ has no fast bf16 kernel (~200x slower)
                kc[rows_idx, :, pos] = kh.transpose(1, 2)
                vc[rows_idx, :, pos] = vh.transpose(1, 2)
            attn = self._attention(qh, kc[:, :, :kv_len], vc[:, :, :kv_len], mask, nkv != nh)
            x = x + lin(attn.transpose(1, 2).reshape(B, q, nh * hd), layer.wo)
            h = rms_norm(x, layer.post_norm, c.rms_norm_eps)
            gate, up = lin(h, layer.w_gate_up).chunk(2, dim=-1)
            x = x + lin(F.silu(gate) * up, layer.w_down)
            if li in tap_set:
                tapped[li] = x
        cache.lengths = start + num_new
        hidden = rms_norm(x, self.norm, c.rms_norm_eps)
        if c.num_hidden_layers - 1 in tap_set:  # HF's last hidden state, which DeepSpec taps, is after the norm
            tapped[c.num_hidden_layers - 1] = hidden
        taps_out = torch.stack([tapped[t] for t in taps], dim=2) if taps else None
        return ForwardOutput(hidden=hidden, taps=taps_out)
