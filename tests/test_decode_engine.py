"""Batched engine: every policy is lossless, whatever shares the batch."""

import itertools
import json
import math
import statistics
import time

import pytest
import torch
from helpers import (
    TV_PROMPT,
    assert_clean_error,
    exact_first_two,
    make_random_dspark,
    run_cli,
    tiny_sharp_target,
    total_variation,
)

from dspark.decode.engine import Engine, Request
from dspark.decode.generate import Decoder
from dspark.draft.dspark import DSparkDrafter
from dspark.draft.prompt_lookup import PromptLookupDrafter
from dspark.errors import DsparkError
from dspark.model import decode_attention
from dspark.model.loading import load_target
from dspark.sampling import SamplingParams
from dspark.schedule.policies import SPSTable, parse_policy

POLICIES = ["ar", "fixed:1", "fixed:4", "threshold:0.3", "dspark", "dspark-async", "tree:6", "tree"]
SPS = SPSTable(tuple(100.0 / (1 + 0.06 * (b - 1)) for b in range(1, 129)))


def _shared_model_drafters(drafter: DSparkDrafter):
    return lambda: DSparkDrafter(drafter.model, drafter.target)


def _requests_and_greedy(target, seed: int, vocab: int):
    """10 random prompts over token ids 3..vocab-1, their budgets, and plain greedy decoding's replies."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in torch.randint(2, 30, (10,), generator=gen)]
    budgets = [int(n) for n in torch.randint(1, 40, (10,), generator=gen)]
    ar = Decoder(target)
    return prompts, budgets, [ar.generate(p, n).token_ids for p, n in zip(prompts, budgets)]


@pytest.mark.parametrize("batched", [True, False], ids=["batched-drafter", "per-request-drafters"])
@pytest.mark.parametrize("policy", POLICIES)
def test_batched_greedy_equals_plain_greedy_for_every_policy(tiny_targets, policy, batched):
    target = load_target(tiny_targets[1][1], dtype=torch.float32, require_tokenizer=False)
    drafter = make_random_dspark(target, "vanilla", block_size=5, std=0.3)
    prompts, budgets, want = _requests_and_greedy(target, seed=3, vocab=128)
    if batched:
        engine = Engine(target, policy=parse_policy(policy, SPS), max_batch=4, draft_model=drafter.model)
    else:
        engine = Engine(target, _shared_model_drafters(drafter), parse_policy(policy, SPS), max_batch=4)
    done = engine.run([Request(p, n) for p, n in zip(prompts, budgets)])  # 10 requests through 4 slots
    for r, w in zip(done, want):
        assert r.token_ids == w, (policy, r.id)
    verified = sum(x.verified for r in done for x in r.rounds)
    assert (verified == 0) == (policy == "ar")
    assert (engine.drafter is None) == (policy == "ar")  # AR runs no drafter


@pytest.mark.parametrize("batched", [True, False], ids=["batched-drafter", "per-request-drafters"])
@pytest.mark.parametrize("policy", ["tree:6", "tree"])
def test_lookup_branches_keep_batched_greedy_exact(tiny_targets, policy, batched, monkeypatch):
    """`DRAFTER+lookup` in the engine: each row's trees also hold its prompt-lookup continuation
    (random prompts over a 128-token vocabulary repeat n-grams, so branches are found often)."""
    from dspark.draft import hybrid
    from dspark.draft.hybrid import LookupBranchDrafter

    target = load_target(tiny_targets[1][1], dtype=torch.float32, require_tokenizer=False)
    drafter = make_random_dspark(target, "vanilla", block_size=5, std=0.3)
    prompts, budgets, want = _requests_and_greedy(target, seed=5, vocab=40)
    branches, kernel_trees = [], []
    find, attend = hybrid.lookup_branch, decode_attention.run
    monkeypatch.setattr(hybrid, "lookup_branch", lambda *a: branches.append(find(*a)) or branches[-1])
    monkeypatch.setattr(decode_attention, "run", lambda q, kv, *rows: kernel_trees.append(len(rows) == 3) or attend(q, kv, *rows))
    rule = parse_policy(policy, SPS)
    rule.gate = None  # every step drafts (a gate skips this random drafter's passes): branches are what is tested
    if batched:
        engine = Engine(target, policy=rule, max_batch=4, draft_model=drafter.model, lookup_branches=True)
    else:
        engine = Engine(target, lambda: LookupBranchDrafter(_shared_model_drafters(drafter)()), rule, max_batch=4)
    done = engine.run([Request(p, n) for p, n in zip(prompts, budgets)])
    assert [r.token_ids for r in done] == want
    # the trees took lookup branches (per-request drafters grow trees for a lone row only: fewer)
    assert sum(map(bool, branches)) >= (10 if batched else 3), branches
    if batched and decode_attention.supports(torch.float32, torch.device("cpu"), 4, 2, 16):
        assert any(kernel_trees)  # the rows' trees attended through the ragged kernel
    with pytest.raises(DsparkError, match="@tree"):
        Engine(target, policy=parse_policy("dspark", SPS), max_batch=4, draft_model=drafter.model, lookup_branches=True)


class _CountingGate:
    """Wraps a policy's DraftGate: forces a draft cost and counts drafting / skipped steps."""

    def __init__(self, policy, draft_s: float):
        self.gate, self.counts = policy.gate, {True: 0, False: 0}
        self.gate.draft_seconds = lambda requests: draft_s
        record = self.gate.record

        def counting(requests, drafted, *rest):
            self.counts[drafted] += 1
            record(requests, drafted, *rest)
        self.gate.record = counting


