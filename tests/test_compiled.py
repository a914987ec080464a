"""The compiled runner (model/compiled.py) on a tiny random Llama, compiled once for the module with bf16
and with int8 weights (~30 s each): close to the eager bf16 runner, verify-invariant (a token's logits do
not depend on how many tokens share its forward), so greedy speculative decoding is token-identical to
plain decoding in both modes; and the artifacts' life cycle (`dspark compile`, --runner, a corrupt file)."""

import json

import pytest
import torch
from helpers import BranchOracle, make_random_dspark, make_tiny_hf_model

from dspark.cli import main
from dspark.decode.engine import Engine
from dspark.decode.generate import Decoder
from dspark.decode.speculation import request_policy
from dspark.draft.dspark import DSparkDrafter
from dspark.draft.tree import DraftTree
from dspark.errors import DsparkError
from dspark.model.compiled import ROWS, artifact_dir
from dspark.model.loading import load_target
from dspark.sampling import SamplingParams
from dspark.schedule.policies import TreePolicy


@pytest.fixture(scope="module")
def compiled_dir(tmp_path_factory):
    """A tiny Llama with its compiled runner built by `dspark compile` into a private cache."""
    root = tmp_path_factory.mktemp("compiled")
    patch = pytest.MonkeyPatch()
    patch.setenv("DSPARK_CACHE_DIR", str(root / "cache"))
    model_dir = make_tiny_hf_model("llama", root / "model", layers=3)
    assert main(["compile", "--model", str(model_dir)]) == 0
    assert main(["compile", "--model", str(model_dir), "--dtype", "int8"]) == 0
    yield model_dir
    patch.undo()


