"""EAGLE-3 baseline: training unroll = step-by-step inference, lossless drafting, checkpoints."""

import pytest
import torch
from helpers import eval_prompts, first_two_tokens_tv, make_random_eagle3

from dspark.decode.generate import Decoder
from dspark.decode.speculation import load_drafter
from dspark.draft.checkpoint import save_drafter
from dspark.draft.eagle3 import Eagle3Drafter
from dspark.model.loading import load_target
from dspark.sampling import SamplingParams, probs_from_logits


@pytest.fixture(scope="module")
def tiny_loaded(tiny_targets):
    return [(name, load_target(path, dtype=torch.float32, require_tokenizer=False)) for name, path in tiny_targets]


def _train_logits(drafter, target, tokens, anchors, steps):
    out = target.model(torch.tensor([tokens]), target.model.new_cache(1, len(tokens)), taps=drafter.tap_layers)
    drafter.model.ttt_steps = steps
    with torch.no_grad():
        logits, _ = drafter.model.forward_train(out.taps, torch.tensor([tokens]), torch.tensor([anchors]),
                                                target.model.embed_tokens, target.model.lm_head)
    return out.taps[0], logits[0]


def test_unrolled_training_forward_equals_step_by_step_inference(tiny_loaded):
    gen = torch.Generator().manual_seed(0)
    for name, target in tiny_loaded:
        drafter = make_random_eagle3(target, block_size=6)
        tokens = torch.randint(target.cfg.vocab_size, (48,), generator=gen).tolist()
        anchors = [1, 2, 9, 23, 40, 46]
        taps, logits = _train_logits(drafter, target, tokens, anchors, steps=6)
        assert logits.abs().max() > 1.0
        for i, p in enumerate(anchors):
            drafter.begin(tokens[:p])
            for lo in range(0, p, 5):  # context arrives in rounds, as during decoding
                drafter.observe(tokens[lo : min(p, lo + 5)], taps[lo : min(p, lo + 5)])
            forced = iter(tokens[p + 1 :] + [0] * 8)  # teacher forcing: the true continuation
            _, inf = drafter.draft_logits(tokens[p], 6, lambda lg: [next(forced)])
            valid = min(6, len(tokens) - p)  # steps whose input token exists (the chain may run past the end)
            err = (inf[:valid] - logits[i, :valid]).abs().max().item()
            assert err <= 1e-4, f"{name} anchor {p}: logits differ by {err}"


def test_sampled_tokens_carry_their_exact_probabilities(tiny_loaded):
    name, target = tiny_loaded[2]
    drafter = make_random_eagle3(target, block_size=5)
    tokens = list(range(3, 30))
    gen = torch.Generator().manual_seed(2)
    for params in [SamplingParams(1.0), SamplingParams(0.8, top_k=10, top_p=0.9)]:
        out = target.model(torch.tensor([tokens]), target.model.new_cache(1, 64), taps=drafter.tap_layers)
        drafter.begin(tokens)
        drafter.observe(tokens, out.taps[0])
        block = drafter.propose(50, 5, params, gen)
        seq = tokens + [50] + block.tokens
        _, logits = _train_logits(drafter, target, seq, [len(tokens)], steps=5)
        want = probs_from_logits(logits[0], params)
        assert (block.probs - want).abs().max() < 1e-5


def test_greedy_with_random_eagle3_equals_plain_greedy(tiny_loaded, smollm2_fp32):
    for name, target in tiny_loaded:
        ar, spec = Decoder(target), Decoder(target, make_random_eagle3(target, block_size=4))
        for seed in range(2):
            prompt = torch.randint(3, target.cfg.vocab_size, (6 + 9 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
            got = spec.generate(prompt, 40)
            assert got.token_ids == ar.generate(prompt, 40).token_ids, name
            assert len(got.rounds) < 40
    target = smollm2_fp32
    ar, spec = Decoder(target), Decoder(target, make_random_eagle3(target, block_size=3, std=0.02))
    ids = target.encode_prompt(eval_prompts("mbpp", 1)[0])
    assert spec.generate(ids, 24).token_ids == ar.generate(ids, 24).token_ids


def test_first_two_tokens_follow_the_target_distribution_at_t1(tmp_path):
    tv, accept = first_two_tokens_tv(tmp_path, "eagle3", block_size=3, std=0.5)
    assert 0.1 < accept < 0.9, accept
    assert tv < 0.01, f"total variation {tv:.4f}"


def test_checkpoint_round_trip_and_generate_dispatch(tiny_loaded, tmp_path):
    name, target = tiny_loaded[0]
    drafter = make_random_eagle3(target, block_size=4)
    save_drafter(drafter.model, tmp_path / "e3", target=target)
    loaded = load_drafter(str(tmp_path / "e3"), target)
    assert isinstance(loaded, Eagle3Drafter) and loaded.cfg.kind == "eagle3"
    want, got = drafter.model.state_dict(), loaded.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert len(loaded.tap_layers) == 3
    prompt = list(range(5, 15))
    assert Decoder(target, loaded).generate(prompt, 20).token_ids == Decoder(target).generate(prompt, 20).token_ids