@pytest.mark.parametrize("policy", ["dspark", "dspark-async"])
def test_steps_that_skip_drafting_keep_greedy_exact(tiny_targets, policy):
    target = load_target(tiny_targets[1][1], dtype=torch.float32, require_tokenizer=False)
    drafter = make_random_dspark(target, "vanilla", block_size=5, std=0.3)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (int(n),), generator=gen).tolist() for n in torch.randint(2, 30, (8,), generator=gen)]
    ar = Decoder(target)
    want = [ar.generate(p, 30).token_ids for p in prompts]
    chosen = parse_policy(policy, SPS)
    gate = _CountingGate(chosen, draft_s=0.05)  # 5x a plain step: a random drafter does not pay
    engine = Engine(target, policy=chosen, max_batch=4, draft_model=drafter.model)
    done = engine.run([Request(p, 30) for p in prompts])
    assert [r.token_ids for r in done] == want
    assert gate.counts[True] > 0 and gate.counts[False] > gate.counts[True], gate.counts


@pytest.mark.parametrize("policy", ["dspark", "tree:6"])
def test_a_drafting_step_is_timed_with_the_catch_up_drafting_owes(tiny_targets, policy, monkeypatch):
    """The gate weighs a drafting step with the catch-up that drafting at every step needs (the
    tokens the last drafting step committed), never with the backlog of plain steps before it."""
    from dspark.draft.batched import BatchedDSparkDrafter

    target = load_target(tiny_targets[1][1], dtype=torch.float32, require_tokenizer=False)
    drafter = make_random_dspark(target, "vanilla", block_size=5, std=0.3)
    catch_up, owed = BatchedDSparkDrafter.catch_up, 0.2  # seconds a catch-up with queued taps takes here

    def slow_catch_up(self, rows):
        if any(self.pending[r] for r in rows):
            time.sleep(owed)
        catch_up(self, rows)

    monkeypatch.setattr(BatchedDSparkDrafter, "catch_up", slow_catch_up)
    chosen = parse_policy(policy, SPS)
    pattern = iter([True, True, False, False] * 20)  # drafting after drafting, then after plain steps
    monkeypatch.setattr(chosen, "should_draft", lambda requests: next(pattern))
    timed = []
    monkeypatch.setattr(chosen, "record_step", lambda r, drafted, v, c, d, step_s=None: timed.append((drafted, step_s)))
    engine = Engine(target, policy=chosen, max_batch=4, draft_model=drafter.model)
    engine.run([Request(list(range(3, 3 + n)), 30) for n in (5, 9, 14, 20)])
    after = [(prev[0], cur[1]) for prev, cur in itertools.pairwise(timed) if cur[0]]
    assert {p for p, _ in after} == {True, False}
    assert all(s >= owed for p, s in after if p), after
    assert all(s < owed for p, s in after if not p), after


@pytest.mark.parametrize("mode", ["smollm2_fp32", "smollm2_q4q8"])
def test_batched_greedy_on_smollm2_with_prompt_lookup(request, mode):
    """Ragged batched rows, one to a few tokens each, equal single-request greedy decoding in float32 and
    in q4q8, auto's mode on CPUs without bf16 units (every kernel computes a row the same whatever rows
    share the forward; its 8-bit activations would turn any other difference into other tokens)."""
    from helpers import eval_prompts

    target = request.getfixturevalue(mode)
    prompts = [target.encode_prompt(p) for p in eval_prompts("mt-bench", 4) + eval_prompts("mbpp", 4)]
    ar = Decoder(target)
    want = [ar.generate(p, 16 + 4 * i).token_ids for i, p in enumerate(prompts)]
    engine = Engine(target, lambda: PromptLookupDrafter(4), parse_policy("dspark", SPS), max_batch=8)
    done = engine.run([Request(p, 16 + 4 * i) for i, p in enumerate(prompts)])
    assert [r.token_ids for r in done] == want


