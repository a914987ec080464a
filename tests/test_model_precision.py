"""The runner's precision modes: the bf16 fast path (folded norms, interleaved RoPE), q4 (a GGUF's
int4 blocks run as stored), q4f32 and q4q8 (its blocks as stored, fp32 / 8-bit activations). Greedy near-tie checks of
each mode are in test_decode_generate.py."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from dspark.errors import DsparkError
from dspark.model import decode_attention
from dspark.model.block_linear import BYTES, BlockLinear
from dspark.model.kernels import FastLinear, Int4, StackedKernel, cpu_has_native_bf16, fast_linears
from dspark.model.loading import load_target, parse_dtype
from dspark.model.quant import _blocks, dequantise_int4, int4_kernel, int4_parts, q8_0_parts


def gguf_tensor(w: np.ndarray, qtype: GGMLQuantizationType):
    """What gguf.GGUFReader hands out for a quantised [N, K] weight (dims listed innermost first)."""
    return SimpleNamespace(name="blk.0.ffn_up.weight", tensor_type=qtype, shape=[w.shape[1], w.shape[0]],
                           data=quants.quantize(w, qtype))


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_int4_blocks_are_read_exactly_and_multiplied_by_the_kernel(qtype):
    w = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    t = gguf_tensor(w, qtype)
    q, scale, zero = int4_parts(t)
    stored = torch.from_numpy(quants.dequantize(t.data, qtype))
    assert torch.equal(dequantise_int4(q, scale, zero), stored)
    assert int(q.min()) >= 0 and int(q.max()) <= 15

    kernel = int4_kernel([(q, scale, zero)])
    assert isinstance(kernel, Int4)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1)).bfloat16()
    # the kernel's one rounding of the weights: its scales and zeros are bf16
    w_kernel = dequantise_int4(q, scale.bfloat16().float(), zero.bfloat16().float())
    want = x.float() @ w_kernel.t()
    got = kernel(x).float()
    assert (got - want).abs().max().item() <= 1e-2 * want.abs().max().item()  # bf16 output rounding
    one_row = torch.cat([kernel(x[i : i + 1]) for i in range(5)]).float()
    assert (one_row - got).abs().max().item() <= 1e-2 * want.abs().max().item()


def test_q8_0_blocks_are_two_exact_int4_nibbles():
    """The q4 mode's LM head: a Q8_0 weight as lo | hi nibbles whose int4 weights sum to it exactly."""
    w = 3 * np.random.default_rng(4).standard_normal((64, 96)).astype(np.float32)
    t = gguf_tensor(w, GGMLQuantizationType.Q8_0)
    q, scale, zero = q8_0_parts(t)
    halves = dequantise_int4(q, scale, zero)
    stored = torch.from_numpy(quants.dequantize(t.data, GGMLQuantizationType.Q8_0))
    assert torch.equal(halves[:, :96] + halves[:, 96:], stored)

    kernel = Int4(q, scale, zero, 32, repeats=2)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(5)).bfloat16()
    w_kernel = dequantise_int4(q, scale.bfloat16().float(), zero.bfloat16().float())
    want = x.float() @ (w_kernel[:, :96] + w_kernel[:, 96:]).t()
    assert (kernel(x).float() - want).abs().max().item() <= 1e-2 * want.abs().max().item()


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
def test_block_kernel_multiplies_the_stored_weights_the_same_for_any_rows(qtype):
    """q4f32's kernel: its weights are bit for bit gguf-py's dequantisation (what float32 mode holds), its
    products those of fp32 arithmetic, and a row's result is the same bits whatever rows share the call
    (1..17 rows: every register tile; 50 outputs: a partial output tile)."""
    w = 2 * np.random.default_rng(7).standard_normal((50, 128)).astype(np.float32)
    t = gguf_tensor(w, qtype)
    kernel = BlockLinear(qtype.name, _blocks(t, BYTES[qtype.name]))
    stored = torch.from_numpy(quants.dequantize(t.data, qtype))
    assert torch.equal(kernel.dequantised(), stored)

    x = torch.randn(17, 128, generator=torch.Generator().manual_seed(2))
    got = kernel(x)
    want = x.double() @ stored.double().t()
    assert (got.double() - want).abs().max().item() < 1e-5 * want.abs().max().item()
    for rows in range(1, 18):
        assert torch.equal(kernel(x[:rows]), got[:rows]), rows
    assert torch.equal(torch.cat([kernel(x[i : i + 1]) for i in range(17)]), got)
    with pytest.raises(TypeError, match="fp32 activations"):
        kernel(x.bfloat16())


