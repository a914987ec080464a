"""SPS profiling and the scheduler simulator."""

import json

import pytest
import torch
from helpers import assert_clean_error, make_random_dspark, make_tiny_hf_model, run_cli

from dspark.errors import DsparkError
from dspark.model.loading import load_target
from dspark.schedule.policies import parse_policy
from dspark.schedule.simulator import simulate
from dspark.schedule.sps import load_or_measure, parse_sps

SMOOTH = ",".join(f"{b}:{50 / (1 + 0.04 * (b - 1)):.3f}" for b in range(1, 81))
# a jagged curve: kernel-size cliffs every 8 tokens, as CPU GEMM blocking produces
JAGGED = ",".join(f"{b}:{50 / (1 + 0.03 * (b - 1)) * (0.7 if b % 8 in (1, 2) and b > 8 else 1.0):.3f}"
                  for b in range(1, 81))


def test_parse_sps(tmp_path):
    assert parse_sps("1:10,2:9.5,3:9").values == (10.0, 9.5, 9.0)
    (tmp_path / "t.json").write_text(json.dumps({"sps": [5, 4, 3]}))
    assert parse_sps(str(tmp_path / "t.json")).values == (5.0, 4.0, 3.0)
    for bad, msg in [("1:10,3:9", r"misses batch sizes \[2\]"), ("1=10", "B:steps_per_s"), ("1:0", "positive"),
                     (str(tmp_path / "none.json"), "neither an existing JSON file")]:
        with pytest.raises(DsparkError, match=msg):
            parse_sps(bad)


@pytest.mark.parametrize("curve, near_best", [(SMOOTH, ["dspark", "dspark-async"]), (JAGGED, ["dspark-async"])])
def test_scheduler_policies_are_near_the_best_policy_and_never_below_ar(curve, near_best):
    """On a smooth SPS curve both scheduler variants track the best fixed policy. On a jagged one the
    synchronous rule's early-stop break (required for losslessness) can halt at a cliff; the async
    variant's unconstrained capacity search on stale confidences steps over it."""
    sps = parse_sps(curve)
    others = ["ar", "fixed:1", "fixed:2", "fixed:4", "fixed:8", "threshold:0.5"]
    for c in (1, 2, 4, 8):
        results = {spec: simulate(parse_policy(spec, sps), sps, c, gamma=8, steps=600, seed=c).throughput
                   for spec in others + ["dspark", "dspark-async"]}
        best_other = max(results[k] for k in others)
        for spec in near_best:
            assert results[spec] >= 0.95 * best_other, (c, spec, results)
        assert results["dspark"] >= results["ar"] and results["dspark-async"] >= results["ar"]


def test_tree_policies_in_the_simulator_beat_chains_alone_and_shrink_in_a_batch():
    """The simulator grows synthetic token trees with the real growth code: one node is the chain's first
    draft (the same τ), a lone request's `tree` commits more per step than any chain rule, and in a
    batch its trees shrink to about the dspark rule's chains, never below plain AR."""
    sps = parse_sps(SMOOTH)
    run = lambda spec, c, steps=400: simulate(parse_policy(spec, sps), sps, c, gamma=8, steps=steps,
                                              accept_mean=0.6, seed=c)
    assert abs(run("tree:1", 1, 1000).tau - run("fixed:1", 1, 1000).tau) < 0.08
    alone = {spec: run(spec, 1) for spec in ("full", "dspark", "tree")}
    assert alone["tree"].throughput > 1.05 * max(alone["full"].throughput, alone["dspark"].throughput), alone
    for c in (4, 8):
        tree, dspark, ar = run("tree", c), run("dspark", c), run("ar", c)
        assert tree.throughput >= 0.95 * dspark.throughput and tree.throughput > ar.throughput, (c, tree, dspark)
        assert tree.avg_verify_len < alone["tree"].avg_verify_len / 2  # smaller trees per row


def test_scheduler_skips_drafting_when_it_does_not_pay():
    """With a draft pass costing half a plain step, a weak drafter loses to AR unless the policy stops
    drafting (from past steps); a strong one still wins by far."""
    sps = parse_sps(SMOOTH)
    draft_s = 0.5 / sps(1)
    for c in (1, 4):
        run = lambda spec, accept: simulate(parse_policy(spec, sps), sps, c, gamma=8, steps=600,  # noqa: E731
                                            accept_mean=accept, seed=c, draft_s=draft_s).throughput
        ar = run("ar", 0.2)
        assert run("fixed:1", 0.2) < 0.9 * ar  # the drafting cost is real
        for spec in ("dspark", "dspark-async"):
            assert run(spec, 0.2) >= 0.95 * ar, (c, spec)
            assert run(spec, 0.8) >= 1.3 * ar, (c, spec)


