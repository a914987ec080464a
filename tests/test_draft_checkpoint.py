"""Drafter checkpoints: bit-exact round trip, DeepSpec-style export, clear errors on mismatch."""

import json

import pytest
import torch
from helpers import make_random_dspark, make_tiny_hf_model, run_cli
from safetensors.torch import load_file, save_file

from dspark.decode import speculation
from dspark.decode.speculation import load_drafter, load_speculation
from dspark.draft import registry
from dspark.draft.checkpoint import load_drafter_checkpoint, load_model, save_drafter
from dspark.draft.export import export_drafter
from dspark.errors import DsparkError
from dspark.model.loading import load_target
from dspark.sampling import SamplingParams
from dspark.schedule.policies import parse_policy


@pytest.fixture(scope="module")
def tiny(tiny_targets):
    return {name: load_target(path, dtype=torch.float32, require_tokenizer=False) for name, path in tiny_targets}


def _propose(drafter, target, seed=0):
    tokens = list(range(5, 30))
    out = target.model(torch.tensor([tokens]), target.model.new_cache(1, 64), taps=drafter.tap_layers)
    drafter.begin(tokens)
    drafter.observe(tokens, out.taps[0])
    return drafter.propose(9, 99, SamplingParams(0.9), torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn", "none"])
def test_save_then_load_is_bit_exact(tiny, tmp_path, head):
    target = tiny["qwen3-tied"]
    drafter = make_random_dspark(target, head, block_size=4, layers=2)
    save_drafter(drafter.model, tmp_path / "d", target=target)
    loaded = load_drafter_checkpoint(tmp_path / "d", target)
    want, got = drafter.model.state_dict(), loaded.model.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    a, b = _propose(drafter, target), _propose(loaded, target)
    assert a.tokens == b.tokens and torch.equal(a.probs, b.probs)
    names = set(load_file(tmp_path / "d" / "model.safetensors"))
    assert "embed_tokens.weight" not in names and "lm_head.weight" not in names  # shared, never copied
    assert "fc.weight" in names and "layers.1.self_attn.q_norm.weight" in names
    if head != "none":
        assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"} <= names


def test_a_layerwise_fusion_drafter_saves_loads_and_refuses_export_clearly(tiny, tmp_path):
    """DFlare's fusion: its tensors (no `fc`; per-layer fusion weights, context k / v projections) go
    through save / load bit for bit, config.json says so, and every foreign layout refuses it by name."""
    target = tiny["qwen3-tied"]
    drafter = make_random_dspark(target, "vanilla", block_size=4, layers=2, fusion="layerwise")
    save_drafter(drafter.model, tmp_path / "d", target=target)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["context_fusion"] == "layerwise" and cfg["target_layer_ids"] == [0, 1, 2]  # all a 4-layer target allows
    names = set(load_file(tmp_path / "d" / "model.safetensors"))
    assert "fc.weight" not in names
    assert {"layer_fusion_weights", "layers.1.self_attn.k_proj_target.weight", "layers.1.self_attn.v_proj_target.weight"} <= names
    loaded = load_drafter_checkpoint(tmp_path / "d", target)
    want, got = drafter.model.state_dict(), loaded.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    a, b = _propose(drafter, target), _propose(loaded, target)
    assert a.tokens == b.tokens and torch.equal(a.probs, b.probs)
    for layout in ("deepspec", "speculators"):
        with pytest.raises(DsparkError, match="fuses the target's features layer by layer"):
            export_drafter(tmp_path / "d", target, tmp_path / layout, layout=layout)
    with pytest.raises(DsparkError, match="unknown context fusion 'mixed'"):
        make_random_dspark(target, "vanilla", fusion="mixed")


def test_config_follows_the_deepspec_layout(tiny, tmp_path):
    target = tiny["qwen3-tied"]
    save_drafter(make_random_dspark(target, "gated", block_size=4).model, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"]
    assert cfg["markov_head_type"] == "gated" and cfg["markov_rank"] == 8
    assert cfg["enable_confidence_head"] and cfg["confidence_head_with_markov"]
    assert cfg["num_target_layers"] == 4 and cfg["num_hidden_layers"] == 1 and cfg["block_size"] == 4
    for key in ("mask_token_id", "target_layer_ids", "num_anchors", "hidden_size", "vocab_size", "head_dim"):
        assert key in cfg


def test_bf16_checkpoint_loads_into_the_target_dtype(tiny, tmp_path):
    target = tiny["llama-untied"]
    drafter = make_random_dspark(target, "rnn", block_size=4)
    save_drafter(drafter.model, tmp_path / "d", dtype=torch.bfloat16)
    loaded = load_model(tmp_path / "d", target)[0]
    assert loaded.dtype == torch.float32
    for k, v in drafter.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v.to(torch.bfloat16).float())


def test_export_writes_the_shared_tensors_and_still_loads(tiny, tmp_path):
    target = tiny["llama-untied"]
    drafter = make_random_dspark(target, "vanilla", block_size=4)
    save_drafter(drafter.model, tmp_path / "d", target=target)
    export_drafter(tmp_path / "d", target, tmp_path / "x")
    tensors = load_file(tmp_path / "x" / "model.safetensors")
    assert torch.equal(tensors["embed_tokens.weight"], target.model.embed_tokens)
    assert torch.equal(tensors["lm_head.weight"], target.model.lm_head)
    loaded = load_model(tmp_path / "x", target)[0]
    assert all(torch.equal(v, drafter.model.state_dict()[k]) for k, v in loaded.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_of_a_reduced_vocabulary_drafter_keeps_every_tensor_intact(tiny, tmp_path, dtype):
    """Each tensor in its own kind (floats in the checkpoint's float dtype, index maps as integers); the
    LM head as the K draft rows (target ids d2t + arange(K)); loading back is bit-exact."""
    target = tiny["llama-untied"]
    drafter = make_random_dspark(target, "vanilla", block_size=4, draft_vocab=list(range(3, 128, 2)))
    save_drafter(drafter.model, tmp_path / "d", target=target, dtype=dtype)
    export_drafter(tmp_path / "d", target, tmp_path / "x")
    tensors = load_file(tmp_path / "x" / "model.safetensors")
    saved = load_file(tmp_path / "d" / "model.safetensors")
    for name, t in tensors.items():
        if name in ("d2t", "t2d"):
            assert t.dtype == saved[name].dtype and not t.is_floating_point() and torch.equal(t, saved[name])
        else:
            assert t.dtype == dtype, name
    rows = tensors["d2t"] + torch.arange(tensors["d2t"].numel())
    assert rows.tolist() == list(range(3, 128, 2))
    assert torch.equal(tensors["lm_head.weight"], target.model.lm_head[rows].to(dtype))
    assert torch.equal(tensors["embed_tokens.weight"], target.model.embed_tokens.to(dtype))
    loaded = load_model(tmp_path / "x", target)[0].state_dict()
    assert all(torch.equal(v, load_model(tmp_path / "d", target)[0].state_dict()[k]) for k, v in loaded.items())


def test_convert_to_bf16_keeps_config_and_calibration(tiny, tiny_targets, tmp_path):
    target = tiny["llama-untied"]
    drafter = make_random_dspark(target, "gated", block_size=4)
    save_drafter(drafter.model, tmp_path / "d", target=target, extra={"confidence_temperatures": [1.5, 1, 1, 2]})
    r = run_cli("draft", "convert", "--drafter", str(tmp_path / "d"), "--out", str(tmp_path / "b"), "--dtype",
                "bfloat16", "--model", str(dict(tiny_targets)["llama-untied"]))
    assert r.returncode == 0, r.stderr
    tensors = load_file(tmp_path / "b" / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in tensors.values())
    want = drafter.model.state_dict()
    assert all(torch.equal(v, want[k].to(torch.bfloat16)) for k, v in tensors.items())
    assert load_drafter_checkpoint(tmp_path / "b", target).temperatures == [1.5, 1, 1, 2]
    r = run_cli("draft", "convert", "--drafter", str(tmp_path / "d"), "--out", str(tmp_path / "c"), "--dtype", "int8")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_loading_against_another_target_fails_clearly(tiny, tmp_path):
    target = tiny["llama-untied"]
    save_drafter(make_random_dspark(target, "vanilla", block_size=4).model, tmp_path / "d", target=target)
    with pytest.raises(DsparkError, match="different target.*LM-head probe differs"):  # same shapes, other weights
        load_drafter(str(tmp_path / "d"), tiny["llama-tied"])
    with pytest.raises(DsparkError, match="different target.*model family llama vs the target's qwen3"):
        load_drafter(str(tmp_path / "d"), tiny["qwen3-tied"])
    other = load_target(make_tiny_hf_model("llama", tmp_path / "big", vocab=200, layers=3), dtype=torch.float32,
                        require_tokenizer=False)
    with pytest.raises(DsparkError, match="vocabulary size 128 vs the target's 200.*number of target layers 4"):
        load_drafter(str(tmp_path / "d"), other)


def test_broken_checkpoints_fail_clearly(tiny, tmp_path):
    target = tiny["llama-untied"]
    good = tmp_path / "good"
    save_drafter(make_random_dspark(target, "vanilla", block_size=4).model, good, target=target)
    cfg = json.loads((good / "config.json").read_text())

    def variant(name, config=None, drop_tensor=None):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config or cfg) if not isinstance(config, str) else config)
        tensors = load_file(good / "model.safetensors")
        if drop_tensor:
            tensors.pop(drop_tensor)
        save_file(tensors, d / "model.safetensors")
        return str(d)

    cases = [
        (str(tmp_path / "nope"), "is neither a known drafter"),
        (variant("badjson", "{not json"), "not valid JSON"),
        (variant("nofield", {k: v for k, v in cfg.items() if k != "block_size"}), "lacks the field 'block_size'"),
        (variant("block1", dict(cfg, block_size=1)), "block size must be >= 2"),
        (variant("taps", dict(cfg, target_layer_ids=[1, 7])), r"tapped layer ids \[7\] are out of range"),
        (variant("head", dict(cfg, markov_head_type="lstm")), "unknown head type 'lstm'"),
        (variant("missing", drop_tensor="fc.weight"), "missing: fc.weight"),
        (variant("rank", dict(cfg, markov_rank=16)), "wrong shape: markov_head.markov_w1.weight"),
    ]
    for path, message in cases:
        with pytest.raises(DsparkError, match=message):
            load_drafter(path, target)
    (tmp_path / "noconfig").mkdir()
    with pytest.raises(DsparkError, match="no config.json"):
        load_drafter(str(tmp_path / "noconfig"), target)
    with pytest.raises(DsparkError, match="exceeds the drafter's block size 4"):
        load_drafter(str(good), target, num_draft_tokens=5)


