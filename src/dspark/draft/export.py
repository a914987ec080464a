"""A drafter in other tools' layouts: DeepSpec's (what vLLM and DeepSpec load), the `speculators`
package's, and GGUF (what llama.cpp runs as `--spec-type draft-dspark`, `export_gguf.py`)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from dspark.draft.checkpoint import SHARED_TENSORS, WEIGHTS, load_model, write_checkpoint_dir
from dspark.draft.config import DraftConfig
from dspark.draft.dspark import DSparkModel
from dspark.draft.heads import upgrade_legacy_names
from dspark.errors import DsparkError
from dspark.model.target import Target

EXPORT_LAYOUTS = ("deepspec", "speculators")
_DSPARK_FIELDS = ("architectures", "model_type", "attention_bias", "layer_types", "block_size", "mask_token_id",
                  "target_layer_ids", "num_target_layers", "num_hidden_layers", "markov_rank", "markov_head_type",
                  "enable_confidence_head", "confidence_head_with_markov", "num_anchors", "dspark_target_model_type")


def _deepspec_config(raw: dict, cfg: DraftConfig) -> dict:
    """config.json as DeepSpec's `build_draft_config` writes it (dspark's own fields kept beside)."""
    canonical = cfg.to_dict()  # Qwen3DSparkModel, model_type qwen3, layer_types, ... (DFlash mode included)
    d = {**canonical, **raw}  # the checkpoint's own values first (a DeepSpec config stays as it was)
    d.update({k: canonical[k] for k in _DSPARK_FIELDS if k in canonical}, tie_word_embeddings=False)
    if not cfg.has_sequential_head:
        d.pop("markov_head_type", None)
    if not cfg.enable_confidence_head:
        d.pop("confidence_head_with_markov", None)  # DeepSpec writes it only with the head
    return d


def _speculators_config(raw: dict, cfg: DraftConfig, target: Target) -> dict:
    """config.json in the `speculators` package's DSpark layout: the draft layer as a Qwen3 config,
    tapped layers as hidden-state indices (layer id + 1; the embedding output is 0), the verifier named."""
    layer_keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "rope_theta", "rms_norm_eps", "max_position_embeddings", "hidden_act", "attention_bias",
                  "bos_token_id", "eos_token_id", "layer_types")
    layer = {k: raw[k] for k in layer_keys if k in raw}
    layer.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], num_hidden_layers=cfg.num_hidden_layers,
                 tie_word_embeddings=False)
    verifier = target.cfg.to_hf_dict()
    return {
        "speculators_model_type": "dspark",
        "architectures": ["DSparkSpeculator"],
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size or cfg.target.vocab_size,
        "block_size": cfg.block_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id,
        "sample_from_anchor": True,  # slot 0 is the anchor and predicts the next token (DeepSpec)
        "markov_rank": cfg.head_rank,
        "markov_head_type": cfg.markov_head_type if cfg.has_sequential_head else "vanilla",
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": cfg.confidence_head_with_markov,
        "speculators_config": {
            "algorithm": "dspark",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(target.path), "architectures": verifier["architectures"]},
        },
        "torch_dtype": raw.get("torch_dtype", "float32"),
        **{k: raw[k] for k in ("dspark_target_model_type", "dspark_target_probe", "confidence_temperatures") if k in raw},
    }


def shared_copies(model: DSparkModel, target: Target, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The target's embedding and LM head as DeepSpec-style tools expect them beside a drafter, in the
    drafter's float `dtype`: the LM head as the K rows of a reduced draft vocabulary (target ids
    d2t + arange(K), EAGLE-3's convention, which vLLM and llama.cpp read), all V rows otherwise."""
    head = target.model.lm_head.detach()
    ids = model.draft_ids
    return {"embed_tokens.weight": target.model.embed_tokens.detach().to(dtype).clone(),
            "lm_head.weight": (head if ids is None else head[ids.to(head.device)]).to(dtype).clone()}  # a copy even when tied


def exportable(path: Path, target: Target) -> tuple[DSparkModel, dict, dict[str, torch.Tensor]]:
    """(model, raw config, stored tensors without the shared copies) of a checkpoint other tools can load."""
    model, raw = load_model(path, target)  # validates against the target
    check_exportable(path, model.cfg)
    tensors = upgrade_legacy_names(load_file(path / WEIGHTS))
    for name in SHARED_TENSORS:
        tensors.pop(name, None)
    return model, raw, tensors


def check_exportable(path: Path, cfg: DraftConfig) -> None:
    """Other tools run DSpark / DFlash drafters with Qwen3-style draft layers only."""
    if cfg.kind == "eagle3":
        raise DsparkError(f"{path} is an EAGLE-3 drafter: only DSpark / DFlash drafters have a DeepSpec layout")
    if cfg.draft_layer != "qwen3":
        raise DsparkError(
            f"{path} has {cfg.target.family}-style draft layers (no q/k norms): DeepSpec, vLLM, speculators and "
            "llama.cpp load only Qwen3-style DSpark / DFlash layers. Train a drafter made by `dspark draft init` "
            "(Qwen3-style layers by default) to export it."
        )
    if cfg.layerwise_fusion:
        raise DsparkError(
            f"{path} fuses the target's features layer by layer (context_fusion = {cfg.context_fusion}, DFlare's "
            "form): DeepSpec, vLLM, speculators and llama.cpp load only the shared `fc` projection. Use the drafter "
            "with dspark itself, or train one with the shared fusion (the default) to export it."
        )


def export_drafter(path: str | Path, target: Target, out: str | Path, layout: str = "deepspec") -> Path:
    """Copy a checkpoint to `out` in another tool's layout.

    deepspec: DeepSpec's own (what vLLM's `Qwen3DSparkModel` loads): the same tensors plus copies of
    the target's embedding and LM head. speculators: the `speculators` package's DSpark layout (the
    verifier's embedding and LM head are reloaded from the target's directory, not stored)."""
    if layout not in EXPORT_LAYOUTS:
        raise DsparkError(f"unknown export layout {layout!r}; choose one of {', '.join(EXPORT_LAYOUTS)}")
    model, raw, tensors = exportable(Path(path).expanduser(), target)
    if layout == "deepspec":
        config = _deepspec_config(raw, model.cfg)
        tensors.update(shared_copies(model, target, tensors["fc.weight"].dtype))
    else:
        config = _speculators_config(raw, model.cfg, target)
    write_checkpoint_dir(Path(out), config, tensors)
    return Path(out)