def _load(model_dir, runner="compiled", dtype="bfloat16"):
    return load_target(model_dir, dtype=dtype, runner=runner, require_tokenizer=False)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_compiled_forward_matches_the_eager_bf16_runner(compiled_dir, dtype):
    compiled, eager = _load(compiled_dir, dtype=dtype), _load(compiled_dir, "eager")
    # bf16: other kernels, the same weights; int8: weights rounded to 255 levels per output channel
    tolerance = {"atol": 0.1, "rtol": 0.05} if dtype == "bfloat16" else {"atol": 0.4, "rtol": 0.1}
    assert compiled.model.compiled is not None and eager.model.compiled is None
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    caches = [m.model.new_cache(1, 64) for m in (compiled, eager)]
    with torch.inference_mode():
        for start, stop in ((0, 7), (7, 8), (8, 17), (17, 40)):  # compiled x 3 (padded to ROWS), then eager
            outs = [t.model(ids[:, start:stop], c, taps=(-1, 1, 2)) for t, c in zip((compiled, eager), caches)]
            assert [int(c.lengths[0]) for c in caches] == [stop, stop]
            assert outs[0].taps.shape == outs[1].taps.shape == (1, stop - start, 3, 64)
            torch.testing.assert_close(outs[0].hidden.float(), outs[1].hidden.float(), **tolerance)
            torch.testing.assert_close(outs[0].taps.float(), outs[1].taps.float(), **tolerance)
            logits = [t.model.logits(o.hidden[0]) for t, o in zip((compiled, eager), outs)]
            assert logits[0].dtype == torch.float32
            agree = (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean()
            assert agree >= 0.8, (start, stop, agree)
        for a, b in zip(caches[0].kv, caches[1].kv):
            torch.testing.assert_close(a[:, :, :40].float(), b[:, :, :40].float(), **tolerance)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_a_tokens_logits_do_not_depend_on_how_many_tokens_share_its_forward(compiled_dir, dtype):
    model = _load(compiled_dir, dtype=dtype).model
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        def logits_in_chunks(sizes):
            cache = model.new_cache(1, 48)
            model(ids[:, :12], cache)
            out, pos = [], 12
            for k in sizes:
                out.append(model.logits(model(ids[:, pos : pos + k], cache).hidden[0]))
                pos += k
            return torch.cat(out)

        one_by_one = logits_in_chunks([1] * 18)
        for sizes in ([ROWS, ROWS], [2, 5, 3, 8], [4, 1, 6, 7]):
            assert torch.equal(logits_in_chunks(sizes), one_by_one), sizes


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_a_tokens_logits_in_a_tree_equal_its_logits_in_a_chain(compiled_dir, dtype):
    """A path verified deep in a tree, behind siblings, its ancestors' K/V in scattered slots: the
    same logits, bit for bit, as the same tokens decoded one by one."""
    model = _load(compiled_dir, dtype=dtype).model
    ids = torch.randint(3, 128, (16,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        cache = model.new_cache(1, 48)
        model(torch.tensor([ids[:12]]), cache)
        one_by_one = torch.cat([model.logits(model(torch.tensor([[t]]), cache).hidden[0]) for t in ids[12:16]])
        cache.truncate(12)
        # anchor ids[12]; path ids[13..15] at nodes 1, 3, 6, each behind a decoy sibling
        tree = DraftTree([7, ids[13], 8, ids[14], 9, 10, ids[15], 11], [-1, -1, 0, 1, 1, 2, 3, 6])
        assert model.compiled.covers(len(tree) + 1, 48)
        out = model(torch.tensor([[ids[12]] + tree.tokens]), cache, tree=tree.attention())
        in_tree = model.logits(out.hidden[0])[[0, 2, 4, 7]]
    assert torch.equal(in_tree, one_by_one)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_greedy_speculative_equals_plain_greedy_in_compiled_modes(compiled_dir, dtype):
    target = _load(compiled_dir, dtype=dtype)
    drafter = make_random_dspark(target, "vanilla", block_size=ROWS - 1, std=0.3)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (int(n),), generator=gen).tolist() for n in (3, 11, 20, 6)]
    plain = Decoder(target)
    greedy = SamplingParams(temperature=0.0)
    nodes = TreePolicy(target.model.verify_limit - 1)  # 8, or 7 on an AVX2-only CPU
    verified = accepted = 0
    for p in prompts:
        want = plain.generate(p, 30, greedy).token_ids
        chain = Decoder(target, DSparkDrafter(drafter.model, target)).generate(p, 30, greedy)
        # trees whose accepted path hides behind decoys at every level (K/V in scattered slots)
        tree = Decoder(target, BranchOracle(want, len(p), 128), nodes).generate(p, 30, greedy)
        assert chain.token_ids == want and tree.token_ids == want
        verified += sum(r.verified for r in chain.rounds)
        accepted += sum(r.accepted for r in tree.rounds)
    assert verified > 0 and accepted > 20


def test_runner_choice_and_artifact_life_cycle(compiled_dir, tmp_path, monkeypatch, capsys):
    meta_file = artifact_dir(compiled_dir) / "meta.json"
    meta = json.loads(meta_file.read_text())
    assert isinstance(meta["faster_than_eager"], bool) and set(meta["timing_ms"]) == {"compiled", "eager"}
    del meta["faster_than_eager"]  # built by a dspark that did not time its runners: timed on the next compile
    meta_file.write_text(json.dumps(meta))
    assert main(["compile", "--model", str(compiled_dir)]) == 0
    out = capsys.readouterr().out
    assert "already compiled" in out and "timing it against the eager runner" in out
    assert isinstance(json.loads(meta_file.read_text())["faster_than_eager"], bool)
    _set_meta(meta_file, faster_than_eager=True)  # the verdict is this CPU's; both are tested
    assert _load(compiled_dir, "auto").model.compiled is not None
    assert load_target(compiled_dir, dtype=torch.float32, require_tokenizer=False).model.compiled is None
    with pytest.raises(DsparkError, match="runs bfloat16"):
        load_target(compiled_dir, dtype=torch.float32, runner="compiled", require_tokenizer=False)
    with pytest.raises(DsparkError, match="unknown runner"):
        load_target(compiled_dir, dtype=torch.bfloat16, runner="fast", require_tokenizer=False)

    step = artifact_dir(compiled_dir) / "step.pt2"
    saved = step.read_bytes()
    try:
        step.write_bytes(saved[: len(saved) // 2])
        with pytest.raises(DsparkError, match="run `dspark compile` again"):
            _load(compiled_dir, "auto")
    finally:
        step.write_bytes(saved)
    saved = meta_file.read_text()
    try:
        meta_file.write_text("{")  # a meta.json cut short
        with pytest.raises(DsparkError, match="no readable meta.json; delete that directory"):
            _load(compiled_dir, "compiled")
    finally:
        meta_file.write_text(saved)

    generate = ["generate", "--model", str(compiled_dir), "--prompt-ids", "5,9,17", "--max-new-tokens", "3",
                "--dtype", "bfloat16", "--drafter", "none"]
    assert main(generate) == 0
    assert "bfloat16 compiled" in capsys.readouterr().err
    _set_meta(meta_file, faster_than_eager=False)  # measured slower (the bf16 step on an AVX2-only CPU): auto passes it over
    assert _load(compiled_dir, "auto").model.compiled is None
    assert _load(compiled_dir, "compiled").model.compiled is not None
    assert main(generate) == 0
    assert "eager (`dspark compile` measured the compiled runner slower" in capsys.readouterr().err
    _set_meta(meta_file, faster_than_eager=True)
    exact = json.loads(meta_file.read_text())["exact_rows"]
    _set_meta(meta_file, exact_rows=ROWS - 3)  # rows that round apart from the first: chains are cut there
    target = _load(compiled_dir)
    assert target.model.verify_limit == ROWS - 3
    dspark = DSparkDrafter(make_random_dspark(target, "vanilla", block_size=ROWS - 1, std=0.3).model, target)
    rounds = Decoder(target, dspark).generate([5, 9, 17], 20, SamplingParams(temperature=0.0)).rounds
    assert max(r.verified for r in rounds) == ROWS - 4
    _set_meta(meta_file, exact_rows=exact)
    assert _load(compiled_dir, "auto", "int8").model.precision == "int8"
    with pytest.raises(DsparkError, match="compiled runner only"):
        _load(compiled_dir, "eager", "int8")

    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "empty"))
    assert _load(compiled_dir, "auto").model.compiled is None  # a fresh machine: eager, quick
    assert main(generate) == 0
    assert "bfloat16 eager (run `dspark compile` once" in capsys.readouterr().err
    with pytest.raises(DsparkError, match="`dspark compile`"):
        _load(compiled_dir, "compiled")
    with pytest.raises(DsparkError, match="`dspark compile --dtype int8`"):
        _load(compiled_dir, "auto", "int8")


def test_padding_rows_write_past_the_real_tokens(compiled_dir):
    """A slot written by two rows of one call keeps either one's K/V: where rows round apart (the 9th row on
    an AVX2-only CPU), plain decoding's 8 padding rows sharing its token's slot made it nondeterministic
    (two runs' caches differed at the 40th token of a reply). The padding rows, copies of the last token,
    fill the slots after it instead."""
    model = _load(compiled_dir).model
    cache = model.new_cache(1, 40)
    model(torch.tensor([[5, 9, 17]]), cache)
    model(torch.tensor([[21]]), cache)
    kv = cache.kv[0][0]
    assert int(cache.lengths[0]) == 4 and kv[:, 3].abs().sum() > 0
    assert torch.equal(kv[:, 4:3 + ROWS], kv[:, 3:4].expand(-1, ROWS - 1, -1))


def _set_meta(meta_file, **fields) -> None:
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), **fields}))


