"""Online distillation: learning happens, kill -9 + resume is exact, torchrun matches one process."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import make_random_dspark, make_tiny_hf_model, make_tiny_regen_data, start_cli
from safetensors.torch import load_file

from dspark.errors import DsparkError
from dspark.model.loading import load_target
from dspark.train.config import TrainConfig, load_config
from dspark.train.trainer import Trainer


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny llama target (no EOS, so replies run to length) and 60 of its own T=1 replies."""
    root = tmp_path_factory.mktemp("train")
    model_dir = make_tiny_hf_model("llama", root / "target")
    target = load_target(model_dir, dtype=torch.float32, require_tokenizer=False)
    data = make_tiny_regen_data(dataclasses.replace(target, eos_token_ids=frozenset()), root / "regen.jsonl", n=60)
    return model_dir, data, target


def _cfg(tiny_run, out, **kw):
    model_dir, data, _ = tiny_run
    base = dict(data=str(data), out=str(out), target=str(model_dir), steps=60, batch_size=4, anchors_per_seq=8,
                block_size=4, markov_rank=8, eval_every=20, checkpoint_every=20, val_fraction=0.2, lr=3e-3,
                threads=1)
    base.update(kw)
    return TrainConfig(**base)


def _log(out):
    recs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return [r for r in recs if "val" not in r], [r for r in recs if "val" in r]


@pytest.mark.parametrize("algorithm,fusion", [("dspark", "shared"), ("dflash", "shared"), ("eagle3", "shared"),
                                              ("dspark", "layerwise")])
def test_loss_falls_and_validation_tau_rises(tiny_run, tmp_path, algorithm, fusion):
    Trainer(_cfg(tiny_run, tmp_path / "run", algorithm=algorithm, context_fusion=fusion), progress=False).run()
    train, val = _log(tmp_path / "run")
    assert len(train) == 60 and [v["step"] for v in val] == [0, 20, 40, 60]
    for r in train:  # where each step's time went
        parts = (r["target_s"], r["drafter_s"], r["optimizer_s"])
        assert min(parts) > 0 and sum(parts) <= r["seconds"]
    first = sum(r["loss"] for r in train[:5]) / 5
    last = sum(r["loss"] for r in train[-5:]) / 5
    assert last < first - 0.05, (first, last)
    assert val[-1]["val"]["expected_tau"] > val[0]["val"]["expected_tau"] + 0.1
    assert (tmp_path / "run" / "curves.png").stat().st_size > 10_000
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    arch = json.loads((tmp_path / "run" / "final" / "config.json").read_text())["architectures"]
    if algorithm != "dspark":
        assert all(r["tv"] == 0 and r["conf"] == 0 for r in train)
        assert arch == [{"dflash": "Qwen3DSparkModel", "eagle3": "LlamaEagle3Model"}[algorithm]]  # DeepSpec's names
    if algorithm == "eagle3":
        assert len(val[-1]["val"]["alpha"]) == 7  # the training-time test unrolls 7 steps
    # a finished run whose resume checkpoint was removed (as committed runs are) is never overwritten
    shutil.rmtree(tmp_path / "run" / "checkpoint")
    for resume in (False, True):
        with pytest.raises(DsparkError, match="finished training run"):
            Trainer(_cfg(tiny_run, tmp_path / "run", algorithm=algorithm, context_fusion=fusion), resume=resume,
                    progress=False)


@pytest.mark.parametrize("algorithm,loss", [("dflash", "kd"), ("dspark", "ce"), ("dspark", "soft_ce")])
def test_any_drafter_trains_on_any_loss(tiny_run, tmp_path, algorithm, loss):
    """The loss is a choice apart from the drafter (issue 47's ablations swap them): the logged terms combine
    as the chosen loss says, and the DSpark confidence head keeps its BCE under every one."""
    Trainer(_cfg(tiny_run, tmp_path / "run", algorithm=algorithm, loss=loss, steps=3, eval_every=3),
            progress=False).run()
    train, _ = _log(tmp_path / "run")
    for r in train:
        if loss == "kd":
            assert r["tv"] > 0 and r["conf"] == 0
            assert r["loss"] == pytest.approx(0.1 * r["ce"] + 0.9 * r["tv"], rel=1e-5)
        else:
            assert r["conf"] > 0 and r["tv"] > 0  # the L1 that c* needs is logged, not weighted
            assert r["loss"] == pytest.approx(r["ce"] + r["conf"], rel=1e-5)


