"""Drafter checkpoints: a directory with `config.json` + `model.safetensors` (DESIGN.md §8).

The target's embedding and LM head are never stored (the drafter shares the target's), except by
an export (`export.py`), which adds the copies DeepSpec-style tools expect. Loading accepts those
copies and drops them. Every load validates the drafter against the target it is meant to serve.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dspark.draft import vocab
from dspark.draft.config import LAYERWISE_TAPS, DraftConfig, default_tap_layers
from dspark.draft.dspark import DSparkDrafter, DSparkModel
from dspark.draft.heads import upgrade_legacy_names
from dspark.errors import DsparkError
from dspark.model.target import Target
from dspark.util.files import atomic_directory, atomic_write_text

WEIGHTS = "model.safetensors"
SHARED_TENSORS = ("embed_tokens.weight", "lm_head.weight")  # the target's, written only on export
_PROBE_ROWS = 16


def target_probe(target_model) -> list[float]:
    """L2 norms of a few rows of the shared embedding and LM head: tells one target's weights from
    another's of the same shape, whatever the dtype they were loaded in."""
    rows = torch.linspace(0, target_model.cfg.vocab_size - 1, _PROBE_ROWS, device=target_model.device).long()
    norms = torch.cat([w[rows].float().norm(dim=-1) for w in (target_model.embed_tokens, target_model.lm_head)])
    return [float(f"{x:.6g}") for x in norms.tolist()]


def default_mask_token_id(target: Target) -> int:
    """A token the target never produces: an unused embedding row if there is one, else the
    highest-id added special token that is not BOS/EOS/PAD or a chat-template marker (for SmolLM2:
    `<empty_output>`)."""
    vocab = target.cfg.vocab_size
    tok = target.tokenizer
    if tok is None:
        return vocab - 1
    if len(tok) < vocab:
        return len(tok)
    reserved = set(target.eos_token_ids) | {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}
    for text in ("<|im_start|>", "<|im_end|>"):  # chat-template tokens are produced in chats
        reserved.add(tok.convert_tokens_to_ids(text))
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    candidates = [i for i in special if i not in reserved and 0 <= i < vocab]
    if not candidates:
        raise DsparkError("cannot pick a mask token for this target: pass --mask-token-id")
    return max(candidates)


def new_draft_config(target: Target, **options) -> DraftConfig:
    """A drafter config for `target`; unset options get defaults (5 spread taps for DSpark, 9 with
    layer-wise fusion, 3 for EAGLE-3's low/mid/high features, an unused mask token)."""
    opts = {k: v for k, v in options.items() if v is not None}
    if opts.get("kind") == "eagle3":
        opts.update(markov_head_type="none", enable_confidence_head=False, num_hidden_layers=1)
    count = 3 if opts.get("kind") == "eagle3" else LAYERWISE_TAPS if opts.get("context_fusion") == "layerwise" else 5
    opts.setdefault("target_layer_ids", default_tap_layers(target.cfg.num_hidden_layers, count))
    opts.setdefault("mask_token_id", default_mask_token_id(target))
    return DraftConfig(target=target.cfg, **opts)


