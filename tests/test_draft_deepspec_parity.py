"""DeepSpec DSpark checkpoints, both directions.

Checkpoints are written here in DeepSpec's exact layout (deepseek-ai/DeepSpec:
`deepspec/modeling/dspark/{qwen3/modeling.py, markov_head.py, common.py}`) for a tiny random Qwen3
target, and `deepspec_block` below recomputes what DeepSpec computes from them, formula by formula,
on HF transformers' hidden states. dspark must load them as they are and agree.
"""

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers import make_random_dspark, make_tiny_hf_model
from safetensors.torch import load_file, save_file

from dspark.decode.generate import Decoder
from dspark.draft.checkpoint import load_drafter_checkpoint, load_model, save_drafter
from dspark.draft.config import DraftConfig
from dspark.draft.dspark import DSparkModel
from dspark.draft.export import export_drafter
from dspark.errors import DsparkError
from dspark.model.loading import load_target
from dspark.sampling import SamplingParams

BLOCK, RANK, MASK = 4, 8, 3
# (name, markov_head_type or None for rank 0, confidence_head_with_markov or None without the head, taps)
OPTIONS = [
    ("gated", "gated", True, [0, 2]),
    ("rnn", "rnn", True, [1, 2]),
    ("confidence-on-h", "vanilla", False, [0, 1, 3]),  # 3: the last layer, after the final norm (HF)
    ("embedding-tap", "vanilla", True, [-1, 1, 2]),
    ("dflash", None, None, [0, 2]),
]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = make_tiny_hf_model("qwen3", tmp_path_factory.mktemp("qwen3") / "t", tie=False)
    return path, load_target(path, dtype=torch.float32, require_tokenizer=False)


def write_deepspec_checkpoint(target_dir, out, head, with_markov, taps, layers=2, seed=0):
    """A DeepSpec-layout checkpoint: config = the target's config + build_draft_config's fields,
    tensors named as Qwen3DSparkModel's state dict (embed_tokens / lm_head copies included)."""
    cfg = json.loads((target_dir / "config.json").read_text())
    H, V, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    nh, nkv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    cfg.update(architectures=["Qwen3DSparkModel"], num_target_layers=cfg["num_hidden_layers"], num_hidden_layers=layers,
               block_size=BLOCK, tie_word_embeddings=False, layer_types=["full_attention"] * layers,
               mask_token_id=MASK, target_layer_ids=taps, num_anchors=16,
               enable_confidence_head=with_markov is not None, markov_rank=RANK if head else 0)
    if with_markov is not None:
        cfg["confidence_head_with_markov"] = with_markov
    if head:
        cfg["markov_head_type"] = head
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: 0.15 * torch.randn(*shape, generator=g)  # noqa: E731
    norm = lambda n: 1.0 + 0.2 * torch.randn(n, generator=g)  # noqa: E731
    sd = {"fc.weight": rnd(H, len(taps) * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(layers):
        p = f"layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": rnd(nh * hd, H), p + "self_attn.k_proj.weight": rnd(nkv * hd, H),
                   p + "self_attn.v_proj.weight": rnd(nkv * hd, H), p + "self_attn.o_proj.weight": rnd(H, nh * hd),
                   p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
                   p + "mlp.gate_proj.weight": rnd(inter, H), p + "mlp.up_proj.weight": rnd(inter, H),
                   p + "mlp.down_proj.weight": rnd(H, inter), p + "input_layernorm.weight": norm(H),
                   p + "post_attention_layernorm.weight": norm(H)})
    if head:
        sd["markov_head.markov_w1.weight"] = rnd(V, RANK)
        sd["markov_head.markov_w2.weight"] = rnd(V, RANK)
    if head == "gated":
        sd["markov_head.gate_proj.weight"], sd["markov_head.gate_proj.bias"] = rnd(RANK, H + RANK), rnd(RANK)
    if head == "rnn":
        sd["markov_head.joint_proj.weight"], sd["markov_head.joint_proj.bias"] = rnd(3 * RANK, 2 * RANK + H), rnd(3 * RANK)
    if with_markov is not None:
        sd["confidence_head.proj.weight"] = rnd(1, H + (RANK if with_markov else 0))
        sd["confidence_head.proj.bias"] = rnd(1)
    target_sd = load_file(target_dir / "model.safetensors")
    sd["embed_tokens.weight"] = target_sd["model.embed_tokens.weight"].clone()
    sd["lm_head.weight"] = target_sd["lm_head.weight"].clone()
    out.mkdir(parents=True)
    save_file(sd, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg))
    return cfg, sd


