"""The `dspark` command: JSON output and clear one-line errors on bad input."""

import json

import pytest
from helpers import assert_clean_error, run_cli


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "/no/such/model"], "does not exist"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--temperature", "-0.5"], "temperature"),
        (["--top-p", "0"], "top-p"),
        (["--top-p", "1.5"], "top-p"),
        (["--top-k", "-3"], "top-k"),
        (["--dtype", "float8"], "dtype"),
        (["--drafter", "/no/such/drafter"], "drafter"),
        (["--policy", "fastest"], "policy"),
        (["--drafter", "prompt-lookup@full", "--policy", "dspark"], "--policy"),
    ],
)
def test_bad_arguments_give_one_clear_line(args, needle):
    assert_clean_error(run_cli("generate", "--prompt", "hi", *args), needle)


def test_empty_prompt():
    assert_clean_error(run_cli("generate", "--prompt", ""), "prompt is empty")


def test_gguf_of_unsupported_architecture(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    proc = run_cli("generate", "--prompt", "hi", "--model", str(path), env_extra={"DSPARK_CACHE_DIR": str(tmp_path / "c")})
    assert_clean_error(proc, "not supported")


def test_not_a_gguf_file(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"definitely not gguf")
    proc = run_cli("generate", "--prompt", "hi", "--model", str(bogus), env_extra={"DSPARK_CACHE_DIR": str(tmp_path / "c")})
    assert_clean_error(proc, "GGUF")


def test_json_output_on_the_embedded_model():
    from dspark.draft.registry import BUNDLED_DIR

    base = ["generate", "--prompt", "Name a fruit.", "--max-new-tokens", "12", "--json", "--dtype", "float32"]
    for drafter in (f"{BUNDLED_DIR / 'smollm2-135m-instruct'}@full", "none"):
        proc = run_cli(*base, "--drafter", drafter)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert set(out) >= {"text", "token_ids", "stats"}
        s = out["stats"]
        assert set(s) >= {"new_tokens", "rounds", "tau", "decode_tok_s", "prefill_s", "draft_s", "verify_s"}
        assert 1 <= s["new_tokens"] == len(out["token_ids"]) <= 12
        assert s["tau"] >= 1.0 and out["text"]
        # where the decode time went: drafting and verifying, within the decode wall time
        assert s["verify_s"] > 0 and s["draft_s"] + s["verify_s"] <= s["decode_s"]
        assert (s["draft_s"] > 0) == (drafter != "none")


def test_streaming_output_and_stats_line():
    proc = run_cli("generate", "--prompt", "Say hello.", "--max-new-tokens", "10", "--drafter", "none")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "[dspark]" in proc.stderr and "tok/s" in proc.stderr


def test_draft_init_then_generate_with_it_matches_plain_greedy(tmp_path):
    """The embedded target end to end: a fresh random drafter plugs into `generate --drafter PATH`."""
    r = run_cli("draft", "init", "--out", str(tmp_path / "d"), "--block-size", "4", "--markov-rank", "8")
    assert r.returncode == 0, r.stderr
    outs = []
    for drafter in [str(tmp_path / "d"), "none"]:
        r = run_cli("generate", "--prompt", "Name two planets.", "--max-new-tokens", "24", "--dtype", "float32",
                    "--drafter", drafter, "--json")
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout))
    assert outs[0]["token_ids"] == outs[1]["token_ids"]
    r = run_cli("generate", "--prompt", "hi", "--drafter", str(tmp_path / "d"), "--num-draft-tokens", "9")
    assert_clean_error(r, "exceeds the drafter's block size 4")


def test_default_drafter_is_the_shipped_one_and_lossless():
    """No --drafter on the embedded model: the bundled, trained DSpark drafter (trees with prompt-lookup
    branches); greedy output equals AR's."""
    from dspark.draft.registry import BUNDLED_DIR

    outs = {}
    full = f"{BUNDLED_DIR / 'smollm2-135m-instruct'}@full"
    for drafter in [None, "none", full]:
        extra = ["--drafter", drafter] if drafter else []
        r = run_cli("generate", "--prompt", "Write a Python function that returns the square of a number.",
                    "--max-new-tokens", "48", "--dtype", "float32", *extra)
        assert r.returncode == 0, r.stderr
        outs[drafter] = r
    assert "drafters/smollm2-135m-instruct+lookup@tree" in outs[None].stderr, outs[None].stderr
    assert len({r.stdout for r in outs.values()}) == 1  # the same greedy text whatever drafts
    stats = outs[full].stderr  # every block verified in full: τ shows the drafter is trained
    tau = float(stats.split("tau ")[1].split()[0])
    assert tau > 1.3, stats  # a random drafter stays at ~1.0


def test_prompt_ids_in_token_ids_out_for_a_target_without_tokenizer(tiny_targets):
    import torch

    from dspark.decode.generate import Decoder
    from dspark.model.loading import load_target
    from dspark.sampling import SamplingParams

    model = str(dict(tiny_targets)["qwen3-tied"])  # no tokenizer files
    base = ["generate", "--model", model, "--dtype", "float32", "--drafter", "prompt-lookup", "--max-new-tokens", "12"]
    r = run_cli(*base, "--prompt-ids", "5,9,17,5,9", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    target = load_target(model, dtype=torch.float32, require_tokenizer=False)
    want = Decoder(target).generate([5, 9, 17, 5, 9], 12, SamplingParams(temperature=0.0)).token_ids
    assert out["token_ids"] == want and out["text"] is None
    r = run_cli(*base, "--prompt-ids", "5,9,17,5,9")
    assert r.returncode == 0 and r.stdout.strip() == ",".join(map(str, want)), r.stderr
    assert_clean_error(run_cli(*base, "--prompt", "hi"), "no tokenizer files")
    assert_clean_error(run_cli(*base, "--prompt-ids", "5,x"), "comma-separated token ids")
    assert_clean_error(run_cli(*base, "--prompt-ids", "5,128"), "outside the vocabulary")
    assert_clean_error(run_cli(*base, "--prompt-ids", "5", "--stop", "x"), "--stop needs one")
    assert_clean_error(run_cli(*base, "--prompt-ids", "5", "--prompt", "hi"), "not allowed with")


def test_a_policy_spelled_either_way_decodes_as_plain_greedy(tiny_targets):
    """`--drafter D@POLICY` and `--drafter D --policy POLICY` are one choice (decode/speculation.py), and
    any policy keeps the output the target's own."""
    model = str(dict(tiny_targets)["qwen3-tied"])
    base = ["generate", "--model", model, "--dtype", "float32", "--max-new-tokens", "16", "--prompt-ids", "5,9,17,5,9"]
    plain = run_cli(*base, "--drafter", "none")
    assert plain.returncode == 0, plain.stderr
    for spelling in (["--drafter", "prompt-lookup@fixed:2"], ["--drafter", "prompt-lookup", "--policy", "fixed:2"],
                     ["--drafter", "prompt-lookup@full", "--policy", "full"]):
        r = run_cli(*base, *spelling)
        assert r.returncode == 0 and r.stdout == plain.stdout, (spelling, r.stderr)
