"""A DSpark drafter as a GGUF file that llama.cpp runs as a speculative draft
(`--spec-type draft-dspark -md DRAFT.gguf`), written with the `gguf` package.

The layout is the one llama.cpp's own converter (`convert_hf_to_gguf.py`, `Qwen3DSparkModel`) writes:
architecture `dflash`, one-dimensional tensors in F32, the target's token embedding, the K-row LM head
and `d2t` as absolute target ids for a reduced draft vocabulary (the target's head serves a full one),
and the target's tokenizer (copied from the target's GGUF) with the mask token. llama.cpp runs only the
vanilla Markov head, with the confidence head reading the Markov embedding.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import gguf
import numpy as np
import torch

from dspark.draft.config import DraftConfig
from dspark.draft.export import exportable, shared_copies
from dspark.errors import DsparkError
from dspark.model.gguf_file import read_gguf
from dspark.model.target import Target

ARCH = "dflash"
FILE_TYPES = {torch.float32: gguf.LlamaFileType.ALL_F32, torch.float16: gguf.LlamaFileType.MOSTLY_F16,
              torch.bfloat16: gguf.LlamaFileType.MOSTLY_BF16}
_LAYER_NAMES = {  # DeepSpec name inside `layers.{i}.` -> llama.cpp's inside `blk.{i}.`
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {
    "fc": "fc", "hidden_norm": "enc.output_norm", "norm": "output_norm", "embed_tokens": "token_embd",
    "lm_head": "output", "markov_head.markov_w1": "markov_w1", "markov_head.markov_w2": "markov_w2",
    "confidence_head.proj": "conf_proj",
}


@dataclasses.dataclass
class GgufExport:
    path: Path
    tensors: int
    temperatures: list[float] | None  # STS calibration, which llama.cpp does not apply
    spec_type: str  # llama.cpp's --spec-type for it: draft-dspark, or draft-dflash without a Markov head


def gguf_name(name: str) -> str:
    """llama.cpp's name of a DeepSpec-layout tensor."""
    stem, kind = name.rsplit(".", 1)
    if stem.startswith("layers."):
        _, i, part = stem.split(".", 2)
        return f"blk.{i}.{_LAYER_NAMES[part]}.{kind}"
    return f"{_TOP_NAMES[stem]}.{kind}"


def export_gguf(path: str | Path, target: Target, tokenizer_gguf: Path, out: str | Path,
                dtype: torch.dtype | None = None) -> GgufExport:
    """Write the drafter at `path` to the GGUF file `out`, matrices in `dtype` (default: the checkpoint's),
    with the tokenizer of `tokenizer_gguf` (the target's own GGUF file)."""
    path = Path(path).expanduser()
    model, raw, tensors = exportable(path, target)
    cfg = model.cfg
    _check_llama_cpp_runs(path, cfg)
    tensors.pop("t2d", None)  # not read at run time
    dtype = dtype or tensors["fc.weight"].dtype
    if dtype not in FILE_TYPES:
        raise DsparkError(f"a GGUF export takes float32, float16 or bfloat16 weights, not {dtype}")
    tensors.update(shared_copies(model, target, dtype))
    d2t = tensors.pop("d2t", None)
    if d2t is None:
        tensors.pop("lm_head.weight")  # a full vocabulary: llama.cpp reads the target's own head
    source = read_gguf(tokenizer_gguf, "; pass the target's GGUF file with --model")
    out = Path(out).expanduser()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), ARCH)
    _write_metadata(writer, cfg, path.name, FILE_TYPES[dtype])
    _copy_tokenizer(writer, source, cfg)
    for name, t in sorted(tensors.items()):
        _add_tensor(writer, gguf_name(name), t, dtype)
    if d2t is not None:  # absolute target ids, as llama.cpp's converter writes them
        ids = (d2t.long() + torch.arange(d2t.numel())).numpy()
        writer.add_tensor("d2t", ids.astype(np.int64), raw_dtype=gguf.GGMLQuantizationType.I64)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return GgufExport(out, len(tensors) + (d2t is not None), raw.get("confidence_temperatures"),
                      "draft-dspark" if cfg.has_sequential_head else "draft-dflash")