def test_cli_draft_init_writes_a_loadable_drafter(tiny_targets, tiny, tmp_path):
    name, path = tiny_targets[2]  # qwen2 target (q/k/v biases): the draft layers are still DeepSpec's Qwen3 ones
    r = run_cli("draft", "init", "--model", str(path), "--out", str(tmp_path / "d"), "--head", "rnn",
                "--block-size", "5", "--layers", "2", "--tap-layers", "0,2", "--markov-rank", "12", "--copy-target-layers")
    assert r.returncode == 0, r.stderr
    assert "head rnn, block 5, 2 layer(s), taps [0, 2]" in r.stdout
    drafter = load_drafter_checkpoint(tmp_path / "d", tiny[name])
    assert drafter.cfg.markov_rank == 12 and drafter.cfg.enable_confidence_head
    names = drafter.model.state_dict()
    assert "layers.1.self_attn.q_norm.weight" in names and "layers.1.self_attn.q_proj.bias" not in names
    target_norm = tiny[name].model.norm
    assert not torch.equal(target_norm, torch.ones_like(target_norm))
    assert torch.equal(drafter.model.norm.weight, target_norm)  # starts from the target's final norm gains
    source = load_file(str(path / "model.safetensors"))  # layers: copies of the target's last two
    for i, layer in enumerate(drafter.model.layers):
        for name, p in layer.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # the target has none: they start at 1
                assert torch.equal(p, torch.ones_like(p)), name
            else:
                assert torch.equal(p, source[f"model.layers.{2 + i}.{name}"]), name
    r = run_cli("draft", "init", "--model", str(path), "--out", str(tmp_path / "e"), "--head", "none")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"  # DeepSpec's DFlash naming
    assert cfg["dspark_target_model_type"] == "qwen2" and cfg["markov_rank"] == 0 and not cfg["enable_confidence_head"]

    for args, message in [
        (["--tap-layers", "1,9"], "tapped layer ids [9] are out of range for a 4-layer target"),
        (["--tap-layers", "1,x"], "comma-separated integers"),
        (["--block-size", "1"], "block size must be >= 2"),
        (["--model", str(tmp_path / "missing")], "missing"),
    ]:
        r = run_cli("draft", "init", "--model", str(path), "--out", str(tmp_path / "f"), *args)
        assert r.returncode == 1 and message in r.stderr.splitlines()[-1] and "Traceback" not in r.stderr, r.stderr