def _centre_confidence(drafter, target, sps, rows: int) -> None:
    """Shift the confidence bias so that the first draft after TV_PROMPT is worth verifying in a batch
    of `rows` for half of the anchors and not for the others (its survival a_0 straddles the first
    admission's break-even R·(SPS(R) / SPS(R+1) − 1)): the policy then verifies sometimes, whatever
    the random weights are."""
    out = target.model(torch.tensor([TV_PROMPT]), target.model.new_cache(1, 16), taps=drafter.tap_layers)
    drafter.begin(TV_PROMPT)
    drafter.observe(TV_PROMPT, out.taps[0])
    z0 = []
    for anchor in range(target.cfg.vocab_size):
        h, base = drafter.block_outputs(anchor, 1)
        z0.append(float(drafter.run_heads(h, base, anchor, lambda logits: [0])[2][0]))
    a_star = rows * (sps(rows) / sps(rows + 1) - 1)
    with torch.no_grad():
        drafter.model.confidence_head.proj.bias += math.log(a_star / (1 - a_star)) - statistics.median(z0)


@pytest.mark.parametrize("policy, draft_s", [("dspark", None), ("dspark-async", None), ("dspark", 0.003)],
                         ids=["dspark", "dspark-async", "dspark-skipping-drafts"])
def test_scheduled_sampling_keeps_the_target_distribution(tmp_path, policy, draft_s):
    """T=1, 16 requests per batch with different seeds: the first two tokens follow the exact joint,
    also when steps skip drafting on the evidence of earlier steps."""
    target = tiny_sharp_target(tmp_path)
    drafter = make_random_dspark(target, "vanilla", block_size=3, rank=4, std=0.5)
    params = SamplingParams(temperature=1.0)
    sps = SPSTable(tuple(100.0 / (1 + 0.12 * (b - 1)) for b in range(1, 65)))
    _centre_confidence(drafter, target, sps, rows=16)
    chosen = parse_policy(policy, sps)
    if draft_s is None:
        chosen.gate = None  # Algorithm 1 alone: every step drafts
    else:  # a given draft cost: the same decisions on any machine
        gate = _CountingGate(chosen, draft_s)
        # this random drafter never pays: probe often, without back-off, for a mix of steps
        chosen.gate.probe_every = chosen.gate.max_probe_every = chosen.gate.interval = 2
    engine = Engine(target, policy=chosen, max_batch=16, draft_model=drafter.model)
    n = 10_000
    done = engine.run([Request(TV_PROMPT, 3, params, seed=s) for s in range(n)])
    if draft_s is None:
        verified = sum(r.rounds[0].verified for r in done) / n
        assert 0.05 < verified < 0.95, verified  # the policy verified the draft sometimes, not always
    else:
        assert min(gate.counts.values()) > 100, gate.counts  # both kinds of step, many times
    tv = total_variation([r.token_ids for r in done], exact_first_two(target, params), 4)
    assert tv < 0.01, f"total variation {tv:.4f}"


