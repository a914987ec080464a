"""decode/speculation.py: one grammar, `DRAFTER[@POLICY]` or `--policy`, for generate, eval and serve."""

import pytest
import torch
from helpers import make_random_dspark

from dspark.decode.engine import Engine
from dspark.decode.speculation import REQUEST_MAX_PROBE_EVERY, engine_factory, load_speculation, split_spec, with_policy
from dspark.draft.checkpoint import save_drafter
from dspark.errors import DsparkError
from dspark.model.loading import load_target
from dspark.schedule.policies import DSparkAsyncPolicy, FixedPolicy, parse_policy


@pytest.mark.parametrize("policy", ["ar", "full", "fixed:3", "threshold:0.4", "dspark", "dspark-async"])
def test_every_policy_spelling_rides_on_the_drafter(policy):
    assert split_spec(f"some/dir@{policy}") == ("some/dir", policy)
    assert with_policy("some/dir", policy) == f"some/dir@{policy}"
    assert with_policy(f"some/dir@{policy}", policy) == f"some/dir@{policy}"  # said twice, the same: fine


def test_defaults_and_conflicts():
    assert split_spec("some/dir") == ("some/dir", "full")  # generate / eval: a path verifies every draft
    assert split_spec("some/dir", default="dspark") == ("some/dir", "dspark")  # serve's default
    assert with_policy("auto", None) == "auto" and with_policy("auto", "full") == "auto@full"
    with pytest.raises(DsparkError, match="--policy"):
        with_policy("some/dir@full", "dspark")
    for bad in ("some/dir@warp", "some/dir@dspark:3", "some/dir@fixed:x"):
        with pytest.raises(DsparkError):
            split_spec(bad)
    with pytest.raises(DsparkError, match="unknown verification rule"):
        with_policy("auto", "fastest")


def test_a_path_with_an_at_sign_is_a_path(tmp_path):
    odd = tmp_path / "drafter@full"
    odd.mkdir()
    assert split_spec(str(odd)) == (str(odd), "full")


def test_new_spellings_build_their_policies(tiny_targets, tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    target = load_target(dict(tiny_targets)["llama-tied"], dtype=torch.float32, require_tokenizer=False)
    save_drafter(make_random_dspark(target, "vanilla", block_size=4).model, tmp_path / "d", target=target)
    _, drafter, fixed = load_speculation(f"{tmp_path / 'd'}@fixed:2", target)
    assert isinstance(fixed, FixedPolicy) and fixed.lengths([[0.9, 0.8, 0.7]], [3]) == [2]
    _, _, hw = load_speculation(f"{tmp_path / 'd'}@dspark-async", target)
    assert isinstance(hw, DSparkAsyncPolicy) and hw.gate.draft_cost(1) > 0  # the draft pass counted, as dspark
    _, _, tree = load_speculation(f"{tmp_path / 'd'}+lookup@tree", target)
    # a lone request's tree is drafted only while drafting pays (always drafting ran the default up to 27%
    # below plain decoding on an AVX2 EPYC), probing at least every REQUEST_MAX_PROBE_EVERY steps
    assert tree.should_draft(1) and tree.gate.max_probe_every == REQUEST_MAX_PROBE_EVERY
    tree.record_step(1, True, verified=1, committed=1, draft_s=tree.gate.draft_cost(1))  # the pass bought nothing
    assert not tree.should_draft(1)
    make, label, drafts = engine_factory(target, str(tmp_path / "d"), max_len=64)
    engine = make(parse_policy("full"), 2)
    assert isinstance(engine, Engine) and label == str(tmp_path / "d") and drafts == drafter.max_drafts == 4
    assert engine_factory(target, "none")[1:] == ("none", 0)
    assert engine_factory(target, "prompt-lookup")[1:] == ("prompt-lookup", 8)