def test_auto_picks_the_bundled_drafter_of_the_target_else_prompt_lookup(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "BUNDLED_DIR", tmp_path / "bundled")
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))  # auto profiles SPS for @dspark
    qwen3, llama = tiny["qwen3-tied"], tiny["llama-untied"]
    save_drafter(make_random_dspark(qwen3, "vanilla", block_size=4).model, tmp_path / "bundled" / "q", target=qwen3)
    assert registry.bundled_drafter(qwen3) == tmp_path / "bundled" / "q"
    assert registry.bundled_drafter(llama) is None
    assert load_drafter("auto", qwen3).drafter.block_size == 4  # with prompt-lookup branches
    assert load_drafter("auto@full", qwen3).block_size == 4
    assert type(load_drafter("auto", llama)).__name__ == "PromptLookupDrafter"
    # auto@RULE: the bundled drafter with that rule; a bad rule fails before anything loads
    bundled = tmp_path / "bundled" / "q"
    assert speculation.resolve_drafter_spec("auto", qwen3) == f"{bundled}+lookup@tree"
    assert speculation.resolve_drafter_spec("auto@dspark", qwen3) == f"{bundled}@dspark"
    assert speculation.resolve_drafter_spec("auto@full", qwen3) == f"{bundled}@full"
    assert speculation.resolve_drafter_spec("auto@threshold:0.4", qwen3) == f"{bundled}@threshold:0.4"
    assert speculation.resolve_drafter_spec("auto@full", llama) == "prompt-lookup"
    # a bare auto grows trees with prompt-lookup branches; +lookup defaults to tree
    assert speculation.resolve_drafter_spec("auto", qwen3, "@full") == f"{bundled}@full"
    assert speculation.resolve_drafter_spec("auto+lookup", qwen3) == f"{bundled}+lookup@tree"
    assert speculation.resolve_drafter_spec("auto+lookup@tree:4", qwen3) == f"{bundled}+lookup@tree:4"
    assert type(load_drafter(f"{bundled}+lookup@tree", qwen3)).__name__ == "LookupBranchDrafter"
    for bad, why in (("prompt-lookup+lookup", "model drafter"), (f"{bundled}+lookup@full", "@tree")):
        with pytest.raises(DsparkError, match=why):
            speculation.load_speculation(bad, qwen3)
    make, _, _ = speculation.engine_factory(qwen3, f"{bundled}+lookup")  # the engine's trees take the branches
    assert type(make(parse_policy("tree:4"), 2).drafter).__name__ == "BatchLookupBranches"
    with pytest.raises(DsparkError, match="@tree"):
        make(parse_policy("full"), 2)
    assert speculation.split_spec("auto+lookup", default="dspark") == ("auto+lookup", "tree")
    speculation.check_drafter_spec("auto@full")
    with pytest.raises(DsparkError, match="unknown verification rule"):
        speculation.check_drafter_spec("auto@fast")
    with pytest.raises(DsparkError, match="unknown verification rule"):
        speculation.resolve_drafter_spec("auto@fast", qwen3)
    # same shapes, other weights: the probe tells them apart
    other = load_target(make_tiny_hf_model("qwen3", tmp_path / "other-qwen3", tie=True, seed=1), dtype=torch.float32,
                        require_tokenizer=False)
    assert registry.bundled_drafter(other) is None