def _write_toml(cfg: TrainConfig, path):
    lines = []
    for k, v in cfg.to_dict().items():
        lines.append(f"{k} = {json.dumps(v)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_kill_9_then_resume_equals_an_uninterrupted_run(tiny_run, tmp_path):
    cfg = _cfg(tiny_run, tmp_path / "killed", steps=30, checkpoint_every=5, eval_every=10)
    toml = _write_toml(cfg, tmp_path / "train.toml")
    ref = start_cli("train", "--config", str(toml), "--out", str(tmp_path / "ref"), "--no-progress")
    assert ref.wait(timeout=600) == 0, ref.stderr.read()

    proc = start_cli("train", "--config", str(toml), "--no-progress")
    state = tmp_path / "killed" / "checkpoint" / "state.json"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if state.exists() and json.loads(state.read_text())["step"] >= 10:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = json.loads(state.read_text())["step"]
    assert 10 <= killed_at < 30
    assert not (tmp_path / "killed" / "final").exists()

    again = start_cli("train", "--config", str(toml), "--no-progress")  # no --resume: refuses to clobber
    assert again.wait(timeout=300) == 1 and "--resume" in again.stderr.read()
    res = start_cli("train", "--config", str(toml), "--resume", "--no-progress")
    assert res.wait(timeout=600) == 0, res.stderr.read()

    a = load_file(tmp_path / "ref" / "final" / "model.safetensors")
    b = load_file(tmp_path / "killed" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ref_train, _ = _log(tmp_path / "ref")
    res_train, _ = _log(tmp_path / "killed")
    assert [r["step"] for r in res_train] == list(range(1, 31))  # lost steps were dropped from the log
    assert [r["loss"] for r in res_train] == [r["loss"] for r in ref_train]


def test_sigterm_stops_a_joint_run_with_checkpoints_of_one_step_that_resume_exactly(tiny_run, tmp_path):
    """SIGTERM mid-run (no periodic checkpoint due): both drafters checkpoint at the step that was running,
    the command says how to continue, and --resume ends where an uninterrupted joint run ends."""
    def tomls(tag):
        return [_write_toml(_cfg(tiny_run, tmp_path / f"{tag}-{a}", algorithm=a, steps=40, checkpoint_every=1000,
                                 eval_every=1000, draft_vocab_size=48), tmp_path / f"{tag}-{a}.toml")
                for a in ("dspark", "eagle3")]

    def train(paths, *extra):
        return start_cli("train", *[x for p in paths for x in ("--config", str(p))], "--no-progress", *extra)

    ref = train(tomls("ref"))
    assert ref.wait(timeout=600) == 0, ref.stderr.read()
    stopped = tomls("stopped")
    proc = train(stopped)
    log = tmp_path / "stopped-dspark" / "log.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if log.exists() and len(log.read_text().splitlines()) >= 4:  # the step-0 validation and 3 steps
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 130
    err = proc.stderr.read()
    assert "SIGTERM" in err and "--resume" in err, err
    steps = {json.loads((tmp_path / f"stopped-{a}" / "checkpoint" / "state.json").read_text())["step"]
             for a in ("dspark", "eagle3")}
    assert len(steps) == 1 and 3 <= steps.pop() < 40
    assert not (tmp_path / "stopped-dspark" / "final").exists()
    assert all((tmp_path / f"stopped-{a}" / "curves.png").stat().st_size > 10_000 for a in ("dspark", "eagle3"))

    res = train(stopped, "--resume")
    assert res.wait(timeout=600) == 0, res.stderr.read()
    for a in ("dspark", "eagle3"):
        x = load_file(tmp_path / f"ref-{a}" / "final" / "model.safetensors")
        y = load_file(tmp_path / f"stopped-{a}" / "final" / "model.safetensors")
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), a
        assert [r["step"] for r in _log(tmp_path / f"stopped-{a}")[0]] == list(range(1, 41))


def test_a_bfloat16_checkpoint_is_half_the_size_and_resumes_on_the_uninterrupted_trajectory(tiny_run, tmp_path):
    """checkpoint_dtype = bfloat16 stores weights and AdamW moments in bf16 (for runs committed to git);
    resuming casts them back to fp32, so the run goes on within bf16 rounding of the uninterrupted one."""
    kw = dict(steps=20, checkpoint_every=10, eval_every=100, autocast="off")
    Trainer(_cfg(tiny_run, tmp_path / "ref", **kw), progress=False).run()
    compact = _cfg(tiny_run, tmp_path / "half", checkpoint_dtype="bfloat16", **kw)
    first = Trainer(compact, progress=False)
    first.open_log()
    while first.step < 10:
        first.log(first.train_step())
        first.after_step()
    first.close_log()
    ckpt = tmp_path / "half" / "checkpoint"
    assert json.loads((ckpt / "state.json").read_text())["step"] == 10
    for f in ("drafter/model.safetensors", "optimizer.safetensors"):
        stored = load_file(ckpt / f)
        assert {v.dtype for v in stored.values() if v.dim()} == {torch.bfloat16}, f
        full = (tmp_path / "ref" / "checkpoint" / f).stat().st_size
        assert (ckpt / f).stat().st_size < 0.55 * full, f
    Trainer(compact, resume=True, progress=False).run()

    a = load_file(tmp_path / "ref" / "final" / "model.safetensors")
    b = load_file(tmp_path / "half" / "final" / "model.safetensors")
    for k in a:
        rel = ((a[k].float() - b[k].float()).norm() / a[k].float().norm().clamp(min=1e-12)).item()
        assert rel < 2e-2, (k, rel)
    ref_train, _ = _log(tmp_path / "ref")
    res_train, _ = _log(tmp_path / "half")
    assert [r["step"] for r in res_train] == list(range(1, 21))
    assert [r["loss"] for r in res_train[:10]] == [r["loss"] for r in ref_train[:10]]
    for r, q in zip(res_train[10:], ref_train[10:]):
        assert abs(r["loss"] - q["loss"]) < 2e-2 * abs(q["loss"]), (r["step"], r["loss"], q["loss"])
    with pytest.raises(DsparkError, match="checkpoint_dtype must be one of float32, bfloat16"):
        _cfg(tiny_run, tmp_path / "x", checkpoint_dtype="fp16").validate()


def test_torchrun_two_processes_follow_the_single_process_trajectory(tiny_run, tmp_path):
    # fp32 (autocast off): the 1e-5 bound is for fp32 sums; `auto` would train in bf16 on CPUs with bf16 units
    cfg = _cfg(tiny_run, tmp_path / "one", steps=8, eval_every=100, checkpoint_every=100, autocast="off")
    toml = _write_toml(cfg, tmp_path / "train.toml")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = start_cli("train", "--config", str(toml), "--no-progress", env=env)
    assert one.wait(timeout=600) == 0, one.stderr.read()
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "dspark.cli",
         "train", "--config", str(toml), "--out", str(tmp_path / "two"), "--no-progress"],
        capture_output=True, text=True, env=env, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert json.loads((tmp_path / "two" / "checkpoint" / "state.json").read_text())["world_size"] == 2
    a, _ = _log(tmp_path / "one")
    b, _ = _log(tmp_path / "two")
    assert len(a) == len(b) == 8
    for ra, rb in zip(a, b):
        for key in ("loss", "ce", "tv", "conf", "grad_norm"):
            assert abs(ra[key] - rb[key]) <= 1e-5, (ra["step"], key, ra[key], rb[key])