def test_profile_measures_once_then_reloads(tiny_targets, tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    target = load_target(tiny_targets[0][1], dtype=torch.float32, require_tokenizer=False)
    table, path, fresh = load_or_measure(target, max_tokens=6, context=16, reps=2, progress=False)
    assert fresh and table.max_tokens == 6 and all(v > 0 for v in table.values)
    again, path2, fresh2 = load_or_measure(target, max_tokens=6, context=16, reps=2, progress=False)
    assert not fresh2 and path2 == path and again == table
    r = run_cli("profile", "--model", str(tiny_targets[0][1]), "--max-tokens", "6", "--context", "16", "--reps", "2",
                "--dtype", "float32",  # the dtype cached above, whatever --dtype auto picks on this CPU
                "--plot", str(tmp_path / "sps.png"), env_extra={"DSPARK_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "cached" in r.stdout and (tmp_path / "sps.png").stat().st_size > 0
    r = run_cli("simulate", "--sps", str(path), "--policy", "dspark", "--concurrency", "1", "--steps", "50")
    assert r.returncode == 0 and "dspark" in r.stdout, r.stderr
    assert_clean_error(run_cli("simulate", "--sps", "1:10", "--policy", "fixed:8", "--concurrency", "4",
                               "--steps", "5"), "beyond the SPS table")
    assert_clean_error(run_cli("simulate", "--sps", "1:10", "--policy", "magic"), "unknown policy")


def test_profiles_fit_a_short_context_window(tmp_path, monkeypatch):
    """A target with a 64-position window: SPS and draft-cost profiles clip their 256-token context,
    record the clipped one, and `@dspark` decodes losslessly."""

    from dspark.decode.generate import Decoder
    from dspark.decode.speculation import load_drafter
    from dspark.draft.checkpoint import save_drafter
    from dspark.sampling import SamplingParams

    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    target = load_target(make_tiny_hf_model("llama", tmp_path / "short", max_positions=64), dtype=torch.float32,
                         require_tokenizer=False)
    assert target.model.max_positions == 64
    table, path, _ = load_or_measure(target, max_tokens=9, reps=1, progress=False)
    assert table.max_tokens == 9 and json.loads(path.read_text())["key"]["context"] == 55
    save_drafter(make_random_dspark(target, block_size=8).model, tmp_path / "d", target=target)
    drafter = load_drafter(f"{tmp_path / 'd'}@dspark", target)
    greedy = SamplingParams(temperature=0.0)
    prompt = [5, 9, 17, 33, 2, 64, 11]
    want = Decoder(target).generate(prompt, 40, greedy).token_ids
    assert Decoder(target, drafter).generate(prompt, 40, greedy).token_ids == want
    with pytest.raises(DsparkError, match="window is only 64 positions"):
        load_or_measure(target, max_tokens=64)


def test_profile_measures_fewer_sizes_and_interpolates_the_rest():
    from dspark.schedule.sps import interpolate_seconds, profile_sizes

    assert profile_sizes(9) == list(range(1, 10))  # a single request's round: every size measured
    sizes = profile_sizes(144)
    assert sizes[:16] == list(range(1, 17)) and {20, 64, 72, 128, 144} <= set(sizes) and 65 not in sizes
    assert len(sizes) < 144 / 3.5
    assert profile_sizes(70)[-1] == 70
    measured = {b: 0.01 + 0.001 * b for b in sizes}  # a straight line comes back exactly
    assert interpolate_seconds(measured, 144) == pytest.approx([0.01 + 0.001 * b for b in range(1, 145)])
    steps = interpolate_seconds({1: 1.0, 16: 1.0, 20: 2.0}, 20)
    assert steps[15] == 1.0 and steps[17] == pytest.approx(1.5) and steps[19] == 2.0


def test_profile_is_fitted_non_decreasing_so_noise_cannot_stop_admission():
    from dspark.schedule.policies import SPSTable, dspark_lengths
    from dspark.schedule.sps import interpolate_seconds, monotone_seconds

    line = {b: 0.030 + 0.0002 * b for b in range(1, 17)}
    assert monotone_seconds(line) == line  # an increasing profile is kept as measured
    noisy = {**line, 7: 0.0279, 11: 0.0351}  # one fast and one slow outlier, as a busy machine times them
    fitted = monotone_seconds(noisy)
    values = [fitted[b] for b in sorted(fitted)]
    assert values == sorted(values)
    assert sum(fitted.values()) == pytest.approx(sum(noisy.values()))  # pooled means: least squares
    assert fitted[7] > noisy[7] and fitted[11] < noisy[11]
    survivals = [[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]] * 8  # 8 rows that deserve many drafts each
    raw = SPSTable(tuple(1 / t for t in interpolate_seconds(noisy, 16)))
    smooth = SPSTable(tuple(1 / t for t in interpolate_seconds(fitted, 16)))
    assert sum(dspark_lengths(survivals, raw)) <= 3  # the raw bump at 11 tokens stops Algorithm 1
    assert sum(dspark_lengths(survivals, smooth)) == 8  # the whole curve fits 8 more tokens
