"""Evaluation metrics, Sequential Temperature Scaling, `dspark eval` / `dspark calibrate`."""

import json
import math

import pytest
import torch
from helpers import assert_clean_error, eval_prompts, make_random_dspark, run_cli

from dspark.decode.generate import Decoder
from dspark.decode.step import Round
from dspark.draft.checkpoint import save_drafter
from dspark.errors import DsparkError
from dspark.eval import metrics
from dspark.eval.calibration import fit_sts
from dspark.eval.evaluate import evaluate
from dspark.eval.llama_cpp import LlamaCppDecoder, llama_cpp_path
from dspark.eval.report import _machine_line, write_report
from dspark.model.loading import load_target
from dspark.sampling import SamplingParams
from dspark.schedule.policies import ThresholdPolicy
from dspark.util.platform import cpu_flags


def test_metrics_on_hand_made_rounds():
    rounds = [Round(4, 2, [2.0, 1.0, -1.0, 0.0]), Round(4, 4, [3.0, 2.0, 1.0, 1.0]),
              Round(4, 0, [-2.0, 0.0, 0.0, 0.0]), Round(2, 1, [1.0, -3.0])]
    assert metrics.tau(rounds) == (3 + 5 + 1 + 2) / 4
    assert metrics.verify_efficiency(rounds) == 11 / (5 + 5 + 5 + 3)
    # k=0: all 4 rounds reach it, 3 accept; k=1: rounds 1,2,4 reach it, 2 accept; k=2: rounds 1,2 reach, 1 accepts;
    # k=3: only round 2 reaches and accepts (round 4 never verified positions 2, 3)
    assert metrics.conditional_acceptance(rounds, 4) == [3 / 4, 2 / 3, 1 / 2, 1.0]
    a = metrics.prefix_survival([2.0, 1.0, -1.0])
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert a == pytest.approx([sig(2), sig(2) * sig(1), sig(2) * sig(1) * sig(-1)])
    assert metrics.prefix_survival([2.0, 1.0], [2.0, 0.5]) == pytest.approx([sig(1), sig(1) * sig(2)])
    assert metrics.ece([0.1, 0.1, 0.9, 0.9], [0, 1, 1, 1]) == pytest.approx((2 * 0.4 + 2 * 0.1) / 4)
    assert metrics.roc_auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert metrics.roc_auc([0.5, 0.5, 0.5], [0, 1, 1]) == pytest.approx(0.5)  # ties count half
    assert math.isnan(metrics.roc_auc([0.2, 0.3], [1, 1]))
    assert metrics.brier([0.2, 0.9], [0, 1]) == pytest.approx((0.04 + 0.01) / 2)
    per = metrics.survival_samples(rounds, 4)
    assert [len(s) for s, _ in per] == [4, 4, 3, 3] and per[1][1] == [1, 1, 0, 0]  # rounds that verified k
    sweep = metrics.threshold_sweep(rounds, [0.0, 0.99])
    assert sweep[0]["tokens_per_step"] == metrics.tau(rounds)  # C = 0 verifies everything
    assert sweep[1]["tokens_per_step"] == 1.0 and sweep[1]["drafts_per_step"] == 0.0


