"""A lean forward pass for Llama-family targets (Llama/SmolLM, Qwen2, Qwen3) with a rollback KV cache.

Plain PyTorch, no HF modeling code. Projections are fused (qkv, gate|up) so one decoder layer is a
handful of kernels; that matters on a CPU where single-token forwards are bound by memory and
Python overhead.

Two numerics, chosen by dtype:
  * fp32 is the reference: HF's order of operations (the exactness tests run it);
  * bf16 and q4 run the same model with fewer ops per layer: RMSNorm as one fp32 scale per row
    (its weight folded into the next projection where the kernel allows), RoPE as one complex
    product on Q / K rows permuted to interleaved pairs, K and V written to the cache in one copy.
The fp32 block modes (q4f32, q4q8) keep fp32's order of operations with a layer's glue fused into their
kernels (`_block_layer`: 6 calls a layer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dspark.errors import DsparkError
from dspark.model import decode_attention, rope_store
from dspark.model.attention import PER_ROW_SPREAD, attention, attention_per_row
from dspark.model.config import TargetConfig
from dspark.model.kernels import Dense, Packed, dense_kernel

RUNNER_VERSION = 7  # bumped when a change moves the runner's speed; SPS profiles are cached per version


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

    `kv[layer][b]` holds row b's K heads then its V heads ([2 * kv_heads, max_len, head_dim]); one tensor
    per layer, so that a compiled step can write each in place.
    `lengths[b]` tokens of row b are valid. A forward appends its tokens at positions
    `lengths[b] ...`; `truncate` rolls rows back to any shorter length (speculative rejection).
    """

    def __init__(self, cfg: TargetConfig, batch_size: int, max_len: int, dtype: torch.dtype, device="cpu"):
        shape = (batch_size, 2 * cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def rows(self, start: int, stop: int) -> KVCache:
        """A view of rows [start, stop) sharing this cache's K/V storage; copy `lengths` back after a forward."""
        view = KVCache.__new__(KVCache)
        view.kv = [layer[start:stop] for layer in self.kv]
        view.lengths = self.lengths[start:stop].clone()
        view.max_len = self.max_len
        return view

    def row(self, b: int) -> KVCache:
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


def interleave_pairs(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows (dim 0) of whole heads from rotate-half order (i, i + d/2) to adjacent pairs (2i, 2i + 1)."""
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, 2, head_dim // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


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
        self.fast = dtype != torch.float32  # see the module docstring
        if self.fast:  # RoPE as e^(i * pos * freq) per interleaved pair
            freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), rope_inv_freq(c))
            self.register_buffer("rope_cis", torch.polar(torch.ones_like(freqs), freqs), persistent=False)
        else:
            cos, sin = rope_tables(c, self.max_positions)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("_eps", torch.tensor(c.rms_norm_eps, dtype=torch.float32), persistent=False)
        self.precision = "float32" if dtype == torch.float32 else "bfloat16"
        # every op computes a token the same bits whatever tokens share its forward (set by `prepare`)
        self.row_invariant = False
        # the block modes' layers with their glue fused into the kernels (`_block_layer`; set by `prepare`)
        self.fused_glue = False
        self._kernels: list[LayerKernels] | None = None  # set by `prepare`
        self._lm_head_kernel = None
        self.compiled = None  # a compiled.CompiledRunner, set by load_target where one is built

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

    def interleave_qk_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Q and K rows (dim 0) of the fused qkv from HF's rotate-half order to interleaved pairs
        (llama.cpp's own layout); V rows unchanged. Attention is invariant to this permutation."""
        c = self.cfg
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q, k, v = rows.split((nh * hd, nkv * hd, nkv * hd))
        return torch.cat([interleave_pairs(q, hd), interleave_pairs(k, hd), v])

    def prepare(self, pack: bool = True, quantised: QuantisedWeights | None = None) -> None:
        """Build each projection's kernel once (see kernels.py) and drop the plain copies they replace.

        `pack`: oneDNN-prepacked weights where they are faster (CPU). `quantised`: the q4 / q4f32 / q4q8 modes'
        kernels (layers and LM head), built from a GGUF file by `quant.py`."""
        if self._kernels is not None:
            raise RuntimeError("TargetModel.prepare runs once")
        c = self.cfg
        make = dense_kernel if pack else Dense
        kernels = []
        for li, layer in enumerate(self.layers):
            w = {n: layer._parameters.pop(n) for n in ("wqkv", "wo", "w_gate_up", "w_down")}
            b = layer.bqkv
            if self.fast:
                w["wqkv"] = self.interleave_qk_rows(w["wqkv"])
                b = None if b is None else self.interleave_qk_rows(b)
                if c.qk_norm:
                    layer.q_norm.copy_(interleave_pairs(layer.q_norm, c.head_dim))
                    layer.k_norm.copy_(interleave_pairs(layer.k_norm, c.head_dim))
            if quantised is not None:
                kernels.append(LayerKernels(*quantised.layers[li], fold_norms=False))
            elif self.fast:  # fold the RMSNorm weights into the projections that read the normed rows
                fold = lambda w_, g: (w_.float() * g.float()).to(w_.dtype)
                kernels.append(LayerKernels(make(fold(w["wqkv"], layer.input_norm), b), make(w["wo"]),
                                            make(fold(w["w_gate_up"], layer.post_norm)), make(w["w_down"]),
                                            fold_norms=True))
            else:
                kernels.append(LayerKernels(make(w["wqkv"], b), make(w["wo"]), make(w["w_gate_up"]),
                                            make(w["w_down"]), fold_norms=False))
        self._kernels = kernels
        if quantised is not None:
            self._lm_head_kernel = quantised.lm_head
            self.precision = quantised.precision
            # and attention too: through the decode kernel (`_attention_of`), where it runs
            self.row_invariant = quantised.row_invariant and decode_attention.supports(
                self.dtype, self.device, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
            self.fused_glue = quantised.fuses_glue and not c.qk_norm and rope_store.built()
        else:
            self._lm_head_kernel = make(self.lm_head)

    @property
    def verify_limit(self) -> int | None:
        """The most tokens one forward of a request may verify in this mode, None for any. With a compiled
        runner, the leading rows of its calls that compute a token exactly as a 1-token call does
        (`exact_rows`: all `rows`, or one fewer on an AVX2-only CPU): a longer forward would run the eager
        model (for int8, the bf16 one) or rows that round differently, and a speculative output would then
        differ from plain decoding in this mode. With row-invariant kernels (q4f32, q4q8), what the decode
        kernel runs: a longer forward would attend through SDPA (`_attention_of`)."""
        if self.compiled is not None:
            return self.compiled.exact_rows
        return decode_attention.MAX_TREE_NODES if self.row_invariant else None

    @property
    def packed(self) -> bool:
        """True when the projections run oneDNN-prepacked weights."""
        return self._kernels is not None and isinstance(self._kernels[0].qkv, Packed)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        return KVCache(self.cfg, batch_size, max_len or self.max_positions, self.dtype, self.device)

    # ---- forward -------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits from final hidden states (call it only on the positions you need)."""
        if self.compiled is not None and (logits := self.compiled.logits(hidden)) is not None:
            return logits
        if self._lm_head_kernel is None:
            self.prepare(pack=False)
        return self._lm_head_kernel(hidden).float()

    def _normed(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """RMSNorm of the fast path: one fp32 scale per row; `weight` None when folded into the next kernel."""
        n = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        h = x * torch.rsqrt(torch.addcmul(self._eps, n, n, value=1.0 / x.shape[-1]))
        return (h if weight is None else h * weight).to(x.dtype)

    def _fast_qkv(self, qkv: torch.Tensor, layer: nn.Module, cis: torch.Tensor) -> torch.Tensor:
        """[N, heads, d] projections -> the same with Q / K normed (Qwen3) and rotated, in place."""
        c = self.cfg
        nh, nkv = c.num_attention_heads, c.num_key_value_heads
        qk = qkv[:, : nh + nkv].float()
        if c.qk_norm:
            qk = torch.cat([F.rms_norm(qk[:, :nh], (c.head_dim,), layer.q_norm.float(), c.rms_norm_eps),
                            F.rms_norm(qk[:, nh:], (c.head_dim,), layer.k_norm.float(), c.rms_norm_eps)], dim=1)
        rotated = torch.view_as_complex(qk.unflatten(-1, (-1, 2))) * cis
        qkv[:, : nh + nkv] = torch.view_as_real(rotated).flatten(-2)
        return qkv

    def _fast_attention_inputs(self, x, layer, kern, cis, kvc, tokens: TokenLayout) -> torch.Tensor:
        """The layer's queries [N, nh, hd] of the N packed tokens x [N, H]; their new keys / values
        written to `kvc` where `tokens` says."""
        c = self.cfg
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        h = self._normed(x, None if kern.fold_norms else layer.input_norm)
        qkv = self._fast_qkv(kern.qkv(h).view(x.shape[0], nh + 2 * nkv, hd), layer, cis)
        tokens.write(kvc, qkv[:, nh:])
        return qkv[:, :nh]

    def _reference_attention_inputs(self, x, layer, kern, cos, sin, kvc, tokens: TokenLayout) -> torch.Tensor:
        """`_fast_attention_inputs` in HF's order of operations (the exact fp32 mode)."""
        c = self.cfg
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        h = rms_norm(x, layer.input_norm, c.rms_norm_eps)
        qk, vh = kern.qkv(h).view(x.shape[0], nh + 2 * nkv, hd).split((nh + nkv, nkv), dim=1)
        if c.qk_norm:
            qk = torch.cat([rms_norm(qk[:, :nh], layer.q_norm, c.rms_norm_eps),
                            rms_norm(qk[:, nh:], layer.k_norm, c.rms_norm_eps)], dim=1)
        qh, kh = apply_rope(qk, cos, sin).split((nh, nkv), dim=1)
        tokens.write(kvc, torch.cat([kh, vh], dim=1))
        return qh

    def _attention_of(self, tokens: TokenLayout, start, end, kv_len: int, tree) -> Callable:
        """How this forward's layers attend: a function (queries [B, q, nh, d], a layer's cache
        [B, 2 * nkv, L >= kv_len, d]) -> [B, q, nh, d]. The engine's decode and verify steps (rows of up to
        MAX_QUERIES tokens, chains or token trees) run the ragged decode kernel; without it, one-token
        rows whose lengths spread attend a row at a time; else one SDPA call, masked unless a lone row
        attends to all it has. With row-invariant projections a lone request's forwards of up to
        MAX_TREE_NODES tokens (its `verify_limit`) run the decode kernel too: it computes a token the same
        whatever tokens share the call, where SDPA's small GEMMs sum in another order for 1 and for 9 query
        tokens (measured on q4f32 SmolLM2: up to 2e-5 apart), and plain decoding and verification must
        agree to the bit."""
        c = self.cfg
        nkv, B, q = c.num_key_value_heads, tokens.B, tokens.q
        visible = None if tree is None else tree[1] if tree[1].ndim == 3 else tree[1][None]
        most = decode_attention.MAX_TREE_NODES if self.row_invariant else decode_attention.MAX_QUERIES
        if (B > 1 or self.row_invariant) and q <= most and (tree is None or B == len(visible)):
            if decode_attention.supports(self.dtype, self.device, c.num_attention_heads, nkv, c.head_dim):
                rows = decode_attention.checked_rows(start, end - start, q, kv_len, visible)  # once, not per layer
                return lambda qs, kv: decode_attention.run(qs, kv, *rows)
            if tree is None and q == 1 and (row_lengths := one_token_row_lengths(start, end)):
                return lambda qs, kv: attention_per_row(qs.transpose(1, 2), kv[:, :nkv, :kv_len],
                                                        kv[:, nkv:, :kv_len], row_lengths).transpose(1, 2)
        mask = None if q == 1 and B == 1 else tokens.mask(kv_len, None if tree is None else tree[1])
        return lambda qs, kv: attention(qs.transpose(1, 2), kv[:, :nkv, :kv_len], kv[:, nkv:, :kv_len],
                                        mask).transpose(1, 2)

    def _block_layer(self, x, li: int, store: rope_store.RopeStore, attend, tokens: TokenLayout) -> torch.Tensor:
        """A decoder layer of the fp32 block modes with its glue fused into their kernels: the RMSNorms and
        SiLU(gate) * up into the products' input rows, the residuals into their outputs (block_glue.h), RoPE
        and the K/V write into one call (rope_store.cpp): 6 calls a layer where the eager ops are ~60."""
        c, layer, kern = self.cfg, self.layers[li], self._kernels[li]
        qkv = kern.qkv(x, norm=layer.input_norm, eps=c.rms_norm_eps).view(x.shape[0], -1, c.head_dim)
        attn = attend(tokens.pad(store(qkv, li)), store.kv[li])
        x = kern.o(tokens.pack(attn).flatten(1), residual=x)
        return kern.down(kern.gate_up(x, norm=layer.post_norm, eps=c.rms_norm_eps), glu=True, residual=x)

    def _output_and_mlp(self, x, layer, kern, attn: torch.Tensor, tokens: TokenLayout) -> torch.Tensor:
        """The rest of a layer after its attention `attn` [B, q, nh, hd]: output projection, MLP, residuals."""
        x = x + kern.o(tokens.pack(attn).flatten(1))
        if self.fast:
            h = self._normed(x, None if kern.fold_norms else layer.post_norm)
        else:
            h = rms_norm(x, layer.post_norm, self.cfg.rms_norm_eps)
        gate, up = kern.gate_up(h).chunk(2, dim=-1)
        return x + kern.down(F.silu(gate) * up)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        num_new: torch.Tensor | None = None,
        taps: tuple[int, ...] = (),
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> ForwardOutput:
        """Append `input_ids` [B, q] to each row of `cache` and return final hidden states.

        Row b's tokens go to positions `cache.lengths[b] + 0..q-1`. With ragged inputs, rows are
        right-padded and `num_new[b]` says how many of the q tokens are real; the cache then grows
        by `num_new[b]` for row b. Only real tokens are computed (packed, see `TokenLayout`): padding
        costs nothing in the projections and writes no K/V; its outputs are zeros.
        `tree`: (depth offsets [q], visibility [q, q] bool) of one row's token tree, or [B, q] and
        [B, q, q] of each row's — row b's token i sits at position `lengths[b] + depth[b, i]`, its K/V
        in slot `lengths[b] + i`, and sees its row's context and the new tokens `visibility[b, i]` marks
        (DSpark's tree verification, `draft/tree.py`).
        """
        if self._kernels is None:
            self.prepare(pack=False)
        B, q = input_ids.shape
        start = cache.lengths
        end = start + (q if num_new is None else num_new)  # each row's new length: padding is never cached
        kv_len = int(end.max())
        if kv_len > cache.max_len:
            raise DsparkError(f"sequence of {kv_len} tokens exceeds the context window of {cache.max_len}")
        whole_row = B == 1 and (num_new is None or int(num_new[0]) == q)
        if tree is not None and tree[0].ndim == 1 and not whole_row:
            raise DsparkError("a one-row token tree (depth [q]) is verified in one whole row; give [B, q] for a batch")
        if self.compiled is not None and whole_row and self.compiled.covers(q, cache.max_len):
            hidden, taps_out = self.compiled.forward(input_ids, cache.kv, int(start[0]), taps, tree)
            cache.lengths = end
            return ForwardOutput(hidden=hidden, taps=taps_out)
        tokens = TokenLayout(start, num_new, q, None if tree is None else tree[0])
        if self.fused_glue:
            store = rope_store.RopeStore(self.rope_cos, self.rope_sin, tokens.pos, *tokens.kv_slots(), cache.kv)
        elif self.fast:
            cis = self.rope_cis[tokens.pos][:, None]  # [N, 1, d/2]
        else:
            cos, sin = self.rope_cos[tokens.pos][:, None], self.rope_sin[tokens.pos][:, None]  # [N, 1, d]
        attend = self._attention_of(tokens, start, end, kv_len, tree)

        c = self.cfg
        x = self.embed(tokens.pack(input_ids))  # [N, H]
        tap_set = set(taps)
        tapped = {-1: x} if -1 in tap_set else {}  # -1: the embedding output (DeepSpec's convention)
        for li, (layer, kern) in enumerate(zip(self.layers, self._kernels)):
            if self.fused_glue:
                x = self._block_layer(x, li, store, attend, tokens)
            else:
                kvc = cache.kv[li]
                if self.fast:
                    qh = self._fast_attention_inputs(x, layer, kern, cis, kvc, tokens)
                else:
                    qh = self._reference_attention_inputs(x, layer, kern, cos, sin, kvc, tokens)
                x = self._output_and_mlp(x, layer, kern, attend(tokens.pad(qh), kvc), tokens)
            if li in tap_set:
                tapped[li] = x
        cache.lengths = end
        hidden = self._normed(x, self.norm) if self.fast else rms_norm(x, self.norm, c.rms_norm_eps)
        if c.num_hidden_layers - 1 in tap_set:  # HF's last hidden state, which DeepSpec taps, is after the norm
            tapped[c.num_hidden_layers - 1] = hidden
        taps_out = tokens.pad(torch.stack([tapped[t] for t in taps], dim=1)) if taps else None
        return ForwardOutput(hidden=tokens.pad(hidden), taps=taps_out)


def one_token_row_lengths(start: torch.Tensor, end: torch.Tensor) -> list[int] | None:
    """The keys each row of a one-token batch attends to (0: a row without a token), when attending
    a row at a time (`attention_per_row`) pays: when the longest row exceeds the mean by more than
    `PER_ROW_SPREAD` positions; else None (one masked call over the longest row's keys)."""
    lengths = end * (end > start)
    active = lengths[lengths > 0]
    if not len(active) or int(active.max()) - float(active.float().mean()) <= PER_ROW_SPREAD:
        return None
    return lengths.tolist()


class TokenLayout:
    """Where a forward's tokens sit. Rows b = 0..B-1 bring `num_new[b]` of q (right-padded) tokens at
    positions `start[b]...`; the projections run on the N real ones packed ([N, ...], row-major),
    attention on the padded [B, q] grid. Without padding packing is a view."""

    def __init__(self, start: torch.Tensor, num_new: torch.Tensor | None, q: int, depth: torch.Tensor | None = None):
        """`num_new` None: every row brings all q tokens. `depth` [q]: a tree's position offsets
        (default 0..q-1); K/V slots stay `start + 0..q-1`."""
        self.B, self.q, self.start = start.shape[0], q, start
        steps = torch.arange(q, device=start.device)
        offsets = steps[None, :] if depth is None else depth.to(start.device).view(-1, q)
        self.grid_pos = start[:, None] + offsets  # [B, q]
        self.index = None if num_new is None or bool((num_new == q).all()) else (
            (steps[None, :] < num_new[:, None]).flatten().nonzero().squeeze(1))  # [N] in B * q
        self.pos = self.pack(self.grid_pos)
        self.single_start = int(start[0]) if self.B == 1 and self.index is None else None
        if self.single_start is None:  # where `write` scatters each token's K / V: row b's token i to start[b] + i
            self.rows = (torch.arange(self.B, device=start.device).repeat_interleave(q) if self.index is None
                         else self.index // q)
            self.slots = self.pos if depth is None else self.pack(start[:, None] + steps[None, :])

    def kv_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache row, slot) [N] where each packed token's K / V go (`write`'s)."""
        if self.single_start is not None:
            s = self.single_start
            return torch.zeros(self.q, dtype=torch.long), torch.arange(s, s + self.q, device=self.start.device)
        return self.rows, self.slots

    def pack(self, grid: torch.Tensor) -> torch.Tensor:
        """[B, q, ...] -> [N, ...]."""
        flat = grid.reshape(self.B * self.q, *grid.shape[2:])
        return flat if self.index is None else flat[self.index]

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, q, ...], zeros where a row has no token."""
        if self.index is not None:
            flat = packed.new_zeros(self.B * self.q, *packed.shape[1:])
            flat[self.index] = packed
            packed = flat
        return packed.view(self.B, self.q, *packed.shape[1:])

    def mask(self, kv_len: int, visible: torch.Tensor | None = None) -> torch.Tensor:
        """[B, 1, q, kv_len] bool: each grid token sees its row's positions up to its own; with trees'
        `visible` ([q, q] of one whole row, or [B, q, q]), its row's context and the new tokens marked."""
        keys = torch.arange(kv_len, device=self.pos.device)
        if visible is None:
            return (keys[None, None, :] <= self.grid_pos[:, :, None])[:, None]
        visible = visible.to(self.pos.device)
        if visible.ndim == 2:
            start = kv_len - self.q
            return torch.cat([visible.new_ones(self.q, start), visible], dim=1)[None, None]
        rel = keys[None, :] - self.start[:, None]  # [B, kv_len]: a key's index among its row's new tokens
        new = visible.gather(2, rel.clamp(0, self.q - 1)[:, None, :].expand(-1, self.q, -1))
        new &= ((rel >= 0) & (rel < self.q))[:, None, :]
        return (new | (rel < 0)[:, None, :])[:, None]

    def write(self, kvc: torch.Tensor, kv_new: torch.Tensor) -> None:
        """One layer's new keys and values [N, 2 * kv_heads, hd] into its cache kvc [B, 2 * kv_heads, L, hd]."""
        if self.single_start is not None:
            s = self.single_start
            kvc[0, :, s : s + self.q] = kv_new.transpose(0, 1)
        else:  # advanced-index assignment: CPU scatter_ has no fast bf16 kernel (~200x slower)
            kvc[self.rows, :, self.slots] = kv_new


@dataclasses.dataclass
class LayerKernels:
    qkv: object  # a kernels.py kernel: called like F.linear
    o: object
    gate_up: object
    down: object
    fold_norms: bool  # the RMSNorm weights are folded into qkv / gate_up


@dataclasses.dataclass
class QuantisedWeights:
    """A GGUF mode's kernels (quant.py): per layer (qkv, o, gate_up, down), the LM head, the mode's name."""

    layers: list[tuple[object, object, object, object]]
    lm_head: object
    precision: str
    row_invariant: bool = False  # the kernels compute a row the same bits whatever rows share the call
    fuses_glue: bool = False  # the layers' kernels take BlockLinear's norm / glu / residual (`_block_layer`)
