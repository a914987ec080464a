"""The ragged one-token decode-attention kernel (model/decode_attention.py): built by Inductor's toolchain on
this machine, equal to SDPA row by row, never reading a row's cache beyond its length."""

import logging

import pytest
import torch
import torch.nn.functional as F

from dspark.model import decode_attention as da

CPU = torch.device("cpu")
SHAPES = [(9, 3, 64), (4, 2, 16), (8, 2, 32), (16, 2, 128), (6, 6, 64), (16, 2, 48)]  # heads, kv heads, head dim


def reference(q, kv, lengths):
    """Each row alone through fp32 SDPA over exactly its positions."""
    nkv = kv.shape[1] // 2
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b, n in enumerate(lengths.tolist()):
        if n:
            k, v = kv[b : b + 1, :nkv, :n].float(), kv[b : b + 1, nkv:, :n].float()
            out[b] = F.scaled_dot_product_attention(q[b : b + 1, :, None].float(), k, v, enable_gqa=True)[0, :, 0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_kernel_equals_sdpa_row_by_row_and_reads_nothing_past_a_row(dtype, heads, kv_heads, head_dim):
    assert da.supports(dtype, CPU, heads, kv_heads, head_dim), "the kernel did not build or refused a common shape"
    g = torch.Generator().manual_seed(head_dim)
    lengths = torch.tensor([0, 1, 15, 16, 17, 233, 250, 7])  # idle row, one key, around the vector width, long
    kv = torch.randn(len(lengths), 2 * kv_heads, 256, head_dim, generator=g).to(dtype)
    for b, n in enumerate(lengths.tolist()):
        kv[b, :, n:] = float("nan")  # a stale or rolled-back cache: never read
    q = torch.randn(len(lengths), heads, head_dim, generator=g).to(dtype)
    out = da.decode_attention(q, kv[:, :, :250], lengths)  # a view of the cache up to the longest row
    want = reference(q, kv, lengths)
    assert out.dtype == dtype and not bool(out.isnan().any())
    tol = 1e-5 if dtype == torch.float32 else 1e-2 * float(want.abs().max())  # bf16: the output's rounding
    assert float((out.float() - want).abs().max()) <= tol
    assert bool((out[0] == 0).all())


def test_shapes_it_does_not_run_fall_back():
    assert not da.supports(torch.float16, CPU, 9, 3, 64)
    assert not da.supports(torch.float32, CPU, 18, 2, 64)  # 9 query heads a K/V head
    assert not da.supports(torch.float32, CPU, 4, 2, 20)  # no vector width divides 20
    assert not da.supports(torch.float32, torch.device("meta"), 9, 3, 64)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("DSPARK_DECODE_KERNEL", "0")
    assert not da.supports(torch.float32, CPU, 9, 3, 64)


def test_a_failed_build_logs_once_and_leaves_sdpa(monkeypatch, tmp_path, caplog):
    """No usable compiler: the kernel reports unsupported (a warning, not an error) and callers keep SDPA."""
    from torch._inductor import config

    assert da._vector_width()  # the ISA is picked (with the real compiler) before the compiler goes missing
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    da._built.cache_clear()
    try:
        with config.patch({"cpp.cxx": (None, str(tmp_path / "no-such-compiler"))}), \
                caplog.at_level(logging.WARNING, logger="dspark.model"):
            assert not da.supports(torch.float32, CPU, 4, 2, 80)
            assert not da.supports(torch.float32, CPU, 4, 2, 80)
        assert len([r for r in caplog.records if "could not be built" in r.message]) == 1
    finally:
        da._built.cache_clear()


def test_bad_lengths_are_refused():
    kv = torch.zeros(2, 4, 8, 16)
    q = torch.zeros(2, 4, 16)
    with pytest.raises(ValueError, match="outside"):
        da.decode_attention(q, kv, torch.tensor([3, 9]))