def llama_cpp_product(x: torch.Tensor, kernel: BlockLinear) -> torch.Tensor:
    """What the q4q8 kernel computes, in float64: each row's blocks of 32 quantised as llama.cpp's
    quantize_row_q8 does (d = max |x| / 127, codes rounded to nearest even), times the stored codes."""
    m = x.shape[0]
    xb = x.view(m, -1, 32)
    dx = xb.abs().amax(-1) / 127  # fp32, as the kernel divides
    inv = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    c = torch.round(xb * inv[..., None]).double()  # [m, blocks, 32]
    raw = kernel.codes.view(kernel.out_features, -1, kernel.codes.shape[-1])
    q = torch.cat([raw & 0x0F, raw >> 4], -1) if raw.dtype == torch.uint8 else raw  # [n, blocks, 32]
    dots = torch.einsum("mbk,nbk->mnb", c, q.double())
    y = (dots * kernel.d.double()[None] * dx.double()[:, None]).sum(-1)
    if kernel.kind != "Q8_0":  # Q4_1's m, Q4_0's -8 d, per unit of the block's quantised sum
        added = kernel.m[:, : dx.shape[1]].double()
        y += (c.sum(-1) * dx.double()) @ added.t()
    return y


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
def test_q8_kernel_takes_llama_cpps_products_the_same_for_any_rows(qtype):
    """q4q8's kernel: the stored codes times activations quantised per block of 32 (llama.cpp's
    arithmetic, exact in integers, then fp32 scales), close to the exact fp32 product (8-bit rounding of
    the activations), and a row's result the same bits whatever rows share the call."""
    w = 2 * np.random.default_rng(7).standard_normal((50, 160)).astype(np.float32)  # 5 blocks: a padded m
    t = gguf_tensor(w, qtype)
    kernel = BlockLinear(qtype.name, _blocks(t, BYTES[qtype.name]), activations="q8")
    stored = torch.from_numpy(quants.dequantize(t.data, qtype)).double()
    x = torch.randn(17, 160, generator=torch.Generator().manual_seed(2))
    x[3, 40:72] = 0  # a block of zeros: a zero scale, no division by it
    got = kernel(x)
    assert (got.double() - llama_cpp_product(x, kernel)).abs().max().item() < 1e-5 * got.abs().max().item()
    exact = x.double() @ stored.t()
    assert (got.double() - exact).abs().max().item() < 0.02 * exact.abs().max().item()
    for rows in range(1, 18):
        assert torch.equal(kernel(x[:rows]), got[:rows]), rows
    assert torch.equal(torch.cat([kernel(x[i : i + 1]) for i in range(17)]), got)
    with pytest.raises(ValueError, match="one-hot"):
        kernel.dequantised()


@pytest.mark.parametrize("activations", ["f32", "q8"])
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
def test_block_kernels_fuse_a_layers_glue_around_the_product(qtype, activations):
    """block_glue.h: SiLU(gate) * up and the residual are PyTorch's own arithmetic bit for bit, the RMSNorm
    is HF's up to the order of its sum, and each stays row-invariant (1..17 rows)."""
    w = 2 * np.random.default_rng(7).standard_normal((50, 160)).astype(np.float32)
    kernel = BlockLinear(qtype.name, _blocks(gguf_tensor(w, qtype), BYTES[qtype.name]), activations=activations)
    g = torch.Generator().manual_seed(3)
    x, gate_up, weight, residual = (torch.randn(*s, generator=g) for s in ((17, 160), (17, 320), (160,), (17, 50)))
    glued = kernel(gate_up, glu=True, residual=residual)
    assert torch.equal(glued, residual + kernel(F.silu(gate_up[:, :160]) * gate_up[:, 160:]))
    normed = kernel(x, norm=weight, eps=1e-5)
    want = kernel(F.rms_norm(x, (160,), weight, 1e-5))
    assert (normed - want).abs().max().item() < 1e-4 * want.abs().max().item()
    for rows in range(1, 18):
        assert torch.equal(kernel(gate_up[:rows], glu=True, residual=residual[:rows]), glued[:rows]), rows
        assert torch.equal(kernel(x[:rows], norm=weight, eps=1e-5), normed[:rows]), rows
    with pytest.raises(ValueError, match="not both"):
        kernel(gate_up, norm=weight, glu=True)


