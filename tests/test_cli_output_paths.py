"""Every command that writes: an output path that cannot be written gives one line and a non-zero
exit before any work, and leaves nothing behind."""

import json

import pytest
import torch
from helpers import EVAL_DIR, assert_clean_error, make_random_dspark, run_cli

from dspark.draft.checkpoint import save_drafter
from dspark.model.loading import load_target


@pytest.fixture(scope="module")
def setup(tiny_targets, tmp_path_factory):
    root = tmp_path_factory.mktemp("outputs")
    model = dict(tiny_targets)["llama-untied"]
    target = load_target(model, dtype=torch.float32, require_tokenizer=False)
    save_drafter(make_random_dspark(target, block_size=4).model, root / "drafter", target=target)
    (root / "data.jsonl").write_text(json.dumps({"id": "a", "prompt_ids": [5, 6], "response_ids": [7, 8, 9]}) + "\n")
    (root / "prompts.jsonl").write_text(json.dumps({"turns": ["hi"]}) + "\n")
    (root / "train.toml").write_text(f'data = "{root / "data.jsonl"}"\ntarget = "{model}"\n')
    (root / "a-file").write_text("not a directory\n")
    return root, str(model)


def _commands(root, model, out):
    d = str(root / "drafter")
    dataset = str(EVAL_DIR / "gsm8k.jsonl")
    return {
        "draft init": ["draft", "init", "--model", model, "--out", out],
        "draft convert": ["draft", "convert", "--model", model, "--drafter", d, "--dtype", "bfloat16", "--out", out],
        "draft export": ["draft", "export", "--model", model, "--drafter", d, "--out", out],
        "train": ["train", "--config", str(root / "train.toml"), "--out", out, "--no-progress"],
        "eval": ["eval", "--model", model, "--drafter", "prompt-lookup", "--dataset", dataset, "--out", out],
        "calibrate": ["calibrate", "--model", model, "--drafter", d, "--dataset", dataset, "--out", out],
        "profile": ["profile", "--model", model, "--plot", f"{out}/sps.png"],
        "bench serve": ["bench", "serve", "--model", model, "--drafter", "none", "--policies", "ar", "--out", out],
        "data regenerate": ["data", "regenerate", "--model", model, "--prompts", str(root / "prompts.jsonl"),
                            "--out", f"{out}/regen.jsonl"],
    }


@pytest.mark.parametrize("command", ["draft init", "draft convert", "draft export", "train", "eval", "calibrate",
                                     "profile", "bench serve", "data regenerate"])
def test_unwritable_output_gives_one_line_and_leaves_nothing(setup, command):
    root, model = setup
    before = sorted(p.name for p in root.rglob("*"))
    for out, needle in [("/proc/dspark-out", "cannot write"), (str(root / "a-file" / "out"), "is a file")]:
        assert_clean_error(run_cli(*_commands(root, model, out)[command]), needle)
    assert sorted(p.name for p in root.rglob("*")) == before  # no partial files, no probe left over


def test_an_existing_file_where_a_directory_goes_is_refused(setup):
    root, model = setup
    assert_clean_error(run_cli("draft", "init", "--model", model, "--out", str(root / "a-file")), "not a directory")
    assert (root / "a-file").read_text() == "not a directory\n"
