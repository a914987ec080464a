"""Token trees (DESIGN.md §7b): growth, exact verification at T = 0 and T > 0, and the K/V the
accepted path leaves behind."""

import pytest
import torch
from helpers import (
    BranchOracle,
    joint_tree_trials,
    make_random_dspark,
    make_random_eagle3,
    make_tiny_hf_model,
    tokens_tv,
    toy_expand,
)

from dspark.decode.generate import Decoder
from dspark.decode.step import DecodeStep
from dspark.decode.verify import verify_tree_greedy, verify_tree_sampled
from dspark.draft.base import PerRequestDrafters
from dspark.draft.hybrid import LookupBranchDrafter
from dspark.draft.prompt_lookup import PromptLookupDrafter
from dspark.draft.tree import DraftTree, TreeLimits, grow_tree
from dspark.model.compiled import ROWS
from dspark.model.loading import load_target
from dspark.sampling import SamplingParams
from dspark.schedule.policies import DSparkTreePolicy, SPSTable, TreePolicy, VerifyAllPolicy, parse_policy

TRIALS = 200_000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model_dir = make_tiny_hf_model("llama", tmp_path_factory.mktemp("tree") / "m")
    return load_target(model_dir, dtype=torch.float32, require_tokenizer=False)


# ---- growth ---------------------------------------------------------------------------------------
def test_greedy_growth_is_best_first_by_path_probability():
    first = torch.tensor([2.0, 1.5, 0.0, -3.0]).log_softmax(-1)
    second = torch.tensor([[0.0, 3.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0] * 4])
    tree = grow_tree(toy_expand(first, second), 9, TreeLimits(4, 2, 3), SamplingParams(), None)
    # p(0) = .57, then p(0 -> 1) = .57 * .87 = .50, p(1) = .35, then p(1 -> 0) = .35 * .25 = .09 > p(2) = .08
    assert tree.tokens[:3] == [0, 1, 1] and tree.parents == [-1, 0, -1, 2]
    assert tree.depths() == [1, 2, 1, 2] and tree.path(3) == [2, 3]
    depth, visible = tree.attention()
    assert depth.tolist() == [0, 1, 2, 1, 2]
    assert visible[4].tolist() == [True, False, False, True, True]  # node 3 sees the anchor, node 2, itself


def test_growth_respects_budget_depth_and_fan_out():
    torch.manual_seed(0)
    first, second = torch.randn(16), torch.randn(16, 16)
    for params in (SamplingParams(), SamplingParams(temperature=1.0, top_k=5)):
        tree = grow_tree(toy_expand(first, second), 0, TreeLimits(12, 2, 3), params, torch.Generator().manual_seed(1))
        probs = tree.child_probs
        assert len(tree) == 12 and max(tree.depths()) == 2
        kids = tree.children()
        assert all(len(c) <= 3 for c in kids.values())
        assert all(len({tree.tokens[c] for c in cs}) == len(cs) for cs in kids.values())  # siblings differ
        assert set(probs) == (set() if params.greedy else set(kids))
        if not params.greedy:  # sampled children come from the top-k support only
            assert all(float(probs[n][tree.tokens[c]]) > 0 for n, cs in kids.items() for c in cs)


def test_a_given_branch_is_the_first_path_and_drawn_siblings_avoid_it():
    """Prompt lookup's continuation enters as deterministic first children with its survival estimates
    as priorities; the drafter's children beside it never repeat its token; it is cut at the depth."""
    first, second = torch.tensor([3.0, 2.0, 0.0, -1.0]), torch.zeros(4, 4)
    second[2, 1] = 4.0
    vocab = torch.tensor([10, 11, 12, 13])  # a draft vocabulary: draft index i is target token 10 + i

    def expand(node, depth, token, state):
        return (first if depth == 0 else second[token - 10] if token in (10, 11, 12, 13) else first), None

    for params, g in ((SamplingParams(), None), (SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))):
        tree = grow_tree(expand, 0, TreeLimits(6, 2, 3), params, g, vocab, branch=[(12, 0.9), (11, 0.9), (13, 0.9)])
        assert tree.tokens[:2] == [12, 11] and tree.parents[:2] == [-1, 0] and tree.given == {0, 1}
        assert max(tree.depths()) == 2  # the branch's third token is past the depth limit
        for siblings in tree.children().values():
            assert len({tree.tokens[c] for c in siblings}) == len(siblings)
        assert all(tree.depths()[n] == 1 or tree.parents[n] in (0, *range(2, 6)) for n in range(len(tree)))
    outside = grow_tree(expand, 0, TreeLimits(3, 2, 2), SamplingParams(), None, vocab, branch=[(99, 0.95)])  # a token outside the draft vocabulary still leads
    assert outside.tokens == [99, 10, 10] and outside.parents == [-1, -1, 0]