def test_bad_training_input_gives_clear_errors(tiny_run, tmp_path, tiny_targets):
    model_dir, data, target = tiny_run
    other = load_target(tiny_targets[3][1], dtype=torch.float32, require_tokenizer=False)
    from dspark.draft.checkpoint import save_drafter

    save_drafter(make_random_dspark(other, "vanilla", block_size=4).model, tmp_path / "qwen-drafter", target=other)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"id": "a", "prompt_ids": [1], "response_ids": [3, 4]}\n{oops\n')
    (tmp_path / "big.jsonl").write_text('{"id": "a", "prompt_ids": [1], "response_ids": [3, 4000]}\n')
    cases = [
        (dict(data=str(tmp_path / "empty.jsonl")), "holds no regenerated samples"),
        (dict(data=str(tmp_path / "bad.jsonl")), "bad.jsonl:2: not valid JSON"),
        (dict(data=str(tmp_path / "missing.jsonl")), "does not exist"),
        (dict(data=str(tmp_path / "big.jsonl")), "exceed the target's vocabulary"),
        (dict(init=str(tmp_path / "qwen-drafter")), "different target"),
        (dict(tap_layers=[1, 9]), r"tapped layer ids \[9\] are out of range"),
        (dict(block_size=1), "block_size must be >= 2"),
        (dict(algorithm="medusa"), "unknown algorithm"),
        (dict(loss="mse"), "unknown loss 'mse'; choose one of auto, kd, ce, soft_ce"),
        (dict(device="tpu"), "device must be auto, cpu, cuda or cuda:N"),
    ]
    if not torch.cuda.is_available():
        cases.append((dict(device="cuda"), "sees no CUDA GPU"))
    for overrides, message in cases:
        with pytest.raises(DsparkError, match=message):
            Trainer(_cfg(tiny_run, tmp_path / "run", **overrides), progress=False)
    with pytest.raises(DsparkError, match="no checkpoint"):
        Trainer(_cfg(tiny_run, tmp_path / "run"), resume=True, progress=False)
    # a checkpoint, then the data file changes: resuming would draw other samples
    lines = data.read_text().splitlines()
    (tmp_path / "grown.jsonl").write_text("\n".join(lines[:30]) + "\n")
    cfg = _cfg(tiny_run, tmp_path / "grow", data=str(tmp_path / "grown.jsonl"), steps=2, checkpoint_every=1)
    Trainer(cfg, progress=False).run()
    (tmp_path / "grown.jsonl").write_text("\n".join(lines[:40]) + "\n")
    with pytest.raises(DsparkError, match="changed since the checkpoint"):
        Trainer(cfg, resume=True, progress=False)
    with pytest.raises(DsparkError, match=r"configuration changed \(lr"):
        Trainer(dataclasses.replace(cfg, lr=1e-4), resume=True, progress=False)


def test_a_run_begun_with_the_target_shaped_layer_resumes_only_as_such(tiny_run, tmp_path):
    """Runs saved before `draft_layer` existed used the target's own layer: resuming one under the new
    default (DeepSpec's Qwen3 layer) is refused with the option to set; set back, it resumes."""
    cfg = _cfg(tiny_run, tmp_path / "old", steps=3, checkpoint_every=1, draft_layer="target")
    Trainer(dataclasses.replace(cfg, steps=2), progress=False).run()
    state = tmp_path / "old" / "checkpoint" / "state.json"
    saved = json.loads(state.read_text())
    from dspark.train.checkpointing import ADDED_OPTIONS

    for option in ADDED_OPTIONS:  # as written before any of them existed: each resumes at its old value
        del saved["config"][option]
    state.write_text(json.dumps(saved))
    with pytest.raises(DsparkError, match="draft_layer: 'target' -> 'qwen3'.*--set draft_layer=target"):
        Trainer(dataclasses.replace(cfg, draft_layer="qwen3"), resume=True, progress=False)
    trainer = Trainer(cfg, resume=True, progress=False)
    assert trainer.step == 2 and trainer.model.layers[0].self_attn.q_norm is None
    trainer.run()
    drafter = json.loads((tmp_path / "old" / "final" / "config.json").read_text())
    assert drafter["architectures"] == ["LlamaDSparkModel"]


def test_config_files_and_overrides(tmp_path):
    (tmp_path / "a.toml").write_text('data = "x.jsonl"\n[drafter]\nblock_size = 16\nhead = "gated"\n[train]\nlr = 1e-3\n')
    cfg = load_config(tmp_path / "a.toml", ["steps=7", "tap_layers=[1, 2]", "confidence_head=false"])
    assert (cfg.block_size, cfg.head, cfg.lr, cfg.steps, cfg.tap_layers, cfg.confidence_head) == (
        16, "gated", 1e-3, 7, [1, 2], False)
    (tmp_path / "b.yaml").write_text("data: x.jsonl\ntrain:\n  steps: 3\n  batch_size: 8\n")
    cfg = load_config(tmp_path / "b.yaml")
    assert (cfg.steps, cfg.batch_size) == (3, 8)
    for overrides, message in [(["stepz=3"], "unknown training option 'stepz'"), (["steps=abc"], "option 'steps'"),
                               (["steps"], "key=value"), (["block_size=1"], "block_size must be >= 2")]:
        with pytest.raises(DsparkError, match=message):
            load_config(tmp_path / "a.toml", overrides)
    (tmp_path / "c.toml").write_text("data = [")
    with pytest.raises(DsparkError, match="cannot parse"):
        load_config(tmp_path / "c.toml")


def test_shipped_configs_parse():
    from pathlib import Path

    configs = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.toml"))
    assert configs
    for path in configs:
        cfg = load_config(path)
        assert cfg.data and cfg.steps > 0


def test_group_by_length_batches_similar_lengths_and_still_visits_every_sample_once(tiny_run, tmp_path):
    _, data, _ = tiny_run
    lines = (data.read_text()).splitlines()
    varied = tmp_path / "varied.jsonl"
    with open(varied, "w") as f:
        for i, line in enumerate(lines):
            obj = json.loads(line)
            obj["response_ids"] = obj["response_ids"][: 3 + (i * 7) % 40]
            f.write(json.dumps(obj) + "\n")

    def spread(trainer, epoch):
        perm = trainer.order.permutation(epoch).tolist()
        assert sorted(perm) == list(range(len(trainer.train_set)))  # a permutation: each sample once
        lengths = [len(trainer.train_set[i].response_ids) for i in perm]
        return sum(max(lengths[i : i + 4]) - min(lengths[i : i + 4]) for i in range(0, len(perm), 4)), perm

    grouped = Trainer(_cfg(tiny_run, tmp_path / "g", data=str(varied)), progress=False)
    plain = Trainer(_cfg(tiny_run, tmp_path / "p", data=str(varied), group_by_length=False), progress=False)
    for epoch in (0, 1):
        (g_spread, g_perm), (p_spread, p_perm) = spread(grouped, epoch), spread(plain, epoch)
        assert g_spread < p_spread / 3, (g_spread, p_spread)
        assert g_perm != p_perm
    again = Trainer(_cfg(tiny_run, tmp_path / "g2", data=str(varied)), progress=False)
    assert again.order.permutation(1).tolist() == grouped.order.permutation(1).tolist()  # a function of (seed, epoch): resumable


@pytest.mark.parametrize("algorithm", ["dspark", "eagle3"])
def test_training_over_a_reduced_draft_vocabulary(tiny_run, tmp_path, algorithm):
    """draft_vocab_size K: the run drafts over the training replies' top-K tokens, learns, and its
    checkpoint carries the mapping; the trained drafter is lossless."""
    from dspark.decode.generate import Decoder
    from dspark.draft import vocab
    from dspark.draft.checkpoint import load_drafter_checkpoint
    from dspark.train.data import load_samples

    model_dir, data, target = tiny_run
    Trainer(_cfg(tiny_run, tmp_path / "run", algorithm=algorithm, steps=40, draft_vocab_size=48),
            progress=False).run()
    train, val = _log(tmp_path / "run")
    assert sum(r["loss"] for r in train[-5:]) < sum(r["loss"] for r in train[:5]) - 0.25
    assert val[-1]["val"]["expected_tau"] > val[0]["val"]["expected_tau"]
    final = tmp_path / "run" / "final"
    assert json.loads((final / "config.json").read_text())["draft_vocab_size"] == 48
    drafter = load_drafter_checkpoint(final, target)
    ids = drafter.model.draft_ids
    assert ids.numel() == 48 and vocab.coverage([s.response_ids for s in load_samples(data)], ids) > 0.5
    prompt = [5, 9, 17, 3]
    assert Decoder(target, drafter).generate(prompt, 30).token_ids == Decoder(target).generate(prompt, 30).token_ids


def test_all_anchors_in_chunks_give_the_gradient_of_one_pass(tiny_run, tmp_path):
    """anchors_per_seq = "all" takes every response position; anchor_chunk splits the drafter's pass
    (bounded memory) while the target runs once per micro-batch; the gradient is the same."""
    from dspark.train.batches import sample_anchors
    from dspark.train.data import load_samples

    _, data, _ = tiny_run
    sample = load_samples(data)[0]
    every = sample_anchors(sample, 512, "all", torch.Generator())
    assert every == list(range(len(sample.prompt_ids), len(sample.prompt_ids) + len(sample.response_ids) - 1))

    grads, spans = [], []
    for chunk in (1000, 7):
        trainer = Trainer(_cfg(tiny_run, tmp_path / f"c{chunk}", anchors_per_seq="all", anchor_chunk=chunk,
                               batch_size=2, autocast="off"), progress=False)
        items = trainer.order.global_batch(0)
        t = trainer.target_pass(items)
        spans.append(len(trainer.anchor_spans(t)))
        for span in trainer.anchor_spans(t):
            trainer.loss_sums(trainer.drafter_pass(t, span, trainer.model)).total.backward()
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]))
        calls = []
        forward = trainer.target.model.forward
        trainer.target.model.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
        assert trainer.train_step()["loss"] > 0
        assert len(calls) == 1  # one target forward per micro-batch, however many anchor chunks
    assert spans[0] == 1 and spans[1] > 3
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_joint_training_shares_the_target_pass_and_follows_each_solo_run(tiny_run, tmp_path):
    """DSpark (taps 1, 3; 4 block slots) and EAGLE-3 (taps 0-2, 7 TTT steps) on one target pass per step,
    killed after 2 steps and resumed: each ends where its own uninterrupted solo run ends."""
    from dspark.train.joint import JointTrainer

    algos = ("dspark", "eagle3")
    cfgs = [_cfg(tiny_run, tmp_path / f"joint-{a}", algorithm=a, steps=5, eval_every=5, checkpoint_every=1,
                 draft_vocab_size=48, autocast="off", tap_layers=taps)
            for a, taps in zip(algos, ([1, 3], []))]
    joint = JointTrainer(cfgs, progress=False)
    assert len(joint.taps) > max(len(t.taps) for t in joint.trainers)
    calls = []
    forward = joint.trainers[0].target.model.forward
    joint.trainers[0].target.model.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    for _ in range(2):
        recs = joint.train_step()
        for t in joint.trainers:
            t.save_checkpoint()
    assert len(calls) == 2 and all(r["target_shared_by"] == 2 and r["target_s"] > 0 for r in recs)
    JointTrainer(cfgs, resume=True, progress=False).run()
    for a, cfg in zip(algos, cfgs):
        Trainer(dataclasses.replace(cfg, out=str(tmp_path / f"solo-{a}")), progress=False).run()
        x = load_file(tmp_path / f"joint-{a}" / "final" / "model.safetensors")
        y = load_file(tmp_path / f"solo-{a}" / "final" / "model.safetensors")
        assert x.keys() == y.keys() and all(torch.allclose(x[k], y[k], rtol=1e-4, atol=1e-6) for k in x), a
        (jt, jv), (st, sv) = _log(tmp_path / f"joint-{a}"), _log(tmp_path / f"solo-{a}")
        assert [r["step"] for r in jt] == [3, 4, 5]  # the resumed part (steps 1-2 were the killed process')
        assert all(abs(r["loss"] - s["loss"]) < 1e-4 for r, s in zip(jt, st[2:]))
        assert abs(jv[-1]["val"]["expected_tau"] - sv[-1]["val"]["expected_tau"]) < 1e-4

    with pytest.raises(DsparkError, match="need the same seed"):
        JointTrainer([cfgs[0], dataclasses.replace(cfgs[1], seed=1)])
    with pytest.raises(DsparkError, match="its own run directory"):
        JointTrainer([cfgs[0], dataclasses.replace(cfgs[1], out=cfgs[0].out)])