def test_block_modes_fuse_the_glue_of_every_layer_close_to_the_eager_ops(smollm2_q4f32):
    """The block modes run `_block_layer` (6 kernel calls a layer); with the eager glue instead (the path
    Qwen3's q/k norms and a missing C++ toolchain take) q4f32's logits agree to its fp32 rounding."""
    m = smollm2_q4f32.model
    assert m.fused_glue
    fused = prompt_logits(smollm2_q4f32)
    m.fused_glue = False
    try:
        eager = prompt_logits(smollm2_q4f32)
    finally:
        m.fused_glue = True
    # measured on SmolLM2: max |diff| 5.9e-5 on logits of magnitude ~38 (the RMSNorm's sum order)
    assert (fused - eager).abs().max().item() < 1e-4 * eager.abs().max().item()
    assert torch.equal(fused.argmax(-1), eager.argmax(-1))


def test_fast_path_matches_fp32_on_every_family(tiny_targets):
    """bf16 folds norms into projections and permutes Q / K rows (Qwen2's bias and Qwen3's q/k norms
    with them): logits stay near fp32's, batched ragged rows equal one-by-one forwards."""
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    for name, model_dir in tiny_targets:
        ref = load_target(model_dir, dtype=torch.float32, require_tokenizer=False).model
        fast = load_target(model_dir, dtype=torch.bfloat16, require_tokenizer=False).model
        assert fast.fast and not ref.fast
        want = ref.logits(ref(ids, ref.new_cache(1, 32)).hidden)
        got = fast.logits(fast(ids, fast.new_cache(1, 32)).hidden)
        # the plain bf16 forward this replaced measured up to 7.4% here (Qwen2); the fast path 8.2%
        assert (got - want).abs().max().item() < 0.1 * want.abs().max().item(), name

        cache = fast.new_cache(2, 32)
        batch = torch.cat([ids, torch.cat([ids[:, :10], torch.zeros(1, 14, dtype=torch.long)], 1)])
        both = fast.logits(fast(batch, cache, num_new=torch.tensor([24, 10])).hidden)
        alone = fast.logits(fast(ids[:, :10], fast.new_cache(1, 32)).hidden)
        assert (both[0] - got[0]).abs().max().item() < 0.05 * want.abs().max().item(), name
        assert (both[1, :10] - alone[0]).abs().max().item() < 0.05 * want.abs().max().item(), name
        assert cache.lengths.tolist() == [24, 10]


def prompt_logits(target) -> torch.Tensor:
    """The target's logits at every position of one chat prompt (the modes' closeness to fp32 is measured there)."""
    ids = target.encode_prompt("Explain why the sky is blue in two sentences.")
    m = target.model
    return m.logits(m(torch.tensor([ids]), m.new_cache(1, len(ids))).hidden[0])


def test_q4_runs_the_gguf_blocks_close_to_the_exact_model(smollm2_fp32):
    q4 = load_target(None, dtype="q4")
    m = q4.model
    assert m.precision == "q4" and isinstance(m._kernels[0].gate_up, Int4)
    assert isinstance(m._lm_head_kernel, Int4) and m._lm_head_kernel.repeats == 2  # the Q8_0 head, as stored
    got, want = prompt_logits(q4), prompt_logits(smollm2_fp32)
    # measured on SmolLM2: max |diff| 1.25 on logits of magnitude ~40, 95% of top-1 choices agree
    assert (got - want).abs().max().item() < 0.1 * want.abs().max().item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.85


def test_q4f32_is_the_float32_model_at_the_files_bytes(smollm2_fp32, smollm2_q4f32):
    m = smollm2_q4f32.model
    assert m.precision == "q4f32" and m.dtype == torch.float32 and not m.fast
    assert isinstance(m._kernels[0].qkv, BlockLinear) and m._lm_head_kernel.kind == "Q8_0"  # the head as stored
    got, want = prompt_logits(smollm2_q4f32), prompt_logits(smollm2_fp32)
    # the same weights in fp32 arithmetic, summed in another order: measured max |diff| 1.5e-4 (logits ~38)
    assert (got - want).abs().max().item() < 1e-3 * want.abs().max().item()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    kernels = [m._lm_head_kernel, *(k for lk in m._kernels for k in (lk.qkv, lk.o, lk.gate_up, lk.down))]
    held = sum(t.numel() * t.element_size() for k in kernels for t in (k.codes, k.d, k.m))
    # Q4_1 0.75 bytes a weight, the Q8_0 head 1.25 (codes and fp32 d, m a block): measured 0.86; float32 holds 4
    assert held < 0.9 * sum(k.out_features * k.in_features for k in kernels)


