"""Prompt files and regeneration on the real target: batched replies equal single-request ones."""

import json

import pytest
from helpers import assert_clean_error, run_cli

from dspark.decode.generate import Decoder
from dspark.errors import DsparkError
from dspark.sampling import SamplingParams
from dspark.train.data import Prompt, is_validation, load_prompts
from dspark.train.regenerate import regenerate


def test_prompt_formats_dedup_and_errors(tmp_path):
    f = tmp_path / "mix.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in [
        {"id": "a", "turns": ["Hello there"]},
        {"id": "b", "conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": "Sum 2+2"}]},
        {"instruction": "Translate", "input": "chat"},
        {"id": "d", "turns": ["  hello   THERE "]},  # duplicate of a after normalisation
        {"id": "e", "conversations": [{"role": "user", "content": "Hi"}]},
    ]) + "\n\n")
    prompts = load_prompts(f)
    assert [p.id for p in prompts] == ["a", "b", "mix-3", "e"]
    assert prompts[1].text == "Sum 2+2" and prompts[2].text == "Translate\n\nchat" and prompts[3].text == "Hi"
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "bad.jsonl").write_text('{"turns": ["ok"]}\n[1, 2]\n')
    (tmp_path / "nokey.jsonl").write_text('{"turns": ["ok"]}\n{"text": "?"}\n')
    for name, message in [("empty", "holds no prompts"), ("bad", "bad.jsonl:2: expected a JSON object"),
                          ("nokey", "nokey.jsonl:2: no user prompt found"), ("missing", "does not exist")]:
        with pytest.raises(DsparkError, match=message):
            load_prompts(tmp_path / f"{name}.jsonl")
    split = [is_validation(f"id-{i}", 0.1) for i in range(2000)]
    assert 150 < sum(split) < 250 and split == [is_validation(f"id-{i}", 0.1) for i in range(2000)]


def test_batched_regeneration_equals_single_requests_and_resumes(smollm2_fp32, tmp_path):
    target = smollm2_fp32
    texts = ["What is 7 times 6?", "Name a colour.", "Write a haiku about rain.", "Say hi.", "Count to five."]
    prompts = [Prompt(f"p{i}", t) for i, t in enumerate(texts)]
    out = tmp_path / "regen.jsonl"
    stats = regenerate(target, prompts[:3], out, SamplingParams(), max_new_tokens=20, batch_size=2, progress=False)
    assert stats["prompts_done"] == 3 and stats["new_tokens"] > 20
    ar = Decoder(target)
    lines = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for p in prompts[:3]:
        want = ar.generate(target.encode_prompt(p.text), 20)
        r = lines[p.id]
        assert r["prompt_ids"] == target.encode_prompt(p.text)
        assert r["response_ids"] == want.token_ids, p.text
        assert r["finish_reason"] == want.finish_reason
    # a run killed mid-line leaves a torn last line: it is cut off, finished ids are skipped
    with open(out, "a") as f:
        f.write('{"id": "p3", "prompt_ids": [1, 2')
    stats = regenerate(target, prompts, out, SamplingParams(), max_new_tokens=20, batch_size=3, progress=False)
    assert stats["skipped_finished"] == 3 and stats["prompts_done"] == 2
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == ["p0", "p1", "p2", "p3", "p4"]


def test_regenerate_cli(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "x", "turns": ["Say yes."]}\n{"id": "y", "turns": ["Say no."]}\n')
    r = run_cli("data", "regenerate", "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"),
                "--max-new-tokens", "8", "--batch-size", "2", "--temperature", "0.8", "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["prompts_done"] == 2
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 2
    (tmp_path / "bad.jsonl").write_text('{"turns": ["a"]}\nnot json\n')
    assert_clean_error(run_cli("data", "regenerate", "--prompts", str(tmp_path / "bad.jsonl"), "--out",
                               str(tmp_path / "o2.jsonl")), "bad.jsonl:2: not valid JSON")
    assert_clean_error(run_cli("data", "regenerate", "--prompts", str(tmp_path / "p.jsonl"), "--out",
                               str(tmp_path / "o2.jsonl"), "--top-p", "2"), "top-p")