def _check_llama_cpp_runs(path: Path, cfg: DraftConfig) -> None:
    if cfg.has_sequential_head and cfg.markov_head_type != "vanilla":
        raise DsparkError(f"{path} has a {cfg.markov_head_type} Markov head; llama.cpp runs the vanilla one only")
    if cfg.enable_confidence_head and not (cfg.has_sequential_head and cfg.confidence_head_with_markov):
        raise DsparkError(f"{path}'s confidence head does not read the Markov embedding, which llama.cpp's does")


def _write_metadata(writer: gguf.GGUFWriter, cfg: DraftConfig, name: str, file_type: gguf.LlamaFileType) -> None:
    t = cfg.target
    writer.add_type("model")
    writer.add_name(name)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(t.max_position_embeddings)
    writer.add_embedding_length(t.hidden_size)
    writer.add_feed_forward_length(t.intermediate_size)
    writer.add_head_count(t.num_attention_heads)
    writer.add_head_count_kv(t.num_key_value_heads)
    writer.add_rope_freq_base(t.rope_theta)
    writer.add_layer_norm_rms_eps(t.rms_norm_eps)
    writer.add_key_length(t.head_dim)
    writer.add_value_length(t.head_dim)
    writer.add_file_type(file_type)
    writer.add_uint32(f"{ARCH}.block_size", cfg.block_size)
    writer.add_array(f"{ARCH}.target_layers", [i + 1 for i in cfg.target_layer_ids])  # hidden-state indices
    writer.add_bool(f"{ARCH}.sample_from_anchor", True)  # slot 0 is the anchor and predicts the next token
    writer.add_bool(f"{ARCH}.has_confidence_head", cfg.enable_confidence_head)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _copy_tokenizer(writer: gguf.GGUFWriter, source: gguf.GGUFReader, cfg: DraftConfig) -> None:
    """The target's `tokenizer.*` fields as they are (llama.cpp checks that draft and target vocabularies
    agree), plus the mask token."""
    tokens = source.fields.get("tokenizer.ggml.tokens")
    if tokens is None or len(tokens.data) != cfg.target.vocab_size:
        raise DsparkError(f"the tokenizer GGUF has {0 if tokens is None else len(tokens.data)} tokens, the target "
                          f"{cfg.target.vocab_size}; pass the target's own GGUF file with --model")
    for key, field in source.fields.items():
        if key.startswith("tokenizer.") and key != "tokenizer.ggml.mask_token_id":
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    writer.add_mask_token_id(cfg.mask_token_id)


def _add_tensor(writer: gguf.GGUFWriter, name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """One-dimensional tensors (norms, biases) in F32 as llama.cpp's converter writes them; matrices in `dtype`."""
    t = t.detach().cpu()
    if t.dim() == 1 or dtype == torch.float32:
        writer.add_tensor(name, t.float().numpy())
    elif dtype == torch.float16:
        writer.add_tensor(name, t.half().numpy())
    else:
        bits = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
        writer.add_tensor(name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)


def p_min_table(temperatures: list[float], levels=(0.3, 0.5, 0.7)) -> list[tuple[float, list[float]]]:
    """llama.cpp's --spec-draft-p-min thresholds each slot's raw confidence σ(z_k); dspark's calibrated
    one is σ(z_k / T_k). (level c, the raw threshold σ(T_k · logit c) per block position) for each c."""
    def raw(c: float, t: float) -> float:
        return 1.0 / (1.0 + math.exp(-t * math.log(c / (1.0 - c))))

    return [(c, [raw(c, t) for t in temperatures]) for c in levels]
