"""`dspark draft export --layout gguf`: the GGUF llama.cpp runs as a DSpark draft (llama.cpp's converter's
layout, checked byte for byte against it by benchmarks/check_llama_cpp_dspark.py)."""

import gguf
import numpy as np
import pytest
import torch
from helpers import assert_clean_error, make_random_dspark, run_cli
from safetensors.torch import load_file

from dspark.draft.checkpoint import save_drafter
from dspark.draft.export_gguf import export_gguf, gguf_name, p_min_table
from dspark.errors import DsparkError
from dspark.model.loading import embedded_gguf_path

pytestmark = pytest.mark.slow  # the embedded SmolLM2: its GGUF holds the tokenizer


def _values(t: gguf.ReaderTensor) -> torch.Tensor:
    """A GGUF tensor as torch, in the row-major shape torch uses."""
    data = np.asarray(t.data)
    if t.tensor_type == gguf.GGMLQuantizationType.BF16:
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(data.copy())


def _load_with_llama_cpp(path) -> int:
    """llama.cpp's own loader (llama-cpp-python's libllama): the vocabulary size it reads, 0 on failure."""
    import llama_cpp

    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    if not model:
        return 0
    try:
        return llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    finally:
        llama_cpp.llama_model_free(model)


@pytest.mark.parametrize("vocab", ["reduced", "full"])
def test_gguf_holds_the_drafters_weights_and_llama_cpp_loads_it(smollm2_fp32, tmp_path, vocab):
    target = smollm2_fp32
    draft_vocab = list(range(0, 49152, 6)) if vocab == "reduced" else None
    drafter = make_random_dspark(target, "vanilla", block_size=4, draft_vocab=draft_vocab)
    save_drafter(drafter.model, tmp_path / "d", target=target, dtype=torch.bfloat16)
    done = export_gguf(tmp_path / "d", target, embedded_gguf_path(), tmp_path / "d.gguf")
    reader = gguf.GGUFReader(str(done.path))
    got = {t.name: t for t in reader.tensors}
    saved = load_file(tmp_path / "d" / "model.safetensors")
    for name, want in saved.items():
        if name in ("d2t", "t2d"):
            continue
        t = got.pop(gguf_name(name))
        assert torch.equal(_values(t).reshape(want.shape), want.float() if want.dim() == 1 else want), name
    embed = got.pop("token_embd.weight")
    assert torch.equal(_values(embed).reshape(49152, -1), target.model.embed_tokens.to(torch.bfloat16))
    if vocab == "reduced":  # the K draft rows of the head, and d2t as absolute target ids
        assert _values(got.pop("d2t")).tolist() == draft_vocab
        head = _values(got.pop("output.weight")).reshape(len(draft_vocab), -1)
        assert torch.equal(head, target.model.lm_head[draft_vocab].to(torch.bfloat16))
    assert not got  # nothing else, and no full-vocabulary head: llama.cpp reads the target's
    fields = reader.fields
    assert fields["general.architecture"].contents() == "dflash"
    assert fields["dflash.target_layers"].contents() == [i + 1 for i in drafter.model.cfg.target_layer_ids]
    assert fields["tokenizer.ggml.mask_token_id"].contents() == drafter.model.cfg.mask_token_id
    assert _load_with_llama_cpp(done.path) == 49152


def test_heads_llama_cpp_cannot_run_are_refused(smollm2_fp32, tmp_path):
    save_drafter(make_random_dspark(smollm2_fp32, "gated", block_size=4).model, tmp_path / "g", target=smollm2_fp32)
    with pytest.raises(DsparkError, match="vanilla one only"):
        export_gguf(tmp_path / "g", smollm2_fp32, embedded_gguf_path(), tmp_path / "g.gguf")
    assert not (tmp_path / "g.gguf").exists()


def test_p_min_table_maps_calibrated_levels_to_raw_ones():
    (c3, low), (c5, mid) = p_min_table([1.0, 2.0], levels=(0.3, 0.5))
    assert low[0] == pytest.approx(0.3) and low[1] < 0.3  # T = 2 sharpens: raw σ(2·logit 0.3)
    assert mid == pytest.approx([0.5, 0.5])


def test_cli_needs_the_targets_gguf(tiny_targets, tmp_path):
    model = str(dict(tiny_targets)["qwen3-tied"])
    args = ["draft", "export", "--layout", "gguf", "--drafter", str(tmp_path), "--model", model]
    assert_clean_error(run_cli(*args, "--out", str(tmp_path / "x.gguf")), "HF directory")
    assert_clean_error(run_cli("draft", "export", "--layout", "gguf", "--drafter", str(tmp_path), "--out",
                               str(tmp_path / "x.bin")), "ending in .gguf")
    assert_clean_error(run_cli("draft", "export", "--drafter", str(tmp_path), "--out", str(tmp_path / "y"), "--dtype",
                               "bfloat16"), "--layout gguf")