def test_sts_lowers_ece_of_overconfident_scores_and_keeps_the_ranking():
    gen = torch.Generator().manual_seed(0)
    g, rounds = 5, []
    for _ in range(4000):
        u = 1.5 * torch.randn(g, generator=gen) + 1.0  # true log-odds of each position surviving
        ok = torch.rand(g, generator=gen) < torch.sigmoid(u)
        accepted = int(ok.long().cumprod(0).sum())
        rounds.append(Round(g, accepted, (3.0 * u).tolist()))  # reported 3x too confident
    temps = fit_sts(rounds, g)
    before = metrics.calibration_report(rounds, g, None)
    after = metrics.calibration_report(rounds, g, temps)
    assert all(t > 1.5 for t in temps[:3]), temps  # the fit undoes the over-confidence
    assert after["ece"] < 0.5 * before["ece"] and after["ece"] < 0.03, (before["ece"], after["ece"])
    # each σ(z_k / T_k) is a monotone map of z_k: its own ranking is unchanged exactly, hence so is
    # the prefix product's at k = 0; later prefix products mix positions scaled differently, so
    # their AUC may move slightly
    assert after["per_position"][0]["auc"] == pytest.approx(before["per_position"][0]["auc"], abs=1e-12)
    for b, a in zip(before["per_position"], after["per_position"]):
        assert a["auc"] == pytest.approx(b["auc"], abs=0.01)
    for k in range(g):
        z = [r.confidence_logits[k] for r in rounds]
        raw = [1 / (1 + math.exp(-x)) for x in z]
        scaled = [1 / (1 + math.exp(-x / temps[k])) for x in z]
        y = [int(r.accepted > k) for r in rounds]
        assert metrics.roc_auc(scaled, y) == pytest.approx(metrics.roc_auc(raw, y), abs=1e-12)


def test_sts_keeps_the_previous_temperature_where_a_position_has_no_evidence():
    """Positions that no round survives would fit T -> 0 (all-zero scores have ECE 0); they keep the last fit."""
    gen = torch.Generator().manual_seed(1)
    rounds = []
    for _ in range(2000):
        u = 1.5 * torch.randn(4, generator=gen)
        accepted = int(torch.rand(1, generator=gen) < torch.sigmoid(u[0]))  # position 1+ never survives
        rounds.append(Round(4, accepted, (2.0 * u).tolist()))
    temps = fit_sts(rounds, 4)
    assert temps[0] > 1.2 and temps[1:] == [temps[0]] * 3, temps


def test_eval_runs_every_drafter_and_ar_on_the_same_prompts(smollm2_fp32, tmp_path):
    target = smollm2_fp32
    ds = tmp_path / "mini.jsonl"
    ds.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in eval_prompts("humaneval", 2)))
    save_drafter(make_random_dspark(target, "vanilla", block_size=4, rank=8, std=0.02).model, tmp_path / "rand",
                 target=target)
    reduced = list(range(0, target.cfg.vocab_size, 3))  # a draft vocabulary of every third token
    save_drafter(make_random_dspark(target, "vanilla", block_size=4, rank=8, std=0.02, draft_vocab=reduced).model,
                 tmp_path / "third", target=target)
    results = evaluate(target, ["prompt-lookup", str(tmp_path / "rand"), str(tmp_path / "third")], [ds], 2, 24, [0.0],
                       progress=False)
    runs = {(r["drafter"], r["dataset"]): r for r in results["runs"]}
    assert set(runs) == {(d, s) for d in ("prompt-lookup", "rand", "third") for s in ("mini", "macro")}
    replies = [Decoder(target).generate(target.encode_prompt(p), 24).token_ids for p in eval_prompts("humaneval", 2)]
    inside = sum(t % 3 == 0 for r in replies for t in r) / sum(len(r) for r in replies)
    assert 0 < inside < 1 and runs[("third", "mini")]["vocab_coverage"] == pytest.approx(inside)
    assert runs[("rand", "mini")]["vocab_coverage"] == 1.0 and runs[("prompt-lookup", "mini")]["vocab_coverage"] is None
    pl = runs[("prompt-lookup", "mini")]
    assert pl["prompts"] == 2 and pl["tau"] >= 1.0 and pl["ar_decode_tok_s"] > 0
    assert pl["speedup"] == pytest.approx(pl["decode_tok_s"] / pl["ar_decode_tok_s"])
    assert pl["calibration"] is None and len(pl["cond_accept"]) >= 1
    for r in (pl, runs[("rand", "mini")]):  # speedup = tokens per round / round cost, and tokens per round <= τ
        assert r["round_cost"] > 0 and r["speedup"] * r["round_cost"] <= r["tau"] + 1e-9
    rnd = runs[("rand", "mini")]
    assert rnd["calibration"] is not None and len(rnd["calibration"]["per_position"]) == 4
    assert rnd["ar_decode_tok_s"] == pl["ar_decode_tok_s"]  # one AR baseline per dataset, shared
    write_report(results, tmp_path / "out")
    for f in ("results.json", "report.md", "cond_accept.png", "reliability_rand.png", "threshold_sweep_rand.png"):
        assert (tmp_path / "out" / f).stat().st_size > 0
    report = (tmp_path / "out" / "report.md").read_text().splitlines()
    raw, sts = rnd["calibration"]["uncalibrated"]["ece"], rnd["calibration"]["ece"]
    assert any(row.startswith("| rand | mini |") and f"{raw:.3f} → {sts:.3f}" in row for row in report)
    assert any(row.startswith("| prompt-lookup | mini |") and row.endswith("| – | – | – |") for row in report)
    assert set(json.loads((tmp_path / "out" / "results.json").read_text())["runs"][0]) >= {
        "drafter", "dataset", "temperature", "prompts", "vocab_coverage", "tau", "cond_accept", "verify_efficiency", "decode_tok_s",
        "ar_decode_tok_s", "speedup", "round_cost", "calibration"}


