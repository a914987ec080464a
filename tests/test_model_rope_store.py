"""The fp32 block modes' RoPE / K/V-store kernel (rope_store.cpp): bit for bit the eager ops it replaces,
for every layout a forward hands it (a lone chain, ragged engine rows, a token tree), and bad indices
refused before C++ reads them."""

import pytest
import torch

from dspark.model import rope_store
from dspark.model.config import TargetConfig
from dspark.model.transformer import TokenLayout, apply_rope, rope_tables

pytestmark = pytest.mark.skipif(not rope_store.built(), reason="no C++ toolchain for the kernel here")

NH, NKV, D, L = 6, 2, 32, 40


def tables():
    cfg = TargetConfig(family="llama", vocab_size=64, hidden_size=NH * D, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=NH, num_key_value_heads=NKV, head_dim=D, rope_theta=10000.0,
                       rms_norm_eps=1e-6, max_position_embeddings=L, tie_word_embeddings=True)
    return rope_tables(cfg, L)


def eager(qkv, cos, sin, tokens: TokenLayout, kvc):
    """What transformer.py's fp32 layer does with the same rows (`_reference_attention_inputs`)."""
    c, s = cos[tokens.pos][:, None], sin[tokens.pos][:, None]
    qh, kh = apply_rope(qkv[:, : NH + NKV], c, s).split((NH, NKV), dim=1)
    tokens.write(kvc, torch.cat([kh, qkv[:, NH + NKV :]], dim=1))
    return qh


@pytest.mark.parametrize("layout", ["chain", "ragged rows", "tree"])
def test_rope_store_is_the_eager_rope_and_cache_write_bit_for_bit(layout):
    g = torch.Generator().manual_seed(0)
    if layout == "chain":
        tokens = TokenLayout(torch.tensor([7]), None, 5)
    elif layout == "ragged rows":
        tokens = TokenLayout(torch.tensor([3, 11, 0]), torch.tensor([2, 4, 1]), 4)
    else:  # one row's tree: depths 0, 1, 1, 2 in slots 9..12
        tokens = TokenLayout(torch.tensor([9]), None, 4, torch.tensor([0, 1, 1, 2]))
    n, rows = tokens.pos.shape[0], tokens.B
    qkv = 3 * torch.randn(n, NH + 2 * NKV, D, generator=g)
    cos, sin = tables()
    want_cache = torch.randn(rows, 2 * NKV, L, D, generator=g)
    got_cache = want_cache.clone()
    want = eager(qkv, cos, sin, tokens, want_cache)
    store = rope_store.RopeStore(cos, sin, tokens.pos, *tokens.kv_slots(), [torch.zeros_like(got_cache), got_cache])
    got = store(qkv, 1)
    assert torch.equal(got, want)
    assert torch.equal(got_cache, want_cache)


def test_rope_store_refuses_indices_outside_the_tables_or_the_cache():
    cos, sin = tables()
    one, cache = torch.zeros(1, dtype=torch.long), [torch.zeros(1, 2 * NKV, L, D)]
    with pytest.raises(ValueError, match="outside"):
        rope_store.RopeStore(cos, sin, torch.tensor([L]), one, one, cache)  # past the RoPE tables
    with pytest.raises(ValueError, match="outside"):
        rope_store.RopeStore(cos, sin, one, torch.tensor([1]), one, cache)  # a cache row that is not there
    with pytest.raises(ValueError, match="outside"):
        rope_store.RopeStore(cos, sin, one, one, torch.tensor([L]), cache)  # past the cache's positions
    with pytest.raises(ValueError, match="one layout"):
        rope_store.RopeStore(cos, sin, one, one, one, [*cache, torch.zeros(1, 2 * NKV, L + 1, D)])
    with pytest.raises(ValueError, match="one layout"):
        rope_store.RopeStore(cos, sin, one, one, one, [torch.zeros(1, 2 * NKV, D, L).transpose(2, 3)])
    store = rope_store.RopeStore(cos, sin, one, one, one, cache)
    with pytest.raises(ValueError, match="does not fit"):
        store(torch.zeros(2, NH + 2 * NKV, D), 0)  # more tokens than positions
