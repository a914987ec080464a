"""GGUF files: reading them, and dequantising one once into a plain HF-style directory.

The directory (config.json, model.safetensors, tokenizer files) lives under the user cache; every later
start loads it directly. llama-family files store the Q / K projection rows permuted for llama.cpp's
RoPE layout: `unpermute_qk` undoes it (the logit-match test against HF catches a mistake).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from dspark.errors import DsparkError
from dspark.model.config import TargetConfig
from dspark.util.cache import cache_root
from dspark.util.files import atomic_directory, atomic_write_text

GGUF_FAMILIES = ("llama", "qwen2", "qwen3")


def _gguf_fingerprint(path: Path) -> str:
    h = hashlib.sha256()
    st = path.stat()
    h.update(f"{path.name}:{st.st_size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, st.st_size - (1 << 20)))
        h.update(f.read())
    return h.hexdigest()[:16]


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-RoPE row permutation of Q/K weights (llama family only)."""
    out, inp = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, inp).transpose(1, 2).reshape(out, inp)


_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def read_gguf(path: Path, hint: str = ""):
    """A `gguf.GGUFReader` of `path`, or a clear error for a corrupt or non-GGUF file (`hint`: how to fix)."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # corrupt or not GGUF at all
        raise DsparkError(f"cannot read {path} as GGUF: {e}{hint}") from None


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """Where a tensor's data lies in a GGUF file, and how it is stored."""

    kind: str  # the GGML type's name: Q4_1, Q8_0, F32, ...
    shape: tuple[int, ...]  # as GGUF lists it, innermost first
    offset: int  # of its data, in bytes from the file's start
    nbytes: int

    def raw(self, path: Path) -> np.ndarray:
        """The stored bytes (a read-only map of the file)."""
        return np.memmap(path, dtype=np.uint8, mode="r", offset=self.offset, shape=(self.nbytes,))


def stored_tensors(gguf_path: Path) -> dict[str, StoredTensor]:
    """Every tensor of `gguf_path` by name, indexed once under the cache: gguf-py parses the whole header,
    the tokenizer's vocabulary included (~5 s for SmolLM2), to find them."""
    index = cache_root() / "gguf-index" / f"{gguf_path.stem}-{_gguf_fingerprint(gguf_path)}.json"
    try:
        return {name: StoredTensor(kind, tuple(shape), offset, nbytes)
                for name, (kind, shape, offset, nbytes) in json.loads(index.read_text()).items()}
    except (OSError, ValueError, TypeError):  # none yet, or cut short: (re)built below
        pass
    table = {t.name: StoredTensor(t.tensor_type.name, tuple(int(d) for d in t.shape), int(t.data_offset),
                                  int(t.n_bytes)) for t in read_gguf(gguf_path).tensors}
    index.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(index, json.dumps({n: [t.kind, list(t.shape), t.offset, t.nbytes] for n, t in table.items()}))
    return table


def gguf_to_hf_dir(gguf_path: Path) -> Path:
    """The GGUF file dequantised to fp32 safetensors + config + tokenizer, once, under the cache."""
    out = cache_root() / "models" / f"{gguf_path.stem}-{_gguf_fingerprint(gguf_path)}"
    if (out / "model.safetensors").is_file():
        return out
    from transformers import AutoTokenizer

    reader = read_gguf(gguf_path)
    cfg = _gguf_config(reader)
    sd = _gguf_state_dict(reader, gguf_path, cfg)
    with atomic_directory(out) as tmp:
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": gguf_path.name})
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
        AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(tmp))
    return out


def _gguf_config(reader) -> TargetConfig:
    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in GGUF_FAMILIES:
        raise DsparkError(f"GGUF architecture {arch!r} is not supported; dspark supports {list(GGUF_FAMILIES)}")
    n_head = field(f"{arch}.attention.head_count")
    hidden = field(f"{arch}.embedding_length")
    eos = field("tokenizer.ggml.eos_token_id")
    return TargetConfig(
        family=arch,
        vocab_size=field(f"{arch}.vocab_size") or len(field("tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=field(f"{arch}.feed_forward_length"),
        num_hidden_layers=field(f"{arch}.block_count"),
        num_attention_heads=n_head,
        num_key_value_heads=field(f"{arch}.attention.head_count_kv", n_head),
        head_dim=field(f"{arch}.attention.key_length", hidden // n_head),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=field(f"{arch}.context_length", 4096),
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
    )


def _gguf_state_dict(reader, gguf_path: Path, cfg: TargetConfig) -> dict[str, torch.Tensor]:
    """HF-named fp32 tensors; llama's Q / K rows are un-permuted from llama.cpp's RoPE layout."""
    import gguf
    from tqdm import tqdm

    sd = {}
    for t in tqdm(reader.tensors, desc=f"dequantising {gguf_path.name} (once)", unit="tensor", leave=False,
                  disable=None):  # None: shown on a terminal only (one-time, a few seconds)
        stem, kind = t.name.rsplit(".", 1)  # kind: weight | bias
        if stem in _GGUF_TOP_NAMES:
            name = f"{_GGUF_TOP_NAMES[stem]}.{kind}"
        else:
            _, i, part = stem.split(".", 2)
            if part not in _GGUF_LAYER_NAMES:
                raise DsparkError(f"unexpected tensor {t.name!r} in GGUF file {gguf_path}")
            name = f"model.layers.{i}.{_GGUF_LAYER_NAMES[part]}.{kind}"
        shape = tuple(int(d) for d in reversed(t.shape))
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float().reshape(shape)
        if cfg.family == "llama" and kind == "weight" and part_is(t.name, "attn_q"):
            w = unpermute_qk(w, cfg.num_attention_heads)
        elif cfg.family == "llama" and kind == "weight" and part_is(t.name, "attn_k"):
            w = unpermute_qk(w, cfg.num_key_value_heads)
        sd[name] = w.contiguous()
    return sd


def part_is(tensor_name: str, part: str) -> bool:
    return tensor_name.split(".")[-2] == part