# ---- verification ---------------------------------------------------------------------------------
def test_greedy_walk_follows_the_argmax_through_any_branch():
    tree = DraftTree([5, 6, 7, 8], [-1, -1, 1, 1])  # anchor -> {5, 6}, 6 -> {7, 8}
    best = [6, 0, 8, 0, 3]  # after the anchor 6, after node 1 (token 6) 8, after node 3 (token 8) 3
    assert verify_tree_greedy(tree.children(), tree.tokens, best) == ([1, 3], 3)
    assert verify_tree_greedy(tree.children(), tree.tokens, [4, 0, 0, 0, 0]) == ([], 4)


def test_sampled_tree_keeps_the_joint_distribution_of_two_tokens():
    """Recursive rejection sampling down a two-level tree (siblings drawn without replacement at both
    levels, children conditioned on their parent, top-k and top-p on both sides, a given prompt-lookup
    branch whose tokens lead their siblings): the first two committed tokens follow the target's joint
    distribution (the second drawn from the target where a round commits one). The trials run in two
    processes (the CI machine's two cores)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        parts = list(pool.map(joint_tree_trials, [3, 4], [TRIALS // 2] * 2))
    outcomes, exact = torch.cat([p for p, _ in parts]), parts[0][1]
    assert outcomes.numel() == TRIALS and tokens_tv(outcomes, exact) < 0.005


def test_deterministic_children_are_verified_losslessly():
    """Children without a draft distribution (prompt lookup, greedy-grown trees) are one-hot stages."""
    g = torch.Generator().manual_seed(11)
    p_t = torch.tensor([0.1, 0.4, 0.2, 0.3])
    tree = DraftTree([1, 3], [-1, -1])
    first = torch.empty(TRIALS, dtype=torch.long)
    for i in range(TRIALS):
        path, nxt = verify_tree_sampled(tree, p_t.expand(3, -1), g)
        first[i] = tree.tokens[path[0]] if path else nxt
    assert tokens_tv(first, p_t) < 0.005


# ---- decoding -------------------------------------------------------------------------------------
DRAFTERS = {
    "dspark-vanilla": lambda t: make_random_dspark(t, "vanilla", block_size=4, std=0.3),
    "dspark-rnn": lambda t: make_random_dspark(t, "rnn", block_size=4, std=0.3),
    "dflash": lambda t: make_random_dspark(t, "none", block_size=4, std=0.3, confidence=False),
    "eagle3": lambda t: make_random_eagle3(t, block_size=4),
    "prompt-lookup": lambda t: PromptLookupDrafter(4),
    "dspark+lookup": lambda t: LookupBranchDrafter(make_random_dspark(t, "vanilla", block_size=4, std=0.3)),
    "eagle3+lookup": lambda t: LookupBranchDrafter(make_random_eagle3(t, block_size=4)),
}


@pytest.mark.parametrize("name", DRAFTERS)
@pytest.mark.parametrize("nodes", [3, 16])
def test_greedy_tree_decoding_equals_plain_greedy(tiny, name, nodes):
    plain = Decoder(tiny)
    spec = Decoder(tiny, DRAFTERS[name](tiny), TreePolicy(nodes))
    for seed in range(3):
        prompt = torch.randint(3, tiny.cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
        want = plain.generate(prompt, 40).token_ids
        got = spec.generate(prompt, 40)
        assert got.token_ids == want
        assert all(r.nodes is not None and r.nodes <= nodes for r in got.rounds[:-1])


def test_plain_chain_and_compiled_size_trees_get_the_same_cache_window(tiny, monkeypatch):
    """The compiled runner attends over the whole cache, and its sums depend on the width: a request's
    plain, chain and tree decoding (trees up to the runner's ROWS - 1 drafts) must allocate the same
    one, or greedy speculative output drifts from plain output (it did on an AVX512-BF16 EPYC)."""
    widths = []
    new_cache = tiny.model.new_cache
    monkeypatch.setattr(tiny.model, "new_cache", lambda b, n: widths.append(n) or new_cache(b, n))
    drafter = make_random_dspark(tiny, "vanilla", block_size=4)
    for policy in (None, VerifyAllPolicy(), TreePolicy(3), TreePolicy(ROWS - 1)):
        Decoder(tiny, drafter if policy else None, policy).generate([5, 9, 17], 10)
    assert len(set(widths)) == 1 and len(widths) == 4
    Decoder(tiny, drafter, TreePolicy(2 * ROWS)).generate([5, 9, 17], 10)  # eager trees: room for their drafts
    assert widths[-1] == widths[0] - (ROWS - 1) + 2 * ROWS


def test_kv_compaction_leaves_exactly_the_accepted_path(tiny):
    """After tree rounds whose accepted nodes sit behind rejected siblings, the cache holds exactly the
    K/V a plain prefill of the committed tokens computes: a rejected branch's K/V left in place would
    show here (and in every later token)."""
    prompt = [5, 9, 17, 33, 4, 71]
    want = Decoder(tiny).generate(prompt, 30).token_ids
    oracle = BranchOracle(want, len(prompt), tiny.cfg.vocab_size)
    step = DecodeStep(tiny.model, PerRequestDrafters(lambda: oracle), TreePolicy(9))
    cache = tiny.model.new_cache(1, 64)
    row = step.start(cache, 0, prompt, SamplingParams(), torch.Generator())
    committed = [row.anchor]
    for _ in range(4):
        row.budget = 8
        result = step(cache, [row])[0]
        assert result.round.accepted == 3 and result.round.nodes == 9
        committed += result.tokens
        row.anchor = result.tokens[-1]
    assert committed == want[: len(committed)]
    n = int(cache.lengths[0])
    assert n == len(prompt) + len(committed) - 1
    fresh = tiny.model.new_cache(1, 64)
    tiny.model(torch.tensor([prompt + committed[:-1]]), fresh)
    for got, ref in zip(cache.kv, fresh.kv):
        torch.testing.assert_close(got[:, :, :n], ref[:, :, :n], rtol=1e-5, atol=1e-5)


def test_the_hardware_picks_the_tree_size():
    """`tree` grows node after node while (1 + Σ priorities) · SPS(N + 1) rises and stops at the first that
    lowers it: all of a likely tree on a flat cost curve, little on a steep one."""
    first = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0, -2.0])  # one level: priorities .64, .23, .09, .03, ...
    flat = DSparkTreePolicy(SPSTable(tuple([100.0] * 9)))
    steep = DSparkTreePolicy(SPSTable(tuple(100.0 / (1 + 0.5 * b) for b in range(9))))
    assert flat.tree_nodes == 8

    def grown(policy):
        limits = TreeLimits(policy.tree_nodes, 1, 8, policy.tree_admit(1))
        return len(grow_tree(toy_expand(first, None), 0, limits, SamplingParams(), None))

    assert grown(flat) == 6
    # SPS 100, 66.7, 50: Θ = 100, (1 + .64) * 66.7 = 109, then (1.64 + .23) * 50 = 94 stops
    assert grown(steep) == 1
    assert DSparkTreePolicy(SPSTable((100.0, 10.0))).tree_admit(1)(0, 1.0, 0.9) is False


def test_greedy_decoding_with_the_hardware_chosen_tree_equals_plain_greedy(tiny):
    drafter = make_random_dspark(tiny, "vanilla", block_size=4, std=0.3)
    for sps in ((50.0,) * 12, tuple(50.0 / (1 + 0.3 * b) for b in range(12))):
        spec = Decoder(tiny, drafter, DSparkTreePolicy(SPSTable(sps)))
        prompt = [5, 9, 17, 33, 4, 71]
        assert spec.generate(prompt, 40).token_ids == Decoder(tiny).generate(prompt, 40).token_ids


def test_tree_policy_spelling():
    assert parse_policy("tree:16").tree_nodes == 16
    assert parse_policy("tree", SPSTable((1.0,) * 20)).tree_nodes == 19
    stepped = SPSTable((40.0,) * 9 + (20.0,) * 24)  # the compiled runner's 9 rows, then eager
    assert parse_policy("tree", stepped).tree_nodes == 8
    for bad in ("tree:0", "tree:x", "tree:100000"):
        with pytest.raises(Exception, match="tree"):
            parse_policy(bad)
