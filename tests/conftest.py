import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_fp32():
    """The real embedded target in fp32 (exactness tests run in fp32, DESIGN.md §2)."""
    from dspark.model.loading import load_target

    return load_target(None, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_targets(tmp_path_factory):
    """Tiny random llama (untied), llama (tied), qwen2 and qwen3 targets, as (name, hf_dir)."""
    from helpers import make_tiny_hf_model

    root = tmp_path_factory.mktemp("tiny")
    specs = [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)]
    return [(f"{fam}-{'tied' if tie else 'untied'}", make_tiny_hf_model(fam, root / f"{fam}{tie}", tie=tie)) for fam, tie in specs]
