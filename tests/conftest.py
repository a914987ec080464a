import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # pytest -n N: the cores are shared out among the workers, and the dspark processes a test starts (CLI
    # runs, servers) inherit the share. More busy OpenMP threads than cores make every parallel region wait
    # for a descheduled thread: a tiny server then took > 60 s for one reply.
    share = max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(share)
    os.environ["OMP_NUM_THREADS"] = str(share)


@pytest.fixture(scope="session")
def smollm2_fp32():
    """The real embedded target in fp32 (exactness tests run in fp32, DESIGN.md §2)."""
    from dspark.model.loading import load_target

    return load_target(None, dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_q4f32():
    """The real embedded target in q4f32: its GGUF blocks as stored, fp32 activations (float32's weights)."""
    from dspark.model.loading import load_target

    return load_target(None, dtype="q4f32")


@pytest.fixture(scope="session")
def smollm2_q4q8():
    """The real embedded target in q4q8: its GGUF blocks as stored, activations quantised to 8 bits as
    llama.cpp does (--dtype auto on CPUs without bf16 units)."""
    from dspark.model.loading import load_target

    return load_target(None, dtype="q4q8")


@pytest.fixture(scope="session")
def tiny_targets(tmp_path_factory):
    """Tiny random llama (untied), llama (tied), qwen2 and qwen3 targets, as (name, hf_dir)."""
    from helpers import make_tiny_hf_model

    root = tmp_path_factory.mktemp("tiny")
    specs = [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)]
    return [(f"{fam}-{'tied' if tie else 'untied'}", make_tiny_hf_model(fam, root / f"{fam}{tie}", tie=tie)) for fam, tie in specs]


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """(model dir, drafter dir) for server tests: a tiny random Llama with SmolLM2's tokenizer (it
    speaks through the real tokenizer and chat template, fast, and never stops early), and a random
    DSpark drafter for it."""
    import shutil

    from helpers import make_random_dspark, make_tiny_hf_model
    from serving import VOCAB, WINDOW

    from dspark.draft.checkpoint import save_drafter
    from dspark.model.loading import load_target, resolve_model_dir

    root = tmp_path_factory.mktemp("serve")
    model_dir = make_tiny_hf_model("llama", root / "model", vocab=VOCAB, max_positions=WINDOW)
    smollm2 = resolve_model_dir(None)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (smollm2 / f).is_file():
            shutil.copy(smollm2 / f, model_dir / f)
    target = load_target(model_dir, dtype=torch.float32)
    drafter = make_random_dspark(target, "vanilla", block_size=4, std=0.3)
    return model_dir, save_drafter(drafter.model, root / "drafter", target)