def write_checkpoint_dir(out: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    with atomic_directory(out) as tmp:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, tmp / WEIGHTS, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_drafter(
    model: DSparkModel, out: str | Path, target: Target | None = None, dtype: torch.dtype | None = None, extra: dict | None = None
) -> Path:
    """Save `model` (weights in `dtype`, default: as they are) to the directory `out`.

    `target` (optional) records a probe of its weights so that loading against another target
    with the same shapes still fails; `extra` adds fields to config.json (e.g. calibration)."""
    config = model.cfg.to_dict()
    config["torch_dtype"] = str(dtype or model.dtype).removeprefix("torch.")
    if target is not None:
        config["dspark_target_probe"] = target_probe(target.model)
    config.update(extra or {})
    # only weights take `dtype`: the draft vocabulary's index maps (d2t / t2d) keep theirs
    tensors = {k: (v.to(dtype) if dtype and v.is_floating_point() else v).cpu() for k, v in model.state_dict().items()}
    write_checkpoint_dir(Path(out), config, tensors)
    return Path(out)


def read_config(path: str | Path) -> dict:
    path = Path(path).expanduser()
    if not path.is_dir():
        raise DsparkError(f"drafter checkpoint {path} does not exist or is not a directory")
    try:
        return json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise DsparkError(f"{path} is not a drafter checkpoint directory (no config.json)") from None
    except json.JSONDecodeError as e:
        raise DsparkError(f"{path / 'config.json'} is not valid JSON: {e}") from None


def target_mismatches(cfg: DraftConfig, raw: dict, target: Target) -> list[str]:
    """Why a drafter (its config and raw config.json) does not fit `target`; [] when it does."""
    t, d = target.cfg, cfg.target
    problems = [
        f"{name} {mine} vs the target's {theirs}"
        for name, mine, theirs in [
            ("hidden size", d.hidden_size, t.hidden_size),
            ("vocabulary size", d.vocab_size, t.vocab_size),
            ("number of target layers", d.num_hidden_layers, t.num_hidden_layers),
            ("model family", d.family, t.family),
        ]
        if mine != theirs
    ]
    bad_taps = [i for i in cfg.target_layer_ids if i >= t.num_hidden_layers]
    if bad_taps:
        problems.append(f"tapped layers {bad_taps} do not exist in the {t.num_hidden_layers}-layer target")
    probe = raw.get("dspark_target_probe")
    if not problems and probe is not None:
        mine = torch.tensor(probe)
        theirs = torch.tensor(target_probe(target.model))
        if mine.shape != theirs.shape or not torch.allclose(mine, theirs, rtol=1e-2, atol=1e-4):
            problems.append("its embedding / LM-head probe differs (same shapes, different weights)")
    return problems


def check_against_target(cfg: DraftConfig, raw: dict, target: Target, path: Path) -> None:
    """Fail clearly when the drafter was made for another target."""
    problems = target_mismatches(cfg, raw, target)
    if problems:
        raise DsparkError(
            f"drafter {path} was made for a different target than {target.path}: {'; '.join(problems)}. "
            "Use the target it was trained for (--model), or train/init a drafter for this one."
        )


def new_model(cfg: DraftConfig):
    """An initialised drafter model of the config's kind."""
    if cfg.kind == "eagle3":
        from dspark.draft.eagle3 import Eagle3Model

        return Eagle3Model(cfg)
    return DSparkModel(cfg)


def init_from_target(model, target: Target, copy_layers: bool = False) -> None:
    """Start a new drafter from the target's weights where the shapes are the target's own.

    The final norm takes the target's gains: the shared LM head reads hidden states through them
    (SmolLM2's span -2.1 to 3.3), and from ones Adam would need thousands of steps to learn them.
    With `copy_layers`, the n draft layers start as copies of the target's last n layers (every
    tensor of the same name and shape: all of a DSpark layer; EAGLE-3's, whose q/k/v read twice
    the width, keep their random q/k/v), so training starts from trained maps rather than noise."""
    with torch.no_grad():
        model.norm.weight.copy_(target.model.norm.to(model.norm.weight.dtype))
        if not copy_layers:
            return
        from dspark.model.loading import read_state_dict

        source = read_state_dict(target.path)
        first = target.cfg.num_hidden_layers - len(model.layers)
        for i, layer in enumerate(model.layers):
            for name, p in layer.named_parameters():
                w = source.get(f"model.layers.{first + i}.{name}")
                if w is not None and w.shape == p.shape:
                    p.copy_(w.to(p.dtype))


def wrap_drafter(model, target: Target, num_draft_tokens: int | None = None):
    """The inference-side Drafter for a drafter model."""
    if model.cfg.kind == "eagle3":
        from dspark.draft.eagle3 import Eagle3Drafter

        return Eagle3Drafter(model, target, num_draft_tokens)
    return DSparkDrafter(model, target, num_draft_tokens)


def load_model(path: str | Path, target: Target) -> tuple[DSparkModel, dict]:
    """Load and validate a drafter checkpoint for `target`; returns the model (in the target's
    dtype and device) and the raw config dict."""
    path = Path(path).expanduser()
    raw = read_config(path)
    cfg = DraftConfig.from_dict(raw)
    check_against_target(cfg, raw, target, path)
    try:
        tensors = load_file(path / WEIGHTS)
    except FileNotFoundError:
        raise DsparkError(f"{path} has no {WEIGHTS}") from None
    except SafetensorError as e:
        raise DsparkError(f"{path / WEIGHTS} is not a readable safetensors file: {e}") from None
    for name in SHARED_TENSORS:
        tensors.pop(name, None)
    tensors = upgrade_legacy_names(tensors)
    model = new_model(cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [f"{k} {tuple(tensors[k].shape)} (expected {tuple(v.shape)})" for k, v in expected.items()
             if k in tensors and tensors[k].shape != v.shape]
    if missing or unexpected or wrong:
        detail = "; ".join(
            f"{what}: {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}"
            for what, items in [("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)]
            if items
        )
        raise DsparkError(f"{path / WEIGHTS} does not match its config.json ({detail})")
    model.load_state_dict(tensors)
    if cfg.draft_vocab_size:
        ids = model.draft_ids
        vocab.check_ids(ids, cfg.target.vocab_size)
        if not torch.equal(model.t2d, vocab.to_t2d(ids, cfg.target.vocab_size)):
            raise DsparkError(f"{path / WEIGHTS}: t2d and d2t name different draft vocabularies; the checkpoint is damaged")
    model.to(device=target.model.device, dtype=target.model.dtype)
    model.requires_grad_(False)
    return model, raw


def load_drafter_checkpoint(path: str | Path, target: Target, num_draft_tokens: int | None = None):
    """A ready Drafter (DSpark / DFlash / EAGLE-3) from a checkpoint directory, with its calibration
    temperatures."""
    model, raw = load_model(path, target)
    g = model.cfg.block_size
    if num_draft_tokens is not None and num_draft_tokens > g:
        raise DsparkError(f"--num-draft-tokens {num_draft_tokens} exceeds the drafter's block size {g}")
    drafter = wrap_drafter(model, target, num_draft_tokens)
    temps = raw.get("confidence_temperatures")
    if temps is not None:
        drafter.temperatures = [float(t) for t in temps]
    return drafter


def write_temperatures(path: str | Path, temperatures: list[float]) -> None:
    """Store calibration temperatures in a checkpoint's config.json (atomic replace)."""
    path = Path(path).expanduser()
    raw = read_config(path)
    raw["confidence_temperatures"] = [round(float(t), 6) for t in temperatures]
    atomic_write_text(path / "config.json", json.dumps(raw, indent=2) + "\n")


def convert_drafter(path: str | Path, target: Target, out: str | Path, dtype: torch.dtype) -> Path:
    """Copy a checkpoint to `out` with its weights in `dtype` (config and calibration kept)."""
    path = Path(path).expanduser()
    load_model(path, target)  # validates
    raw = dict(read_config(path), torch_dtype=str(dtype).removeprefix("torch."))
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(path / WEIGHTS).items()}
    write_checkpoint_dir(Path(out), raw, tensors)
    return Path(out)
