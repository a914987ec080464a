"""A training run's resume checkpoint: OUT/checkpoint/ holds the drafter, AdamW's moments and the
step, replaced atomically; resuming refuses a changed configuration or changed data."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspark.draft.checkpoint import load_model, save_drafter
from dspark.errors import DsparkError
from dspark.model.target import Target
from dspark.train.config import CHECKPOINT_DTYPES, TrainConfig
from dspark.util.files import atomic_directory

# Options a resumed run may change; anything else must match the checkpoint.
RESUMABLE_CHANGES = {"compile_loss", "steps", "checkpoint_every", "eval_every", "threads", "out", "device", "anchor_chunk",
                     "val_data", "val_max_samples", "checkpoint_dtype"}
# what runs saved before an option existed had
ADDED_OPTIONS = {"draft_layer": "target", "confidence_head_with_markov": True, "draft_vocab_size": 0, "anchor_chunk": 64,
                 "val_data": "", "checkpoint_dtype": "float32", "loss": "auto", "context_fusion": "shared",
                 "conf_into_backbone": True, "target_dtype": "float32"}


def save_checkpoint(path: Path, cfg: TrainConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    target: Target, state: dict) -> None:
    """The drafter, the optimiser's moments (in cfg.checkpoint_dtype) and `state` (step, config, ...)."""
    dtype = CHECKPOINT_DTYPES[cfg.checkpoint_dtype]
    with atomic_directory(path) as tmp:
        save_drafter(model, tmp / "drafter", target=target, dtype=dtype)
        tensors = {}
        for i, p in enumerate(model.parameters()):
            for k, v in optimizer.state.get(p, {}).items():
                v = torch.as_tensor(v).detach().cpu()
                # moments in the checkpoint's dtype; AdamW's 0-dim step counter stays as it is
                tensors[f"{i}.{k}"] = v.to(dtype) if v.dim() else v.clone()
        save_file(tensors, tmp / "optimizer.safetensors")
        (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")


def load_checkpoint(path: Path, cfg: TrainConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    target: Target, fingerprint: str) -> int:
    """Restore `model` and `optimizer` from `path` after checking that `cfg` and the data (its
    `fingerprint`) are the run's; returns the step to continue from."""
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DsparkError(f"{path} is not a readable training checkpoint: {e}") from None
    _check_resumable(path, cfg, state, fingerprint)
    saved, _ = load_model(path / "drafter", target)
    model.load_state_dict(saved.state_dict())
    tensors = load_file(path / "optimizer.safetensors")
    for i, p in enumerate(model.parameters()):
        # moments go to the parameter's device and dtype; AdamW keeps its 0-dim step counter on the CPU
        entry = {k.split(".", 1)[1]: v.to(p.device, p.dtype) if v.dim() else v
                 for k, v in tensors.items() if k.split(".", 1)[0] == str(i)}
        if entry:
            optimizer.state[p] = entry
    return int(state["step"])


def _check_resumable(path: Path, cfg: TrainConfig, state: dict, fingerprint: str) -> None:
    saved = {**ADDED_OPTIONS, **state["config"]}
    ignored = RESUMABLE_CHANGES | ({"draft_layer", "confidence_head_with_markov"} if cfg.algorithm == "eagle3" else set())
    diff = [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in cfg.to_dict().items() if k not in ignored and saved.get(k) != v]
    if diff:
        raise DsparkError(f"cannot resume {path}: the configuration changed ({'; '.join(diff)}); set the "
                          "options back (e.g. --set draft_layer=target for a run begun before dspark used "
                          "DeepSpec's draft layer) or start a new run")
    if state.get("data_fingerprint") not in (None, fingerprint):
        raise DsparkError(f"cannot resume {path}: {', '.join(cfg.data_paths)} changed since the checkpoint (different "
                          "samples would be drawn); restore the file or start a new run")