@pytest.mark.parametrize("lookup", [False, True], ids=["trees", "trees-with-lookup-branches"])
def test_tree_rows_of_a_batch_keep_the_target_distribution(tmp_path, lookup, monkeypatch):
    """T=1, 16 requests per batch, each row verifying its own token tree in one ragged forward, the rows'
    trees grown together while the batch's cost curve says so (with `lookup`, each also holding its
    prompt-lookup branch: deterministic children): the first two tokens follow the exact joint."""
    target = tiny_sharp_target(tmp_path)
    drafter = make_random_dspark(target, "vanilla", block_size=3, rank=4, std=0.5)
    params = SamplingParams(temperature=1.0)
    chosen = parse_policy("tree", SPSTable(tuple(100.0 / (1 + 0.02 * (b - 1)) for b in range(1, 129))))
    chosen.gate = None  # every step drafts
    engine = Engine(target, policy=chosen, max_batch=16, draft_model=drafter.model, lookup_branches=lookup)
    from dspark.draft import hybrid

    found, find = [], hybrid.lookup_branch
    monkeypatch.setattr(hybrid, "lookup_branch", lambda *a: found.append(bool(find(*a))) or find(*a))
    n = 10_000
    done = engine.run([Request(TV_PROMPT, 3, params, seed=s) for s in range(n)])
    assert (sum(found) > n // 4) == lookup  # TV_PROMPT repeats tokens: most first rounds find a branch
    nodes = [r.rounds[0].nodes for r in done]
    assert 1 < statistics.fmean(nodes) < chosen.tree_nodes  # real trees, the batch's curve admitting some nodes
    tv = total_variation([r.token_ids for r in done], exact_first_two(target, params), 4)
    assert tv < 0.01, f"total variation {tv:.4f}"


@pytest.mark.parametrize("fusion", ["shared", "layerwise"])
def test_batched_draft_pass_matches_the_single_request_drafter(tiny_targets, fusion):
    """Same contexts, same anchors: the batched pass (ragged contexts, mixed sampling settings)
    proposes what each slot's own DSparkDrafter proposes, with the same p_d and confidences."""
    from dspark.draft.batched import BatchedDSparkDrafter

    target = load_target(tiny_targets[3][1], dtype=torch.float32, require_tokenizer=False)
    single = make_random_dspark(target, "rnn", block_size=5, layers=2, std=0.3, fusion=fusion)
    batch = BatchedDSparkDrafter(single.model, target, slots=3, max_len=128)
    gen = torch.Generator().manual_seed(0)
    contexts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (7, 30, 19)]
    settings = [SamplingParams(), SamplingParams(0.9, top_p=0.9), SamplingParams(0.9, top_p=0.9)]
    blocks_single = []
    for slot, ctx in enumerate(contexts):
        taps = target.model(torch.tensor([ctx]), target.model.new_cache(1, 64), taps=single.tap_layers).taps[0]
        batch.start(slot, ctx[:4], taps[:4])
        batch.observe(slot, ctx[4:], taps[4:])  # in two rounds
        single.begin(ctx)
        single.observe(ctx, taps)
        blocks_single.append(single.propose(50 + slot, 5, settings[slot], torch.Generator().manual_seed(slot)))
    blocks = batch.propose([0, 1, 2], [50, 51, 52], [5, 5, 3], settings,
                           [torch.Generator().manual_seed(s) for s in range(3)])
    for slot, (a, b) in enumerate(zip(blocks_single, blocks)):
        n = len(b.tokens)
        assert a.tokens[:n] == b.tokens
        assert (a.confidence_logits[:n] - b.confidence_logits).abs().max() < 1e-4
        if settings[slot].greedy:
            assert b.probs is None
        else:
            assert (a.probs[:n] - b.probs).abs().max() < 1e-5


def test_engine_rejects_bad_requests(tiny_targets):
    target = load_target(tiny_targets[0][1], dtype=torch.float32, require_tokenizer=False)
    engine = Engine(target, max_batch=2, max_len=32)
    with pytest.raises(DsparkError, match="empty"):
        engine.submit(Request([]))
    with pytest.raises(DsparkError, match="max_new_tokens"):
        engine.submit(Request([1, 2], 0))
    with pytest.raises(DsparkError, match="no room"):
        engine.submit(Request(list(range(40))))
    r = engine.run([Request(list(range(3, 20)), 100)])[0]  # runs into the 32-token window
    assert r.finish_reason == "length" and len(r.prompt_ids) + len(r.token_ids) <= 33
    # a request at its window's edge shares steps with one verifying long drafts: both stay exact
    drafter = make_random_dspark(target, "vanilla", block_size=6, std=0.3)
    engine = Engine(target, policy=parse_policy("fixed:6"), max_batch=2, max_len=32, draft_model=drafter.model)
    near, far = Request(list(range(3, 30)), 50), Request([5, 6, 7], 50)
    engine.run([near, far])
    ar = Decoder(target)
    for r in (near, far):
        assert r.finish_reason == "length" and len(r.prompt_ids) + len(r.token_ids) in (32, 33)
        assert ar.generate(r.prompt_ids, 50).token_ids[: len(r.token_ids)] == r.token_ids
    # padding is never cached, so batched rows may fill the target's whole window
    window = target.model.max_positions
    engine = Engine(target, policy=parse_policy("fixed:6"), max_batch=2, draft_model=drafter.model)
    assert engine.max_len == window
    near, far = Request([3 + i % 100 for i in range(window - 12)], 50), Request([5, 6, 7], 40)
    engine.run([near, far])
    assert near.finish_reason == "length" and len(near.prompt_ids) + len(near.token_ids) in (window, window + 1)
    for r in (near, far):
        assert ar.generate(r.prompt_ids, 50).token_ids[: len(r.token_ids)] == r.token_ids


