"""The engine's prompt-prefix cache: prompts prefilled on cached blocks decode exactly as prefilled whole."""

import pytest
import torch
from helpers import make_random_dspark

from dspark.decode.engine import Engine, Request
from dspark.decode.prefix_cache import BLOCK, PrefixCache, _chain
from dspark.model.loading import load_target
from dspark.sampling import SamplingParams
from dspark.schedule.policies import SPSTable, parse_policy

SPS = SPSTable(tuple(100.0 / (1 + 0.06 * (b - 1)) for b in range(1, 129)))


def _prompts_sharing_prefixes(vocab: int) -> list[list[int]]:
    """Prompts that share a 40-token "system prompt", one that repeats another whole, one exactly two
    blocks long, one that shares half a block only, and one that shares nothing."""
    gen = torch.Generator().manual_seed(0)

    def rand(n):
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    system = rand(40)
    first = system + rand(9)
    return [first, system + rand(23), system + rand(1), first, system[:32], system[:8] + rand(30), rand(35),
            system + rand(17)]


def _run(target, prompts, prefix_bytes: int, params: SamplingParams | None = None, **engine_kw) -> list[Request]:
    engine = Engine(target, max_batch=3, prefix_cache_bytes=prefix_bytes, **engine_kw)
    params = params or SamplingParams()
    return engine.run([Request(p, 24, params, seed=i) for i, p in enumerate(prompts)])  # 8 requests, 3 rows


@pytest.mark.parametrize("policy", ["ar", "dspark", "tree:6"])
def test_prompts_on_cached_prefixes_decode_exactly_as_without_the_cache(tiny_targets, policy):
    target = load_target(tiny_targets[1][1], dtype=torch.float32, require_tokenizer=False)
    drafter = make_random_dspark(target, "vanilla", block_size=5, std=0.3)
    prompts = _prompts_sharing_prefixes(vocab=128)
    kw = {} if policy == "ar" else {"draft_model": drafter.model}
    kw["policy"] = parse_policy(policy, SPS)
    plain = _run(target, prompts, 0, **kw)
    cached = _run(target, prompts, 64 << 20, **kw)
    assert [r.token_ids for r in cached] == [r.token_ids for r in plain]
    # the first prompt finds nothing; later ones their whole blocks before their last token
    assert [r.cached_tokens for r in cached] == [0, 32, 32, 48, 16, 0, 0, 32]
    assert all(r.cached_tokens == 0 for r in plain)


def test_sampled_requests_on_cached_prefixes_draw_the_same_tokens(tiny_targets):
    """At temperature 1 each request draws from its own seeded generator: with exact logits, the
    cache changes no draw."""
    target = load_target(tiny_targets[0][1], dtype=torch.float32, require_tokenizer=False)
    drafter = make_random_dspark(target, "vanilla", block_size=4, std=0.3)
    prompts = _prompts_sharing_prefixes(vocab=128)
    kw = {"draft_model": drafter.model, "policy": parse_policy("full"), "params": SamplingParams(1.0, 20, 0.9)}
    plain, cached = _run(target, prompts, 0, **kw), _run(target, prompts, 64 << 20, **kw)
    assert [r.token_ids for r in cached] == [r.token_ids for r in plain]
    # the drafter's context came whole from the cached taps: the same drafts, accepted alike
    assert [[(x.verified, x.accepted) for x in r.rounds] for r in cached] == [
        [(x.verified, x.accepted) for x in r.rounds] for r in plain]
    assert sum(r.cached_tokens for r in cached) > 0


@torch.inference_mode()
def test_restored_blocks_hold_what_a_whole_prefill_computes(tiny_targets):
    target = load_target(tiny_targets[2][1], dtype=torch.float32, require_tokenizer=False)
    model, ids = target.model, list(range(3, 3 + 3 * BLOCK + 5))
    cache = model.new_cache(2, 128)
    whole = cache.row(0)
    model(torch.tensor([ids]), whole)
    prefixes = PrefixCache(1 << 20)
    prefixes.store(ids, whole, None)
    assert len(prefixes) == 3
    part = cache.row(1)
    n, taps = prefixes.restore(ids[: 2 * BLOCK + 1], part)
    assert (n, taps) == (2 * BLOCK, None) and int(part.lengths[0]) == n
    for layer in cache.kv:
        assert torch.equal(layer[1, :, :n], layer[0, :, :n])
    assert prefixes.restore(ids[:BLOCK], part)[0] == 0  # the last token is always prefilled
    assert prefixes.restore([99] + ids[1:], part)[0] == 0  # a different first token shares nothing


@torch.inference_mode()
def test_blocks_past_the_budget_go_least_recently_used_first_leaves_before_their_parents(tiny_targets):
    target = load_target(tiny_targets[2][1], dtype=torch.float32, require_tokenizer=False)
    model = target.model
    view = model.new_cache(1, 256).row(0)
    a, b = list(range(3, 3 + 3 * BLOCK)), list(range(60, 60 + 2 * BLOCK))
    model(torch.tensor([a]), view)
    one = PrefixCache(1 << 30)
    one.store(a, view, None)
    block_bytes = one.bytes // 3
    prefixes = PrefixCache(4 * block_bytes)
    prefixes.store(a, view, None)  # a's 3 blocks
    view.lengths.zero_()
    model(torch.tensor([b]), view)
    prefixes.store(b, view, None)  # b's 2 blocks: a's leaf goes
    assert len(prefixes) == 4 and prefixes.bytes <= 4 * block_bytes
    view.lengths.zero_()
    model(torch.tensor([a]), view)
    assert prefixes.restore(a + [5], view)[0] == 2 * BLOCK  # a's first two blocks are still whole


@torch.inference_mode()
def test_a_block_under_a_colliding_key_is_not_trusted(tiny_targets):
    target = load_target(tiny_targets[2][1], dtype=torch.float32, require_tokenizer=False)
    view = target.model.new_cache(1, 128).row(0)
    ids = list(range(3, 3 + 2 * BLOCK))
    target.model(torch.tensor([ids]), view)
    prefixes = PrefixCache(1 << 20)
    prefixes.store(ids, view, None)
    first_key = next(_chain(ids, 1))[0]
    prefixes._blocks[first_key].tokens = (7,) * BLOCK  # what a hash collision would leave under the key
    assert prefixes.restore(ids + [1], view)[0] == 0


@torch.inference_mode()
def test_a_cache_for_a_drafting_engine_requires_taps(tiny_targets):
    target = load_target(tiny_targets[2][1], dtype=torch.float32, require_tokenizer=False)
    view = target.model.new_cache(1, 64).row(0)
    with pytest.raises(ValueError, match="taps"):
        PrefixCache(1 << 20, with_taps=True).store(list(range(3, 3 + BLOCK)), view, None)