def test_eval_runs_llama_cpp_on_the_same_prompts_beside_dspark(smollm2_fp32, tmp_path):
    target = smollm2_fp32
    ds = tmp_path / "mini.jsonl"
    prompts = eval_prompts("gsm8k", 2)
    ds.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in prompts))
    peer = LlamaCppDecoder(llama_cpp_path("embedded"), threads=2)
    assert peer.name == "llama.cpp Q4_1" and peer.one_token_batches
    for p in prompts:  # the same chat-template ids: llama.cpp's greedy reply starts as the target's does
        ids = target.encode_prompt(p)
        got, want = peer.generate(ids, 6), Decoder(target).generate(ids, 6)
        assert len(got.token_ids) == 6 and got.finish_reason == "length" and got.stats.decode_s > 0
        assert got.token_ids[0] == want.token_ids[0]
    results = evaluate(target, ["prompt-lookup"], [ds], 2, 12, [0.0, 1.0], progress=False, peers=[peer],
                       journal_path=tmp_path / "ev" / "journal.jsonl")
    rows = {(r["engine"], r["dataset"], r["temperature"]) for r in results["peers"]}
    assert rows == {("llama.cpp Q4_1", d, t) for d in ("mini", "macro") for t in (0.0, 1.0)}
    assert all(r["prompts"] == 2 and r["decode_tok_s"] > 0 for r in results["peers"] if r["dataset"] == "mini")
    assert results["config"]["machine"]["threads"] >= 1
    write_report(results, tmp_path / "ev")
    report = (tmp_path / "ev" / "report.md").read_text()
    assert "| llama.cpp Q4_1 | mini |" in report and "| prompt-lookup | " in report.split("over llama.cpp Q4_1")[-1]
    with pytest.raises(DsparkError, match="expected a .gguf file"):
        llama_cpp_path(str(tmp_path / "missing.gguf"))
    (tmp_path / "bad.gguf").write_bytes(b"not a GGUF file")
    with pytest.raises(DsparkError, match="cannot read .*bad.gguf as GGUF"):
        LlamaCppDecoder(tmp_path / "bad.gguf", threads=1)