def test_cancelled_requests_free_their_rows_and_leave_the_others_exact(tiny_targets):
    """A running and a waiting request are cancelled between steps: both end as "abort", the freed row
    takes the next request (drafter state reset), and every other request stays token-identical."""
    target = load_target(tiny_targets[0][1], dtype=torch.float32, require_tokenizer=False)
    drafter = make_random_dspark(target, "vanilla", block_size=4, std=0.3)
    engine = Engine(target, policy=parse_policy("full"), max_batch=2, max_len=64, draft_model=drafter.model)
    finished = []
    reqs = [Request([3 + i, 7, 11 + i, 5], 30, on_finish=finished.append) for i in range(4)]
    for r in reqs:
        engine.submit(r)
    engine.step()
    engine.step()  # rows: reqs 0 and 1; waiting: reqs 2 and 3
    assert engine.cancel(reqs[0]) and engine.cancel(reqs[3])
    assert not engine.cancel(reqs[0]) and not engine.cancel(Request([1, 2], 4))
    assert [r.finish_reason for r in finished] == ["abort", "abort"] and int(engine.cache.lengths[0]) == 0
    while engine.has_work():
        engine.step()
    ar = Decoder(target)
    for r in (reqs[1], reqs[2]):
        assert r.token_ids == ar.generate(r.prompt_ids, 30).token_ids
    assert engine.active == [] and not engine.waiting and len(finished) == 4


def test_bench_serve_cli(tmp_path, tiny_dirs):
    """The benchmark's rows, report and resumable journal (a tiny target speaking through SmolLM2's
    tokenizer: what is checked here is the bookkeeping, not the speed)."""
    model = ["--model", str(tiny_dirs[0])]
    ds = tmp_path / "p.jsonl"
    ds.write_text('{"turns": ["Name a fruit."]}\n{"turns": ["Count to three."]}\n')
    r = run_cli("bench", "serve", *model, "--drafter", "prompt-lookup", "--policies", "ar,fixed:1,dspark",
                "--concurrency", "1,2", "--requests", "4", "--max-new-tokens", "8", "--dataset", str(ds), "--out",
                str(tmp_path / "out"), "--dtype", "float32", env_extra={"DSPARK_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    result = __import__("json").loads((tmp_path / "out" / "serve.json").read_text())
    assert [(x["concurrency"], x["policy"]) for x in result["rows"]] == [
        (c, p) for c in (1, 2) for p in ("ar", "fixed:1", "dspark")]
    assert all(x["throughput_tok_s"] > 0 and x["output_tokens"] > 0 for x in result["rows"])
    assert [x["chunks"] for x in result["rows"]] == [2, 2, 2, 1, 1, 1]  # C = 1: 2 chunks of 2 requests
    assert all(x["requests"] == 4 for x in result["rows"])
    assert (tmp_path / "out" / "pareto.png").stat().st_size > 0
    journal = tmp_path / "out" / "journal.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    keys = [json.loads(line)["key"] for line in lines[1:]]
    assert keys[:6] == [[1, "ar", 0], [1, "fixed:1", 0], [1, "dspark", 0],  # the second chunk rotates the order
                        [1, "fixed:1", 1], [1, "dspark", 1], [1, "ar", 1]]
    # killed after two chunks: the rerun (with one more policy) keeps them and measures only the rest
    journal.write_text("".join(lines[:3]))
    r = run_cli("bench", "serve", *model, "--drafter", "prompt-lookup", "--policies", "ar,fixed:1,dspark,fixed:2",
                "--concurrency", "1,2", "--requests", "4", "--max-new-tokens", "8", "--dataset", str(ds), "--out",
                str(tmp_path / "out"), "--dtype", "float32", env_extra={"DSPARK_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    again = __import__("json").loads((tmp_path / "out" / "serve.json").read_text())["rows"]
    assert len(again) == 8 and journal.read_text().splitlines(keepends=True)[:3] == lines[:3]
    assert len(journal.read_text().splitlines()) == 1 + 4 * 2 + 4
    assert_clean_error(run_cli("bench", "serve", "--policies", "ar,warp", "--out", str(tmp_path / "x")), "unknown policy")


def test_per_user_speed_at_matched_throughput_interpolates_along_the_curve():
    from dspark.serve.bench import per_user_at

    rows = [{"policy": "dspark", "throughput_tok_s": t, "per_user_tok_s": u} for t, u in ((20, 20), (40, 10), (60, 5))]
    rows.append({"policy": "fixed:1", "throughput_tok_s": 30, "per_user_tok_s": 8})
    assert per_user_at(rows, "dspark", 30) == pytest.approx(15)
    assert per_user_at(rows, "dspark", 50) == pytest.approx(7.5)
    assert per_user_at(rows, "dspark", 60) == pytest.approx(5)
    assert per_user_at(rows, "dspark", 70) is None and per_user_at(rows, "dspark", 10) is None
