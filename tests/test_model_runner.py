"""The lean runner against HF transformers, and its KV cache semantics."""

import pytest
import torch

from dspark.model.loading import load_target


def hf_logits(model_dir, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def runner_logits(target, ids):
    cache = target.model.new_cache(1, len(ids) + 8)
    out = target.model(torch.tensor([ids]), cache)
    return target.model.logits(out.hidden[0])


def assert_matches_hf(target, model_dir, ids, what):
    """Plain-BLAS runner: |diff| <= 1e-4. The oneDNN-prepacked fp32 path (the CPU default) sums in
    another order; across SmolLM2's 30 layers that measured 1.7e-4 on logits of magnitude 38, so it
    is held to a relative 1e-5 of the logit scale instead."""
    ref = hf_logits(model_dir, ids)
    diff = (runner_logits(target, ids) - ref).abs().max().item()
    packed = target.model.packed
    tol = 1e-5 * ref.abs().max().item() if packed else 1e-4
    assert diff <= tol, f"{what} (packed={packed}): max |logit diff| {diff}"


@pytest.mark.parametrize("pack", [False, True])
def test_tiny_families_match_hf(tiny_targets, pack):
    ids = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    for name, model_dir in tiny_targets:
        target = load_target(model_dir, dtype=torch.float32, pack=pack, require_tokenizer=False)
        assert_matches_hf(target, model_dir, ids, name)


def test_smollm2_matches_hf(smollm2_fp32):
    ids = smollm2_fp32.encode_prompt("Explain why the sky is blue in two sentences.")
    plain = load_target(None, dtype=torch.float32, pack=False)
    assert_matches_hf(plain, plain.path, ids, "SmolLM2")
    assert_matches_hf(smollm2_fp32, smollm2_fp32.path, ids, "SmolLM2")


def test_rollback_then_reappend_equals_fresh_forward(tiny_targets):
    name, model_dir = tiny_targets[3]  # qwen3: qk-norm + tied embeddings
    model = load_target(model_dir, dtype=torch.float32, require_tokenizer=False).model
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 128, (1, 20), generator=g)
    rejected = torch.randint(3, 128, (1, 6), generator=g)
    accepted = torch.randint(3, 128, (1, 4), generator=g)

    cache = model.new_cache(1, 64)
    model(prefix, cache)
    model(rejected, cache)  # speculative tokens that get rolled back
    cache.truncate(20)
    got = model.logits(model(accepted, cache).hidden)
    assert cache.lengths.tolist() == [24]

    fresh = model.new_cache(1, 64)
    want = model.logits(model(torch.cat([prefix, accepted], 1), fresh).hidden[:, 20:])
    assert (got - want).abs().max().item() <= 1e-5


def test_batched_ragged_prefill_and_decode_equal_one_by_one(tiny_targets):
    for name, model_dir in tiny_targets:
        model = load_target(model_dir, dtype=torch.float32, require_tokenizer=False).model
        g = torch.Generator().manual_seed(3)
        seqs = [torch.randint(3, 128, (n,), generator=g) for n in (7, 13, 3)]
        nxt = [torch.randint(3, 128, (k,), generator=g) for k in (1, 3, 2)]

        padded = torch.zeros(3, 13, dtype=torch.long)
        for i, s in enumerate(seqs):
            padded[i, : len(s)] = s
        cache = model.new_cache(3, 32)
        out = model(padded, cache, num_new=torch.tensor([7, 13, 3]), taps=(0, 2))
        step = torch.zeros(3, 3, dtype=torch.long)
        for i, s in enumerate(nxt):
            step[i, : len(s)] = s
        out2 = model(step, cache, num_new=torch.tensor([1, 3, 2]), taps=(0, 2))
        assert cache.lengths.tolist() == [8, 16, 5]

        for i, (s, n) in enumerate(zip(seqs, nxt)):
            c1 = model.new_cache(1, 32)
            ref = model(s[None], c1, taps=(0, 2))
            ref2 = model(n[None], c1, taps=(0, 2))
            L, k = len(s), len(n)
            assert (out.hidden[i, :L] - ref.hidden[0]).abs().max() <= 1e-5, name
            assert (out.taps[i, :L] - ref.taps[0]).abs().max() <= 1e-5, name
            assert (out2.hidden[i, :k] - ref2.hidden[0]).abs().max() <= 1e-5, name


