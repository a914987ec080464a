"""The ragged decode-attention kernel (model/decode_attention.py): built by Inductor's toolchain on this
machine, equal to SDPA row by row and token by token, never reading a row's cache beyond what each token sees."""

import logging

import pytest
import torch
import torch.nn.functional as F

from dspark.model import decode_attention as da

CPU = torch.device("cpu")
SHAPES = [(9, 3, 64), (4, 2, 16), (8, 2, 32), (16, 2, 128), (6, 6, 64), (16, 2, 48)]  # heads, kv heads, head dim


def reference(q, kv, start, count):
    """Each token of each row alone through fp32 SDPA over exactly the positions it sees."""
    nkv = kv.shape[1] // 2
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b in range(q.shape[0]):
        for i in range(int(count[b])):
            n = int(start[b]) + i + 1
            k, v = kv[b : b + 1, :nkv, :n].float(), kv[b : b + 1, nkv:, :n].float()
            out[b, i] = F.scaled_dot_product_attention(q[b : b + 1, i, :, None].float(), k, v, enable_gqa=True)[0, :, 0]
    return out


def ragged_batch(heads, kv_heads, head_dim, queries, dtype):
    """Rows of ragged lengths (an idle row, one key, around the vector width, long) with `queries` slots,
    each row's cache past its last token filled with NaN (a stale or rolled-back cache: never read)."""
    g = torch.Generator().manual_seed(head_dim + queries)
    start = torch.tensor([0, 0, 14, 15, 16, 230, 246, 6])
    count = torch.tensor([0, 1, 1, queries, min(2, queries), queries, 1, queries])
    kv = torch.randn(len(start), 2 * kv_heads, 256, head_dim, generator=g).to(dtype)
    for b, n in enumerate((start + count).tolist()):
        kv[b, :, n:] = float("nan")
    q = torch.randn(len(start), queries, heads, head_dim, generator=g).to(dtype)
    return q, kv, start, count


@pytest.mark.parametrize("queries", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_kernel_equals_sdpa_token_by_token_and_reads_nothing_past_a_row(dtype, heads, kv_heads, head_dim, queries):
    assert da.supports(dtype, CPU, heads, kv_heads, head_dim), "the kernel did not build or refused a common shape"
    q, kv, start, count = ragged_batch(heads, kv_heads, head_dim, queries, dtype)
    longest = int((start + count).max())
    out = da.decode_attention(q, kv[:, :, :longest], start, count)  # a view of the cache up to the longest row
    want = reference(q, kv, start, count)
    assert out.dtype == dtype and not bool(out.isnan().any())
    tol = 1e-5 if dtype == torch.float32 else 1e-2 * float(want.abs().max())  # bf16: the output's rounding
    assert float((out.float() - want).abs().max()) <= tol
    for b, n in enumerate(count.tolist()):
        assert bool((out[b, n:] == 0).all())  # slots past a row's tokens


def tree_reference(q, kv, start, count, visible):
    """Each tree node alone through fp32 SDPA over its row's context and the nodes it sees."""
    nkv = kv.shape[1] // 2
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b in range(q.shape[0]):
        s = int(start[b])
        for i in range(int(count[b])):
            keys = list(range(s)) + [s + j for j in range(int(count[b])) if visible[b, i, j]]
            k, v = kv[b : b + 1, :nkv, keys].float(), kv[b : b + 1, nkv:, keys].float()
            out[b, i] = F.scaled_dot_product_attention(q[b : b + 1, i, :, None].float(), k, v, enable_gqa=True)[0, :, 0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES[:3])
def test_tree_rows_attend_to_their_context_and_the_nodes_they_see(dtype, heads, kv_heads, head_dim):
    """Token trees (random parents, each node seeing its ancestors and itself), one a row, ragged: the
    kernel equals SDPA over exactly the context and the visible nodes, and reads no unseen node's K/V
    (NaN there) nor the cache past a row's nodes."""
    queries = 7
    q, kv, start, count = ragged_batch(heads, kv_heads, head_dim, queries, dtype)
    g = torch.Generator().manual_seed(1)
    visible = torch.eye(queries, dtype=torch.bool).repeat(len(start), 1, 1)
    for b in range(len(start)):
        for i in range(1, queries):
            parent = int(torch.randint(0, i, (1,), generator=g))
            visible[b, i] |= visible[b, parent]
    want = tree_reference(q, kv, start, count, visible)
    out = da.decode_attention(q, kv[:, :, : int((start + count).max())], start, count, visible)
    tol = 1e-5 if dtype == torch.float32 else 1e-2 * float(want.abs().max())
    assert not bool(out.isnan().any()) and float((out.float() - want).abs().max()) <= tol
    # NaN in the K/V of nodes a token does not see reaches none of its outputs
    for b, n in enumerate(count.tolist()):
        s0 = int(start[b])
        for j in range(1, n):
            if not bool(visible[b, j + 1 :, j].any()):  # no later node sees node j
                poisoned = kv.clone()
                poisoned[b, :, s0 + j] = float("nan")
                blind = [i for i in range(n) if i != j]
                assert not bool(da.decode_attention(q, poisoned, start, count, visible)[b, blind].isnan().any())
    with pytest.raises(ValueError, match="tree visibility"):
        da.decode_attention(q, kv, start, count, visible[:, :3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_node_attends_to_the_same_bits_as_its_path_decoded_alone(dtype):
    """A node off the tree's first branch (its slots are not its positions) computes what the same token
    computes once its path is accepted and it is decoded as a chain: the same sums in the same order. At
    temperature 0 tree verification is then exact in a mode whose other kernels are row-invariant (q4f32, q4q8)."""
    heads, kv_heads, head_dim, start = 9, 3, 64, 21
    parents = [-1, 0, 0, 1, 2, 4, 2]  # node 0 the anchor; nodes 2, 4, 5, 6 on later branches
    g = torch.Generator().manual_seed(5)
    n = len(parents)
    q = torch.randn(1, n, heads, head_dim, generator=g).to(dtype)
    kv = torch.randn(1, 2 * kv_heads, start + n, head_dim, generator=g).to(dtype)
    visible = torch.zeros(1, n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        visible[0, i, i] = True
        if p >= 0:
            visible[0, i] |= visible[0, p]
    tree = da.decode_attention(q, kv, torch.tensor([start]), torch.tensor([n]), visible)
    for i in range(n):
        path = visible[0, i].nonzero().flatten().tolist()  # ancestors and the node, by depth
        chain_kv = torch.cat([kv[:, :, :start], kv[:, :, [start + j for j in path]]], dim=2)
        chain_q = torch.zeros(1, len(path), heads, head_dim, dtype=dtype)
        chain_q[0, -1] = q[0, i]
        alone = da.decode_attention(chain_q, chain_kv, torch.tensor([start]), torch.tensor([len(path)]))
        assert torch.equal(alone[0, -1], tree[0, i]), i


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


def test_bad_rows_are_refused():
    kv = torch.zeros(2, 4, 8, 16)
    q = torch.zeros(2, 2, 4, 16)
    with pytest.raises(ValueError, match="outside"):
        da.decode_attention(q, kv, torch.tensor([3, 7]), torch.tensor([1, 2]))  # past the cache
    with pytest.raises(ValueError, match="outside"):
        da.decode_attention(q, kv, torch.tensor([0, 0]), torch.tensor([3, 1]))  # more tokens than slots