def test_several_data_sources_train_together_and_hold_out_by_prompt(tiny_run, tmp_path):
    """`data` may list several regenerated sets (a second reply per prompt): their samples train
    together, and the validation split holds out prompts, so both replies to a held-out prompt are
    held out. From the command line: `--data A --data B` (a JSON list through --set)."""
    from dspark.train.batches import split_data

    model_dir, data, target = tiny_run
    second = tmp_path / "second.jsonl"
    lines = [json.loads(line) for line in data.read_text().splitlines()]
    second.write_text("".join(json.dumps({**r, "response_ids": r["response_ids"][::-1]}) + "\n" for r in lines))
    one = split_data(_cfg(tiny_run, tmp_path / "one"), target.cfg.vocab_size)
    cfg = load_config(None, [f"data={json.dumps([str(data), str(second)])}", f"target={model_dir}"])
    assert cfg.data_paths == [str(data), str(second)]
    both = split_data(dataclasses.replace(_cfg(tiny_run, tmp_path / "both"), data=cfg.data), target.cfg.vocab_size)
    for single, double in zip(one, both):
        assert sorted(s.id for s in double) == sorted(2 * [s.id for s in single])
    assert {s.id for s in both[0]}.isdisjoint(s.id for s in both[1])
    assert load_config(None, [f"data={json.dumps([str(data)])}"]).data == str(data)  # one path stays a path
    for bad in ("[1, 2]", "[not json"):
        with pytest.raises(DsparkError, match="option 'data'"):
            load_config(None, [f"data={bad}"])