def test_compile_refuses_what_the_step_does_not_cover(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    qwen3 = make_tiny_hf_model("qwen3", tmp_path / "qwen3", tie=True)
    assert main(["compile", "--model", str(qwen3)]) == 1  # a one-line error, no traceback


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_compiled_modes_verify_no_more_tokens_a_forward_than_their_exact_rows(compiled_dir, dtype):
    """Past the compiled runner's rows a forward runs the eager model (int8: the bf16 one), and on an AVX2-only
    CPU its 9th row rounded apart from the others: the hardware tree stops at the exact rows whatever the
    cost curve says (on an EPYC the eager bf16 16-token forward was cheaper than the int8 9-token one, and
    32-node trees made greedy output differ from plain int8 decoding on 12 of 12 prompts), fixed-size
    rules and trees that cannot fit are refused, and the decoder's chains are cut there."""
    target = _load(compiled_dir, dtype=dtype)
    limit = target.model.verify_limit
    assert limit == target.model.compiled.exact_rows and limit in (ROWS - 1, ROWS)
    assert _load(compiled_dir, "eager").model.verify_limit is None
    drafter = make_random_dspark(target, "vanilla", block_size=ROWS - 1, std=0.3)
    dspark = DSparkDrafter(drafter.model, target)
    policy = request_policy("tree", dspark, target)
    assert policy.tree_nodes <= limit - 1 and policy.sps.max_tokens == limit
    with pytest.raises(DsparkError, match="verifies at most"):
        request_policy(f"tree:{limit}", dspark, target)
    with pytest.raises(DsparkError, match="verifies at most"):
        Decoder(target, dspark, TreePolicy(limit))
    assert request_policy(f"fixed:{limit - 1}", dspark, target).k == limit - 1
    if dtype == "int8":
        with pytest.raises(DsparkError, match="one request at a time"):  # batched rows would run the bf16 model
            Engine(target, max_batch=2)
    assert Engine(target, max_batch=1).max_batch == 1
    prompt = torch.randint(3, 128, (9,), generator=torch.Generator().manual_seed(6)).tolist()
    want = Decoder(target).generate(prompt, 30, SamplingParams(temperature=0.0)).token_ids
    assert Decoder(target, dspark, policy).generate(prompt, 30, SamplingParams(temperature=0.0)).token_ids == want
    chains = Decoder(target, dspark).generate(prompt, 30, SamplingParams(temperature=0.0))  # every draft verified
    assert chains.token_ids == want and max(r.verified for r in chains.rounds) <= limit - 1