def test_eval_journal_resumes_after_a_kill_and_refuses_other_settings(smollm2_fp32, tmp_path):
    target = smollm2_fp32
    ds = tmp_path / "mini.jsonl"
    ds.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in eval_prompts("humaneval", 3)))
    journal = tmp_path / "ev" / "journal.jsonl"
    run = lambda **kw: evaluate(target, ["prompt-lookup"], [ds], None, kw.get("n", 12), [0.0], progress=False,  # noqa: E731
                                journal_path=journal)
    first = run()
    lines = journal.read_text().splitlines(keepends=True)
    assert len(lines) == 1 + 3 * 2  # settings + (AR, prompt-lookup) x 3 prompts
    journal.write_text("".join(lines[:4]) + lines[4][:25])  # killed while writing the 4th generation
    resumed = run()
    again = journal.read_text().splitlines(keepends=True)
    # kept the finished prompt; the one cut short is redone whole, so its engines ran side by side
    assert again[:4] == lines[:4] and len(again) == 8 and again[4].startswith(lines[3][:40])
    tau = lambda res: [(r["drafter"], r["dataset"], r["tau"], r["cond_accept"]) for r in res["runs"]]  # noqa: E731
    assert tau(resumed) == tau(first)  # greedy: the same rounds whether resumed or not
    assert run() == resumed and journal.read_text().splitlines(keepends=True) == again  # all from the journal
    here = " ".join(cpu_flags())
    assert resumed["config"]["machine"]["generations_by_cpu_flags"] == {here: 6}
    other = [json.loads(line) for line in again]
    for rec in other[1:3]:  # two generations measured in another session, on a CPU with other flags
        rec["value"]["cpu_flags"] = "avx2 other-cpu"
    journal.write_text("".join(json.dumps(r) + "\n" for r in other))
    mixed = run()["config"]["machine"]
    assert mixed["generations_by_cpu_flags"] == {here: 4, "avx2 other-cpu": 2}
    assert "avx2 other-cpu: 2" in _machine_line(mixed)
    journal.write_text("".join(again))
    with pytest.raises(DsparkError, match="other settings.*max_new_tokens"):
        run(n=13)
    journal.write_text(again[0][:10])  # killed while writing the settings line: starts over
    assert tau(run()) == tau(first) and len(journal.read_text().splitlines()) == 7
    again = journal.read_text().splitlines(keepends=True)
    journal.write_text(again[0] + "not json\n" + "".join(again[1:]))
    with pytest.raises(DsparkError, match="journal.jsonl:2: not a journal record"):
        run()