def test_verification_rule_suffix(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    target = tiny["llama-tied"]
    save_drafter(make_random_dspark(target, "vanilla", block_size=4).model, tmp_path / "d", target=target)
    save_drafter(make_random_dspark(target, "none", block_size=4, confidence=False).model, tmp_path / "bare", target=target)
    d = tmp_path / "d"
    assert load_speculation(str(d), target)[2].name == "full"  # a path alone: verify every draft
    _, drafter, hw = load_speculation(f"{d}@dspark", target)
    assert hw.name == "dspark" and hw.sps.max_tokens == 5 and drafter.block_size == 4
    cost = hw.gate.draft_cost(1)  # the draft pass, measured once and cached like SPS
    assert cost > 0 and len(list((tmp_path / "cache" / "sps").glob("draft-*.json"))) == 1
    assert load_speculation(f"{d}@dspark", target)[2].gate.draft_cost(1) == cost
    assert load_speculation(f"{d}@threshold:0.4", target)[2].c == 0.4
    assert load_speculation(str(d), target, confidence_threshold=0.3)[2].c == 0.3
    for spec, message in [(f"{d}@warp", "unknown verification rule"), (f"{d}@threshold:x", "needs a number"),
                          (f"{tmp_path / 'bare'}@dspark", "no confidence head")]:
        with pytest.raises(DsparkError, match=message):
            load_speculation(spec, target)
    with pytest.raises(DsparkError, match="exclude each other"):
        load_speculation(f"{d}@dspark", target, confidence_threshold=0.5)
    _, drafter, policy = load_speculation("none", target)
    assert drafter is None and policy.name == "ar"