def _rms(x, w, eps):  # Qwen3RMSNorm
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta, hd):  # rotate_half convention
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd))
    emb = torch.cat([pos[:, None].float() * inv] * 2, dim=-1)
    half = hd // 2
    return x * emb.cos() + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * emb.sin()


def deepspec_block(cfg, sd, hidden_states, anchor, prev):
    """DeepSpec's draft pass for one block [anchor, MASK...] after n context positions, then its heads
    teacher-forced with `prev` (slot k's previous token). Returns (base logits, corrected logits,
    confidence logits or None)."""
    eps, hd = cfg["rms_norm_eps"], cfg["head_dim"]
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]  # transformers 5 nests it
    nh, nkv, g = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["block_size"]
    feats = torch.cat([hidden_states[0 if i == -1 else i + 1][0] for i in cfg["target_layer_ids"]], dim=-1)
    ctx = _rms(feats @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)  # extract_context_feature -> fc -> norm
    n = ctx.shape[0]
    x = sd["embed_tokens.weight"][torch.tensor([anchor] + [cfg["mask_token_id"]] * (g - 1))]
    pos_q, pos_k = torch.arange(n, n + g), torch.arange(n + g)
    for i in range(cfg["num_hidden_layers"]):
        w = {k.removeprefix(f"layers.{i}."): v for k, v in sd.items() if k.startswith(f"layers.{i}.")}
        h = _rms(x, w["input_layernorm.weight"], eps)
        q = _rms((h @ w["self_attn.q_proj.weight"].T).view(g, nh, hd), w["self_attn.q_norm.weight"], eps)
        kv_in = torch.cat([ctx, h])
        k = _rms((kv_in @ w["self_attn.k_proj.weight"].T).view(n + g, nkv, hd), w["self_attn.k_norm.weight"], eps)
        v = (kv_in @ w["self_attn.v_proj.weight"].T).view(n + g, nkv, hd)
        q = _rope(q.transpose(0, 1), pos_q, theta, hd)
        k = _rope(k.transpose(0, 1), pos_k, theta, hd).repeat_interleave(nh // nkv, dim=0)
        v = v.transpose(0, 1).repeat_interleave(nh // nkv, dim=0)
        att = torch.softmax(q @ k.transpose(-1, -2) / hd**0.5, dim=-1) @ v  # no mask: all context, whole block
        x = x + att.transpose(0, 1).reshape(g, nh * hd) @ w["self_attn.o_proj.weight"].T
        h = _rms(x, w["post_attention_layernorm.weight"], eps)
        x = x + (F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    hid = _rms(x, sd["norm.weight"], eps)
    base = hid @ sd["lm_head.weight"].T
    head, rank = cfg.get("markov_head_type"), cfg["markov_rank"]
    corrected, e = base, None
    if rank > 0:
        e = sd["markov_head.markov_w1.weight"][torch.tensor(prev)]
        w2 = sd["markov_head.markov_w2.weight"]
        if head == "vanilla":
            corrected = base + e @ w2.T
        elif head == "gated":
            gate = torch.sigmoid(torch.cat([hid, e], -1) @ sd["markov_head.gate_proj.weight"].T + sd["markov_head.gate_proj.bias"])
            corrected = base + (gate * e) @ w2.T
        else:
            state, rows = torch.zeros(rank), []
            for k in range(g):
                z = torch.cat([state, e[k], hid[k]])
                gr, cr, orr = (sd["markov_head.joint_proj.weight"] @ z + sd["markov_head.joint_proj.bias"]).chunk(3)
                gt = torch.sigmoid(gr)
                state = gt * state + (1 - gt) * torch.tanh(cr)
                rows.append(base[k] + torch.tanh(orr) @ w2.T)
            corrected = torch.stack(rows)
    conf = None
    if cfg["enable_confidence_head"]:
        feats = torch.cat([hid, e], -1) if cfg["confidence_head_with_markov"] else hid
        conf = (feats @ sd["confidence_head.proj.weight"].T + sd["confidence_head.proj.bias"]).squeeze(-1)
    return base, corrected, conf


def _dspark_block(drafter, target, context, anchor, prev):
    out = target.model(torch.tensor([context]), target.model.new_cache(1, 64), taps=drafter.tap_layers)
    drafter.begin(context)
    drafter.observe(context, out.taps[0])
    h, base = drafter.block_outputs(anchor, drafter.block_size)
    forced = iter(prev[1:] + [0])
    _, corrected, conf = drafter.run_heads(h, base, anchor, lambda logits: [next(forced)] * logits.shape[0])
    return base, corrected, conf


@pytest.mark.parametrize("name, head, with_markov, taps", OPTIONS, ids=[o[0] for o in OPTIONS])
def test_deepspec_checkpoints_load_as_they_are_and_compute_what_deepspec_computes(qwen3, tmp_path, name, head,
                                                                                  with_markov, taps):
    path, target = qwen3
    cfg, sd = write_deepspec_checkpoint(path, tmp_path / "ds", head, with_markov, taps)
    drafter = load_drafter_checkpoint(tmp_path / "ds", target)
    context, anchor, prev = [5, 9, 17, 33, 2, 64, 11, 7, 90, 21], 42, [42, 8, 100, 5]
    hf = transformers.Qwen3ForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hidden_states = hf(torch.tensor([context]), output_hidden_states=True).hidden_states
        want = deepspec_block(cfg, sd, hidden_states, anchor, prev)
    got = _dspark_block(drafter, target, context, anchor, prev)
    for what, w, g in zip(("block logits", "Markov-corrected logits", "confidence logits"), want, got):
        if w is None:
            assert g is None, what
        else:
            torch.testing.assert_close(g.float(), w, atol=1e-5, rtol=1e-5, msg=f"{name}: {what}")

    # export writes exactly DeepSpec's layout back: the same tensor names and values, the same fields
    export_drafter(tmp_path / "ds", target, tmp_path / "x")
    exported = load_file(tmp_path / "x" / "model.safetensors")
    assert exported.keys() == sd.keys() and all(torch.equal(exported[k], sd[k]) for k in sd)
    xcfg = json.loads((tmp_path / "x" / "config.json").read_text())
    assert {k: xcfg.get(k) for k in cfg if xcfg.get(k) != cfg[k]} == {}
    again = load_model(tmp_path / "x", target)[0].state_dict()
    assert all(torch.equal(again[k], v) for k, v in drafter.model.state_dict().items())


@pytest.mark.parametrize("name, head, with_markov, taps", OPTIONS, ids=[o[0] for o in OPTIONS])
def test_every_deepspec_option_stays_lossless(qwen3, tmp_path, name, head, with_markov, taps):
    path, target = qwen3
    write_deepspec_checkpoint(path, tmp_path / "ds", head, with_markov, taps)
    drafter = load_drafter_checkpoint(tmp_path / "ds", target)
    greedy = SamplingParams(temperature=0.0)
    for prompt in ([5, 9, 17], [33, 2, 64, 11, 7, 90]):
        plain = Decoder(target).generate(prompt, 30, greedy).token_ids
        spec = Decoder(target, drafter).generate(prompt, 30, greedy)
        assert spec.token_ids == plain, name
        assert spec.stats.rounds < 30 or head is None  # a random drafter still gets some accepted


def _legacy_names(tensors):
    """dspark's first tensor names (before DeepSpec's were adopted) for a gated / RNN head."""
    out = {}
    for k, v in tensors.items():
        if ".gate_proj." in k and k.startswith("markov_head."):
            out[k.replace("gate_proj", "markov_gate")] = v
        elif k.startswith("markov_head.joint_proj."):
            for part, name in zip(v.chunk(3), ("gate", "cell", "out")):
                out[k.replace("joint_proj", f"rnn_{name}")] = part
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("head", ["gated", "rnn"])
def test_checkpoints_with_dspark_s_first_head_names_still_load(qwen3, tmp_path, head):
    _, target = qwen3
    drafter = make_random_dspark(target, head, block_size=BLOCK)
    save_drafter(drafter.model, tmp_path / "d", target=target)
    tensors = load_file(tmp_path / "d" / "model.safetensors")
    save_file(_legacy_names(tensors), tmp_path / "d" / "model.safetensors")
    loaded = load_model(tmp_path / "d", target)[0].state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in drafter.model.state_dict().items())


def test_llama_target_drafters_use_qwen3_layers_and_export_for_deepspec_engines(tiny_targets, tmp_path):
    target = load_target(dict(tiny_targets)["llama-untied"], dtype=torch.float32, require_tokenizer=False)
    drafter = make_random_dspark(target, "vanilla", block_size=BLOCK)
    save_drafter(drafter.model, tmp_path / "d", target=target)
    export_drafter(tmp_path / "d", target, tmp_path / "x")
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"  # what vLLM resolves
    assert cfg["dspark_target_model_type"] == "llama" and cfg["num_target_layers"] == 4
    assert cfg["target_layer_ids"] == drafter.cfg.target_layer_ids and not cfg["tie_word_embeddings"]
    tensors = load_file(tmp_path / "x" / "model.safetensors")
    assert "layers.0.self_attn.q_norm.weight" in tensors and "layers.0.self_attn.k_norm.weight" in tensors
    loaded = load_model(tmp_path / "x", target)[0]
    assert loaded.cfg.target.family == "llama" and loaded.cfg.draft_layer == "qwen3"
    with pytest.raises(DsparkError, match="qwen3"):  # a Llama-target drafter is not a Qwen3 target's
        load_model(tmp_path / "x", load_target(dict(tiny_targets)["qwen3-tied"], dtype=torch.float32,
                                               require_tokenizer=False))

    export_drafter(tmp_path / "d", target, tmp_path / "s", layout="speculators")
    spec = json.loads((tmp_path / "s" / "config.json").read_text())
    assert spec["speculators_model_type"] == "dspark" and spec["sample_from_anchor"]
    assert spec["aux_hidden_state_layer_ids"] == [i + 1 for i in drafter.cfg.target_layer_ids]
    assert "embed_tokens.weight" not in load_file(tmp_path / "s" / "model.safetensors")

    # dspark's first drafters had the target's own layer shape: they load, but cannot be exported
    legacy_cfg = DraftConfig(target=target.cfg, target_layer_ids=[1, 2], block_size=BLOCK, markov_rank=RANK,
                             mask_token_id=MASK, draft_layer="target")
    save_drafter(DSparkModel(legacy_cfg), tmp_path / "legacy", target=target)
    assert json.loads((tmp_path / "legacy" / "config.json").read_text())["architectures"] == ["LlamaDSparkModel"]
    legacy = load_model(tmp_path / "legacy", target)[0]
    assert legacy.cfg.draft_layer == "target" and legacy.layers[0].self_attn.q_norm is None
    with pytest.raises(DsparkError, match="no q/k norms"):
        export_drafter(tmp_path / "legacy", target, tmp_path / "y")
    assert not (tmp_path / "y").exists()