@pytest.mark.parametrize("mode", ["smollm2_q4f32", "smollm2_q4q8"])
def test_block_modes_compute_a_token_the_same_whatever_tokens_share_its_forward(request, mode):
    """The modes `auto` runs on CPUs without bf16 units are verify-invariant: a token's logits are the same
    bits in a 1-token forward (plain decoding), in any longer chain and in a token tree whose branches
    put its path in other slots (verification), so greedy speculation is exact by construction, not by
    the luck of no near-tie. (SDPA's small GEMMs broke this for lone requests: up to 2e-5 apart in q4f32,
    which q4q8's 8-bit rounding of the activations turned into different tokens.)"""
    from dspark.draft.tree import DraftTree

    target = request.getfixturevalue(mode)
    m = target.model
    assert m.row_invariant
    prompt = target.encode_prompt("Write a Python function that checks whether a number is prime.")
    ext = [28, 339, 1012, 2888, 47, 9, 88, 1000, 5]
    cache = m.new_cache(1, 256)
    m(torch.tensor([prompt]), cache)
    chain = m.logits(m(torch.tensor([ext]), cache).hidden[0])
    for k in range(1, len(ext)):
        cache.truncate(len(prompt))
        assert torch.equal(m.logits(m(torch.tensor([ext[:k]]), cache).hidden[0]), chain[:k]), k
    # anchor ext[0]; 17 decoy branches (a forward longer than the engine's decode rows), then ext[1..3]
    decoys = list(range(100, 117))
    tree = DraftTree([*decoys, ext[1], ext[2], ext[3]], [-1] * 17 + [-1, 17, 18])
    cache.truncate(len(prompt))
    out = m.logits(m(torch.tensor([[ext[0], *tree.tokens]]), cache, tree=tree.attention()).hidden[0])
    assert torch.equal(out[[0, 18, 19, 20]], chain[:4])
    assert m.verify_limit == decode_attention.MAX_TREE_NODES  # longer forwards attend through SDPA


def test_block_modes_without_the_decode_kernel_claim_no_invariance(monkeypatch):
    """Switched off (or not built), the decode kernel leaves attention to SDPA: the mode then promises no
    more than the eager modes (no exact verify limit; greedy identity only up to near-ties)."""
    monkeypatch.setenv("DSPARK_DECODE_KERNEL", "0")
    m = load_target(None, dtype="q4f32").model
    assert not m.row_invariant and m.verify_limit is None


def test_q4q8_is_llama_cpps_arithmetic_close_to_the_exact_model(smollm2_fp32, smollm2_q4q8):
    m = smollm2_q4q8.model
    assert m.precision == "q4q8" and m.dtype == torch.float32 and m._lm_head_kernel.activations == "q8"
    got, want = prompt_logits(smollm2_q4q8), prompt_logits(smollm2_fp32)
    # measured on SmolLM2: max |diff| 2.44 on logits of magnitude ~38 (the 8-bit activations: q4f32 1.5e-4),
    # 95% of top-1 choices agree (q4, bf16 activations: 1.25, 95%)
    assert (got - want).abs().max().item() < 0.1 * want.abs().max().item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


def write_gguf(path, kinds):
    """A one-layer GGUF of q, k, v, o, gate, up, down projections [32, 64] stored as `kinds`."""
    import gguf

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, kind in zip(["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"], kinds):
        w = rng.standard_normal((32, 64)).astype(np.float32)
        writer.add_tensor(f"blk.0.{name}.weight", quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_stored_tensors_are_indexed_once_and_reindexed_when_the_index_is_cut(tmp_path, monkeypatch):
    from dspark.model.gguf_file import read_gguf, stored_tensors

    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "m.gguf", [GGMLQuantizationType.Q4_1] * 6 + [GGMLQuantizationType.Q8_0])
    table = stored_tensors(path)
    for t in read_gguf(path).tensors:
        assert table[t.name].kind == t.tensor_type.name and table[t.name].shape == (64, 32)
        assert np.array_equal(table[t.name].raw(path), np.asarray(t.data).view(np.uint8).reshape(-1))
    (index,) = (tmp_path / "cache" / "gguf-index").iterdir()
    assert stored_tensors(path) == table  # read back from the index
    index.write_text(index.read_text()[:40])  # cut short (a killed write cannot do this: it is atomic)
    assert stored_tensors(path) == table