@pytest.mark.parametrize("mode", ["kernel", "rows", "masked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_rows_of_ragged_lengths_equal_one_by_one(tiny_targets, monkeypatch, mode, dtype):
    """A decode step over rows of very different lengths (and an idle row) gives each row what it gets
    alone, whether the rows attend through the ragged decode kernel, a row at a time or in one masked
    call (`PER_ROW_SPREAD`)."""
    from dspark.model import decode_attention, transformer

    spread = 0 if mode == "rows" else 10**9
    monkeypatch.setattr(transformer, "PER_ROW_SPREAD", spread)
    monkeypatch.setenv("DSPARK_DECODE_KERNEL", "1" if mode == "kernel" else "0")
    called = []
    monkeypatch.setattr(decode_attention, "run", lambda *a, f=decode_attention.run: called.append(1) or f(*a))
    model = load_target(tiny_targets[0][1], dtype=dtype, require_tokenizer=False).model
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 128, (n,), generator=g) for n in (40, 2, 0, 17)]
    step = torch.randint(3, 128, (4, 1), generator=g)
    cache = model.new_cache(4, 64)
    for i, s in enumerate(seqs):
        if len(s):
            view = cache.row(i)
            model(s[None], view)
            cache.lengths[i] = int(view.lengths[0])
    num_new = torch.tensor([1, 1, 0, 1])
    assert (transformer.one_token_row_lengths(cache.lengths, cache.lengths + num_new) is not None) == (spread == 0)
    out = model(step, cache, num_new=num_new)
    assert cache.lengths.tolist() == [41, 3, 0, 18]
    for i, s in enumerate(seqs):
        if len(s):
            alone = model.new_cache(1, 64)
            model(s[None], alone)
            want = model(step[i : i + 1], alone).hidden[0]
            tol = 1e-5 if dtype == torch.float32 else 2e-2 * float(want.abs().max())  # bf16: a few ulps
            assert (out.hidden[i] - want).abs().max() <= tol, (i, spread)
    assert bool((out.hidden[2] == 0).all())
    assert bool(called) == (mode == "kernel")


def test_ragged_padding_is_not_computed_and_writes_no_cache(tiny_targets):
    """Rows of a ragged forward bring only their real tokens: the cache beyond each row's new length
    keeps what it held, and the padded outputs are zeros (fp32 and the bf16 fast path)."""
    for dtype in (torch.float32, torch.bfloat16):
        model = load_target(tiny_targets[0][1], dtype=dtype, require_tokenizer=False).model
        cache = model.new_cache(3, 16)
        for layer in cache.kv:
            layer.fill_(7.0)
        ids = torch.randint(3, 128, (3, 4), generator=torch.Generator().manual_seed(0))
        out = model(ids, cache, num_new=torch.tensor([2, 0, 4]), taps=(0,))
        assert cache.lengths.tolist() == [2, 0, 4]
        for row, n in enumerate((2, 0, 4)):
            assert all(bool((layer[row, :, n:] == 7.0).all()) for layer in cache.kv), (dtype, row)
            assert not any(bool((layer[row, :, :n] == 7.0).any()) for layer in cache.kv), (dtype, row)
            assert bool((out.hidden[row, n:] == 0).all()) and bool((out.taps[row, n:] == 0).all()), (dtype, row)


def test_cache_refuses_to_roll_forward(tiny_targets):
    model = load_target(tiny_targets[0][1], dtype=torch.float32, require_tokenizer=False).model
    cache = model.new_cache(1, 16)
    model(torch.tensor([[5, 6, 7]]), cache)
    with pytest.raises(ValueError):
        cache.truncate(5)


def test_bf16_runner_is_close_to_fp32(tiny_targets):
    _, model_dir = tiny_targets[2]
    ids = list(range(3, 40))
    a = runner_logits(load_target(model_dir, dtype=torch.float32, require_tokenizer=False), ids)
    b = runner_logits(load_target(model_dir, dtype=torch.bfloat16, require_tokenizer=False), ids)
    assert (a - b).abs().max().item() < 0.1 * a.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 6, 2, 1, 7), (2, 6, 2, 4, 9), (3, 4, 4, 3, 5), (2, 6, 3, 20, 25)])
def test_folded_grouped_attention_equals_sdpa_for_every_mask_shape(shape, dtype):
    """`attention` folds each K/V head's query heads into its query rows for decode-shaped queries;
    every mask SDPA accepts (none, [q, L], per row, per head, one row of keys) must give SDPA's result."""
    import torch.nn.functional as F

    from dspark.model.attention import attention

    B, nh, nkv, n, L = shape
    g = torch.Generator().manual_seed(sum(shape))
    q, k, v = (torch.randn(B, h, m, 8, generator=g, dtype=dtype) for h, m in ((nh, n), (nkv, L), (nkv, L)))
    for mask_shape in (None, (n, L), (B, 1, n, L), (1, nh, n, L), (B, 1, 1, L)):
        mask = None if mask_shape is None else torch.rand(mask_shape, generator=g) > 0.3
        if mask is not None:
            mask[..., 0] = True  # every query sees a key
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=nkv != nh)
        got = attention(q, k, v, mask)
        assert got.shape == want.shape and got.dtype == dtype
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        assert (got.float() - want).abs().max().item() <= tol, mask_shape
