"""The regenerated-data shard store: exact read-back, bounded shards, digests that catch changed data,
resume after kills at every point of a seal, and regeneration / training on a store."""

import dataclasses
import json
import os

import pytest
import torch
from helpers import assert_clean_error, make_tiny_hf_model, run_cli

from dspark.decode.generate import Decoder
from dspark.errors import DsparkError
from dspark.model.loading import load_target
from dspark.sampling import SamplingParams
from dspark.train.config import TrainConfig
from dspark.train.data import Prompt, load_samples
from dspark.train.regenerate import regenerate
from dspark.train.shards import MANIFEST, PENDING, ShardStore
from dspark.train.trainer import Trainer

SETTINGS = {"target": "t", "temperature": 0.7, "seed": 0}


def _records(n, start=0, vocab=50_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(start, start + n):
        p, r = torch.randint(1, vocab, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist(), \
            torch.randint(0, vocab, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
        out.append({"id": f"s{i}", "prompt_ids": p, "response_ids": r, "finish_reason": "stop" if i % 2 else "length"})
    return out


def test_round_trip_in_bounded_shards_with_uint16_or_int32(tmp_path):
    store = ShardStore(tmp_path / "s", SETTINGS, shard_size=4)
    recs = _records(10) + _records(1, start=10, vocab=100_000)  # the last one needs int32
    recs[10]["response_ids"].append(70_000)
    for r in recs:
        store.add(r)
    assert [s["samples"] for s in store.manifest["shards"]] == [4, 4] and len(store.pending) == 3
    store.seal()
    assert [s["samples"] for s in store.manifest["shards"]] == [4, 4, 3]
    reopened = ShardStore(tmp_path / "s")
    assert reopened.records() == recs
    assert reopened.totals() == {"samples": 11, "prompt_tokens": sum(len(r["prompt_ids"]) for r in recs),
                                 "response_tokens": sum(len(r["response_ids"]) for r in recs)}
    from safetensors import safe_open

    dtypes = [safe_open(str(tmp_path / "s" / s["file"]), "pt").get_slice("tokens").get_dtype()
              for s in reopened.manifest["shards"]]
    assert dtypes == ["U16", "U16", "I32"]
    assert (tmp_path / "s" / PENDING).read_text() == ""
    samples = load_samples(tmp_path / "s")  # the trainer's reader: responses of 2+ tokens
    assert [s.id for s in samples] == [r["id"] for r in recs if len(r["response_ids"]) >= 2]


def test_changed_data_settings_and_paths_are_refused(tmp_path):
    store = ShardStore(tmp_path / "s", SETTINGS, shard_size=2)
    for r in _records(4):
        store.add(r)
    digest = store.digest
    shard = tmp_path / "s" / store.manifest["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DsparkError, match="does not match its sha256"):
        load_samples(tmp_path / "s")
    shard.unlink()
    with pytest.raises(DsparkError, match="is missing"):
        ShardStore(tmp_path / "s").records()
    with pytest.raises(DsparkError, match=r"other settings \(differs in temperature\)"):
        ShardStore(tmp_path / "s", {**SETTINGS, "temperature": 1.0})
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(DsparkError, match="not an empty directory"):
        ShardStore(tmp_path / "busy", SETTINGS)
    with pytest.raises(DsparkError, match="not a regenerated-data store"):
        load_samples(tmp_path / "busy")
    (tmp_path / "s" / MANIFEST).write_text("{")
    with pytest.raises(DsparkError, match="not valid JSON"):
        ShardStore(tmp_path / "s")
    assert digest != ShardStore(tmp_path / "t", SETTINGS).digest


def test_kills_at_every_point_of_a_seal_lose_and_duplicate_nothing(tmp_path):
    recs = _records(7)
    root = tmp_path / "s"
    store = ShardStore(root, SETTINGS, shard_size=3)
    for r in recs[:3]:
        store.add(r)  # sealed: shard 0
    for r in recs[3:5]:
        store.add(r)  # pending
    pending = (root / PENDING).read_text()
    # killed mid-line: the torn line is cut off on reopening
    with open(root / PENDING, "a") as f:
        f.write('{"id": "s5", "prompt_ids": [1')
    store = ShardStore(root, SETTINGS, shard_size=3)
    assert [r["id"] for r in store.pending] == ["s3", "s4"] and (root / PENDING).read_text() == pending
    # killed after the manifest listed shard 1, before the journal was cleared: sealed ids are dropped
    store.add(recs[5])
    (root / PENDING).write_text(pending + json.dumps(recs[5]) + "\n")
    store = ShardStore(root, SETTINGS, shard_size=3)
    assert store.pending == [] and (root / PENDING).read_text() == "" and store.done_ids() == {r["id"] for r in recs[:6]}
    # killed after writing a shard file, before the manifest listed it: the file is written again
    m = json.loads((root / MANIFEST).read_text())
    m["shards"] = m["shards"][:1]
    (root / MANIFEST).write_text(json.dumps(m))
    (root / "shard-00001.safetensors").write_bytes(b"torn")
    (root / PENDING).write_text(pending + json.dumps(recs[5]) + "\n")
    store = ShardStore(root, SETTINGS, shard_size=3)
    assert [r["id"] for r in store.pending] == ["s3", "s4", "s5"]
    store.add(recs[6])  # seals s3 s4 s5 as shard 1 again; s6 stays pending
    store.seal()
    assert ShardStore(root).records() == recs


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    return load_target(make_tiny_hf_model("llama", root / "target"), dtype=torch.float32, require_tokenizer=False)


def test_regeneration_into_a_store_resumes_and_equals_single_requests(smollm2_fp32, tmp_path):
    target = smollm2_fp32
    texts = ["What is 7 times 6?", "Name a colour.", "Say hi.", "Count to five.", "Write a haiku."]
    prompts = [Prompt(f"p{i}", t) for i, t in enumerate(texts)]
    out = tmp_path / "store"
    stats = regenerate(target, prompts[:3], out, SamplingParams(), max_new_tokens=12, batch_size=2, progress=False,
                       shard_size=2)
    assert stats["complete"] and stats["prompts_done"] == 3
    store = ShardStore(out)
    assert [s["samples"] for s in store.manifest["shards"]] == [2, 1]  # the remainder sealed at the end
    stats = regenerate(target, prompts, out, SamplingParams(), max_new_tokens=12, batch_size=3, progress=False,
                       shard_size=2)
    assert stats["skipped_finished"] == 3 and stats["prompts_done"] == 2
    store = ShardStore(out)
    ar = Decoder(target)
    got = {r["id"]: r for r in store.records()}
    assert sorted(got) == [p.id for p in prompts]
    for p in prompts:
        want = ar.generate(target.encode_prompt(p.text), 12)
        assert got[p.id]["response_ids"] == want.token_ids and got[p.id]["finish_reason"] == want.finish_reason
    runs = store.manifest["runs"]
    assert [r["prompts_done"] for r in runs] == [3, 2] and all(r["tokens_per_s"] > 0 for r in runs)
    before = (out / "manifest.json").read_bytes()
    regenerate(target, prompts, out, SamplingParams(), max_new_tokens=12, progress=False)
    assert (out / "manifest.json").read_bytes() == before  # a resume with nothing to do changes nothing
    with pytest.raises(DsparkError, match="differs in max_new_tokens"):
        regenerate(target, prompts, out, SamplingParams(), max_new_tokens=13, progress=False)


def test_regenerate_cli_into_a_store_and_bad_outputs(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "x", "turns": ["Say yes."]}\n{"id": "y", "turns": ["Say no."]}\n')
    r = run_cli("data", "regenerate", "--prompts", str(prompts), "--out", str(tmp_path / "store"),
                "--max-new-tokens", "6", "--shard-size", "1")
    assert r.returncode == 0, r.stderr
    assert ShardStore(tmp_path / "store").totals()["samples"] == 2
    (tmp_path / "file").write_text("x")
    assert_clean_error(run_cli("data", "regenerate", "--prompts", str(prompts), "--out", str(tmp_path / "file")),
                       "is not a directory")
    assert_clean_error(run_cli("data", "regenerate", "--prompts", str(prompts), "--out", str(tmp_path / "store"),
                               "--max-new-tokens", "6", "--temperature", "0.5"), "(differs in temperature)")


def test_training_reads_a_store(tiny_target, tmp_path):
    target = tiny_target
    dec = Decoder(target)
    store = ShardStore(tmp_path / "store", SETTINGS, shard_size=8)
    g = torch.Generator().manual_seed(0)
    for i in range(20):
        prompt = torch.randint(3, target.cfg.vocab_size, (6,), generator=g).tolist()
        out = dec.generate(prompt, 24, SamplingParams(temperature=1.0), seed=i)
        store.add({"id": f"s{i}", "prompt_ids": prompt, "response_ids": out.token_ids, "finish_reason": "length"})
    store.seal()
    val = ShardStore(tmp_path / "val", SETTINGS)  # held-out replies given apart (`val_data`)
    for r in store.records()[:3]:
        val.add(r)
    val.seal()
    cfg = TrainConfig(data=str(tmp_path / "store"), out=str(tmp_path / "run"), target=str(target.path), steps=2,
                      batch_size=2, anchors_per_seq=4, block_size=4, markov_rank=8, eval_every=2,
                      checkpoint_every=2, val_fraction=0.2)
    trainer = Trainer(cfg, progress=False)
    assert len(trainer.train_set) + len(trainer.val_set) == sum(len(r["response_ids"]) >= 2 for r in store.records())
    trainer = Trainer(dataclasses.replace(cfg, val_data=str(tmp_path / "val"), val_fraction=0.0), progress=False)
    assert [s.id for s in trainer.val_set] == ["s0", "s1", "s2"]
    assert [s.id for s in trainer.train_set] == [f"s{i}" for i in range(3, 20)]  # never trained on
    trainer.run()
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    last = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()][-1]["val"]
    assert len(last["alpha_greedy"]) == 4 and 1 <= last["expected_tau_greedy"] <= 5


def test_a_second_writer_process_is_refused_and_a_doubled_journal_is_repaired(tmp_path):
    """Two regenerations into one store would answer the same prompts twice: while one process
    writes, another is refused with a clear error; a journal that holds a reply twice (written
    before the lock existed) keeps its first copy."""
    import subprocess
    import sys

    recs = _records(3)
    root = tmp_path / "s"
    store = ShardStore(root, SETTINGS, shard_size=10)
    for r in recs[:2]:
        store.add(r)
    code = ("import sys; from dspark.train.shards import ShardStore; from dspark.errors import DsparkError\n"
            f"try:\n    ShardStore({str(root)!r}, {SETTINGS!r})\nexcept DsparkError as e:\n"
            "    print(e); sys.exit(3)\n")
    other = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert other.returncode == 3 and "another process" in other.stdout and str(os.getpid()) in other.stdout
    assert ShardStore(root).records() == []  # readers are never refused

    with open(root / PENDING, "a") as f:
        f.write(json.dumps(recs[0]) + "\n" + json.dumps(recs[2]) + "\n")
    reopened = ShardStore(root, SETTINGS, shard_size=10)
    assert [r["id"] for r in reopened.pending] == ["s0", "s1", "s2"]
    assert (root / PENDING).read_text().count('"s0"') == 1
    reopened.seal()
    assert ShardStore(root).records() == recs