def test_static_confidence_threshold_is_lossless_and_truncates(tiny_targets):
    target = load_target(tiny_targets[0][1], dtype=torch.float32, require_tokenizer=False)
    drafter = make_random_dspark(target, "gated", block_size=6, std=0.3)
    ar, spec = Decoder(target), Decoder(target, drafter, ThresholdPolicy(0.3))
    drafted = []
    for seed in range(3):
        prompt = torch.randint(3, 128, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
        got = spec.generate(prompt, 40)
        assert got.token_ids == ar.generate(prompt, 40).token_ids
        drafted += [r.verified for r in got.rounds]
        for r in got.rounds:  # every verified draft had prefix survival >= C
            assert all(a >= 0.3 for a in metrics.prefix_survival(r.confidence_logits or []))
    assert min(drafted) < 6 and max(drafted) > 0


@pytest.mark.parametrize("draft_s", [None, 0.004], ids=["rule", "rule+gate"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_hardware_aware_rule_is_lossless_and_stops_where_throughput_stops_rising(tiny_targets, temperature, draft_s):
    """PATH@dspark for one request: verify d_k only while (1 + Σ a) / (t_draft + 1 / SPS(1 + ℓ)) still
    rises, and (with the gate) skip drafting in rounds where earlier rounds show it does not pay."""
    from dspark.schedule.policies import DraftGate, DSparkPolicy, SPSTable, dspark_lengths

    target = load_target(tiny_targets[0][1], dtype=torch.float32, require_tokenizer=False)
    sps = SPSTable((50.0, 45.0, 44.0, 30.0, 29.0, 28.0, 20.0))  # jagged: cliffs after 1 and 3 drafts
    params = SamplingParams(temperature=temperature)
    ar, drafted, skipped = Decoder(target), [], 0
    for seed in range(3):
        drafter = make_random_dspark(target, "gated", block_size=6, std=0.3)
        policy = DSparkPolicy(sps)
        policy.gate = None if draft_s is None else DraftGate(sps, draft_seconds=lambda requests: draft_s,
                                                             probe_every=3, max_probe_every=3)
        rate = policy.rate(1)
        prompt = torch.randint(3, 128, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
        got = Decoder(target, drafter, policy).generate(prompt, 40, params, seed=seed)
        if temperature == 0:
            assert got.token_ids == ar.generate(prompt, 40).token_ids
        for r in got.rounds[:-1]:  # the last round has no budget left for drafts
            if r.confidence_logits is None:  # the gate skipped drafting this round
                skipped += 1
                continue
            full = dspark_lengths([metrics.prefix_survival(r.confidence_logits)], rate)[0] if r.verified else 0
            assert r.verified == full  # the rule's own choice (recorded logits are the verified prefix)
            drafted.append(r.verified)
    assert min(drafted) < 6 and max(drafted) > 0
    assert (skipped > 0) == (draft_s is not None)


def test_eval_and_calibrate_cli(tmp_path, tiny_targets):
    ds = tmp_path / "held.jsonl"
    ds.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in eval_prompts("gsm8k", 2)))
    r = run_cli("draft", "init", "--out", str(tmp_path / "d"), "--block-size", "4", "--markov-rank", "8")
    assert r.returncode == 0, r.stderr
    r = run_cli("calibrate", "--drafter", str(tmp_path / "d"), "--dataset", str(ds), "--max-new-tokens", "16",
                "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    temps = json.loads((tmp_path / "d" / "config.json").read_text())["confidence_temperatures"]
    assert len(temps) == 4 and all(t > 0 for t in temps)
    r = run_cli("eval", "--drafter", str(tmp_path / "d"), "--dataset", str(ds), "--limit", "1", "--max-new-tokens",
                "12", "--out", str(tmp_path / "ev"), "--confidence-threshold", "0.5", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "ev" / "results.json").read_text())["config"]["confidence_threshold"] == 0.5

    (tmp_path / "bad.jsonl").write_text('{"turns": ["ok"]}\n{"turns": [1]}\n')
    other = tmp_path / "other"
    r = run_cli("draft", "init", "--model", str(tiny_targets[0][1]), "--out", str(other))
    assert r.returncode == 0, r.stderr
    for args, needle in [
        (["--dataset", str(tmp_path / "missing.jsonl")], "missing.jsonl does not exist"),
        (["--dataset", str(tmp_path / "bad.jsonl")], "bad.jsonl:2"),
        (["--dataset", str(ds), "--drafter", str(other)], "different target"),
        (["--dataset", str(ds), "--temperature", "-1"], "temperature"),
        (["--dataset", str(ds), "--llama-cpp", str(tmp_path / "model.bin")], "expected a .gguf file"),
    ]:
        assert_clean_error(run_cli("eval", "--drafter", "prompt-lookup", "--out", str(tmp_path / "x"), *args), needle)
    assert_clean_error(run_cli("calibrate", "--drafter", "prompt-lookup", "--dataset", str(ds)), "prompt-lookup")


def test_reliability_bins_pool_over_datasets_by_count_and_drop_thin_bins():
    from dspark.eval.plots import MIN_BIN_COUNT, _pooled_bins

    def cal(bins):
        return {"per_position": [{"bins": bins}]}

    a = cal([{"score": 0.31, "accept": 0.5, "count": 30}, {"score": 0.96, "accept": 1.0, "count": 2}])
    b = cal([{"score": 0.33, "accept": 0.0, "count": 10}, {"score": 0.99, "accept": 1.0, "count": MIN_BIN_COUNT}])
    (s, acc, n), (s_hi, acc_hi, n_hi) = _pooled_bins([a, b], 0)
    assert n == 40 and s == pytest.approx((0.31 * 30 + 0.33 * 10) / 40) and acc == pytest.approx(15 / 40)
    assert n_hi == MIN_BIN_COUNT + 2 and acc_hi == 1.0
    assert s_hi == pytest.approx((0.96 * 2 + 0.99 * MIN_BIN_COUNT) / n_hi)
    assert _pooled_bins([a], 0) == [(0.31, 0.5, 30)]  # the 2-round bin is too thin to draw