def test_confidence_head_trains_alone_when_asked(tiny_run, tmp_path):
    trainer = Trainer(_cfg(tiny_run, tmp_path / "alone", conf_into_backbone=False), progress=False)
    assert trainer.model.confidence_head.detach_inputs
    assert not Trainer(_cfg(tiny_run, tmp_path / "joint"), progress=False).model.confidence_head.detach_inputs


@pytest.mark.parametrize("algorithm,autocast", [("dspark", "off"), ("dspark", "bf16"), ("eagle3", "off")])
def test_a_bf16_teacher_trains_every_drafter(tiny_run, tmp_path, algorithm, autocast):
    """target_dtype = bfloat16 runs the frozen target in bf16 (its taps, distributions, embeddings
    and LM head) under an fp32 or autocast drafter; the run learns and validates."""
    cfg = _cfg(tiny_run, tmp_path / "bf16", algorithm=algorithm, autocast=autocast, target_dtype="bfloat16",
               steps=24, eval_every=12, checkpoint_every=12)
    trainer = Trainer(cfg, progress=False)
    assert trainer.target.model.dtype == torch.bfloat16
    trainer.run()
    train, val = _log(tmp_path / "bf16")
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train)
    assert sum(r["loss"] for r in train[-4:]) < sum(r["loss"] for r in train[:4])
    assert val[-1]["val"]["expected_tau"] >= 1.0
    with pytest.raises(DsparkError, match="target_dtype must be"):
        dataclasses.replace(cfg, target_dtype="fp8").validate()