def test_q4f32_runs_a_gguf_whose_fused_projections_share_one_block_kind(tmp_path, monkeypatch):
    """A fused projection (q|k|v, gate|up) must be stored in one kind the kernel reads: mixed files (as
    llama.cpp's K-quant mixes make them) are not offered to `auto`, and `--dtype q4f32` refuses them."""
    from dspark.model.quant import block_weights, runs_as_blocks

    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))  # the files' tensor index
    q41, q80 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
    assert runs_as_blocks(write_gguf(tmp_path / "one.gguf", [q41] * 3 + [q80] + [q41] * 3))  # o alone may differ
    mixed = write_gguf(tmp_path / "mixed.gguf", [q41, q41, q80] + [q41] * 4)  # v apart from q and k
    assert not runs_as_blocks(mixed)
    with pytest.raises(DsparkError, match="blk.0.attn_v.weight Q8_0: use --dtype float32"):
        block_weights(mixed, SimpleNamespace(layers=[SimpleNamespace(bqkv=None)], fast=False,
                                             cfg=SimpleNamespace(family="qwen2", num_attention_heads=1,
                                                                 num_key_value_heads=1, head_dim=32)))


def test_auto_runs_a_gguf_as_blocks_only_without_bf16_units(tiny_targets):
    _, model_dir = tiny_targets[0]
    native = cpu_has_native_bf16()
    assert parse_dtype("auto") == (torch.bfloat16 if native else "q4q8")  # the embedded SmolLM2 GGUF
    assert parse_dtype("auto", spec=model_dir) == (torch.bfloat16 if native else torch.float32)
    assert parse_dtype("auto", quantised=False) == (torch.bfloat16 if native else torch.float32)


def test_q4_needs_a_gguf_file(tiny_targets):
    _, model_dir = tiny_targets[0]
    for mode in ("q4", "q4f32"):
        with pytest.raises(DsparkError, match=f"--dtype {mode} runs a GGUF file's quantised weights"):
            load_target(model_dir, dtype=mode, require_tokenizer=False)
    with pytest.raises(DsparkError, match="runs its own kernel, not the compiled runner"):
        load_target(None, dtype="q4f32", runner="compiled")
    with pytest.raises(DsparkError, match="unknown dtype 'int3'"):
        load_target(model_dir, dtype="int3", require_tokenizer=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_linear_follows_its_weights_and_trains_like_linear(dtype):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48, bias=True).to(dtype)
    fast = fast_linears(torch.nn.Sequential(layer))[0]
    assert isinstance(fast, FastLinear) and fast_linears(torch.nn.Sequential(fast))[0] is fast
    x = torch.randn(8, 64, dtype=dtype)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), F.linear(x, layer.weight, layer.bias), **tol)
    # a load_state_dict after the kernel was built: the next inference pass uses the new weights
    new = {"weight": torch.randn(48, 64, dtype=dtype), "bias": torch.randn(48, dtype=dtype)}
    fast.load_state_dict(new)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), F.linear(x, new["weight"], new["bias"]), **tol)
    # outside inference mode it is F.linear, gradients included
    fast(x).sum().backward()
    assert fast.weight.grad is not None and torch.equal(fast.weight.grad, x.sum(0).expand(48, -1).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_kernel_is_the_separate_products_and_trains_like_them(dtype):
    """q / k / v as one product (a bias on some of them only): the same outputs as the linears one by
    one, in inference mode after any weight change too, and the same gradients outside it."""
    torch.manual_seed(0)
    linears = [torch.nn.Linear(64, n, bias=b).to(dtype) for n, b in ((48, True), (16, False), (16, True))]
    stacked = StackedKernel()
    x = torch.randn(8, 64, dtype=dtype)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)

    def separate():
        return torch.cat([lin(x) for lin in linears], dim=-1)

    with torch.inference_mode():
        torch.testing.assert_close(stacked(x, *linears), separate(), **tol)
    linears[1].load_state_dict({"weight": torch.randn(16, 64, dtype=dtype)})  # after the kernel was built
    with torch.no_grad():
        linears[2].bias.add_(1.0)
    with torch.inference_mode():
        torch.testing.assert_close(stacked(x, *linears), separate(), **tol)
    w = torch.randn(80, dtype=dtype)
    (stacked(x, *linears) * w).sum().backward()
    got = [p.grad.clone() for lin in linears for p in lin.parameters()]
    for lin in linears:
        lin.zero_grad()
    (separate() * w).sum().backward()
    want = [p.grad for lin in linears for p in lin.parameters()]
    for g, h in zip(got, want):
        torch.testing.assert_close(g, h, **tol)