@pytest.mark.parametrize("algorithm", ["dspark", "eagle3"])
def test_the_compiled_loss_trains_as_the_eager_one(tiny_run, tmp_path, algorithm):
    """compile_loss = on (Inductor over the loss's [slots, vocabulary] arithmetic) logs the losses and
    validation of the eager loss, to float rounding; `auto` compiles long runs only."""
    logs = {}
    for mode in ("off", "on"):
        cfg = _cfg(tiny_run, tmp_path / mode, algorithm=algorithm, compile_loss=mode, steps=4, eval_every=4,
                   checkpoint_every=4)
        trainer = Trainer(cfg, progress=False)
        assert (trainer.dense_loss is not None) == (mode == "on")
        trainer.run()
        logs[mode] = _log(tmp_path / mode)
    for eager, compiled in zip(*(logs[m][0] + logs[m][1] for m in ("off", "on"))):
        for key in ("loss", "ce", "tv", "conf"):
            if key in eager:
                assert compiled[key] == pytest.approx(eager[key], rel=1e-4, abs=1e-6), key
    assert Trainer(_cfg(tiny_run, tmp_path / "long", steps=200), progress=False).dense_loss is not None


def test_a_compiled_loss_that_fails_falls_back_to_eager_once(monkeypatch, caplog):
    from dspark.train import losses

    def broken(fn, **_):
        def run(*args):
            raise RuntimeError("no C++ compiler")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    dense = losses.compiled_dense_loss()
    g = torch.Generator().manual_seed(0)
    logits, p_t = torch.randn(5, 16, generator=g), torch.softmax(torch.randn(5, 16, generator=g), -1)
    args = (logits, None, p_t, torch.zeros(5), torch.arange(5), torch.ones(5), 0.1, 0.9, 1.0, 0.0)
    with caplog.at_level("WARNING", logger="dspark.train"):
        got = dense(*args)
        again = dense(*args)
    assert [r.message.count("no C++ compiler") for r in caplog.records] == [1]
    assert all(torch.equal(a, b) for a, b in zip(got, losses.dense_loss_sums(*args)))
    assert all(torch.equal(a, b) for a, b in zip(again, got))
    with pytest.raises(RuntimeError):  # a real error is the eager loss's own
        dense(logits[:, :3], *args[1:])
