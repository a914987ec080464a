"""Reduced draft vocabularies (issue 20): the mapping, losslessness of drafting over K < V tokens,
and the distillation losses over them."""

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    eval_prompts,
    first_committed_tokens,
    first_two_tokens_tv,
    make_random_dspark,
    make_random_eagle3,
    tokens_tv,
)

from dspark.decode.engine import Engine, Request
from dspark.decode.generate import Decoder
from dspark.draft import vocab
from dspark.errors import DsparkError
from dspark.model.loading import load_target
from dspark.sampling import SamplingParams, probs_from_logits
from dspark.schedule.policies import parse_policy
from dspark.train.losses import TargetDist, acceptance_sums, greedy_acceptance_sums, kd_loss_sums


def test_mapping_round_trips_in_eagle3_convention():
    ids = vocab.most_frequent([[5, 5, 7, 2], [7, 5, 9]], 3, vocab_size=12)
    assert ids.tolist() == [2, 5, 7]  # 5 x3, 7 x2, then the lower id of the ties 2 / 9
    assert vocab.to_d2t(ids).tolist() == [2, 4, 5]  # draft index i is target token i + d2t[i]
    assert vocab.from_d2t(vocab.to_d2t(ids)).tolist() == [2, 5, 7]
    assert vocab.to_t2d(ids, 12).nonzero().flatten().tolist() == [2, 5, 7]
    assert vocab.most_frequent([[3]], 4, vocab_size=6).tolist() == [0, 1, 2, 3]  # unseen ids fill up
    assert vocab.coverage([[2, 5, 11], [7]], ids) == 0.75
    with pytest.raises(DsparkError, match="distinct, increasing"):
        vocab.check_ids(torch.tensor([3, 3, 4]), 12)
    with pytest.raises(DsparkError, match="1..12"):
        vocab.most_frequent([[1]], 13, vocab_size=12)


def _reduced(target, k: int, seed: int = 0) -> list[int]:
    """A K-token vocabulary of the tiny targets: a random subset, so that the target's argmax often
    falls outside it (the hard case for exactness)."""
    g = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(target.cfg.vocab_size, generator=g)[:k].tolist())


def test_a_bf16_save_keeps_the_vocabulary_maps_exact(tiny_targets, tmp_path):
    """save_drafter(dtype=bf16) casts the weights only: d2t / t2d keep their integer / bool dtypes (bf16
    holds integers exactly only up to 256, so a cast map fails to load with a real vocabulary)."""
    from safetensors.torch import load_file

    from dspark.draft.checkpoint import load_model, save_drafter

    target = load_target(tiny_targets[1][1], dtype=torch.float32, require_tokenizer=False)
    model = make_random_dspark(target, "vanilla", block_size=4, draft_vocab=_reduced(target, 40)).model
    save_drafter(model, tmp_path / "d", target=target, dtype=torch.bfloat16)
    stored = load_file(tmp_path / "d" / "model.safetensors")
    assert stored["d2t"].dtype == model.state_dict()["d2t"].dtype
    assert stored["t2d"].dtype == model.state_dict()["t2d"].dtype
    assert {v.dtype for k, v in stored.items() if k not in ("d2t", "t2d")} == {torch.bfloat16}
    loaded, _ = load_model(tmp_path / "d", target)
    assert torch.equal(loaded.draft_ids, model.draft_ids)


@pytest.mark.parametrize("kind", ["vanilla", "rnn", "none", "eagle3"])
def test_reduced_vocabulary_drafts_stay_inside_and_greedy_is_exact(tiny_targets, kind):
    target = load_target(tiny_targets[1][1], dtype=torch.float32, require_tokenizer=False)
    ids = _reduced(target, 40)
    make = (lambda: make_random_eagle3(target, block_size=4, std=0.3, draft_vocab=ids)) if kind == "eagle3" else (
        lambda: make_random_dspark(target, kind, block_size=4, std=0.3, draft_vocab=ids))
    drafter = make()
    gen = torch.Generator().manual_seed(1)
    ar = Decoder(target)
    proposed = []
    for n in (5, 17, 9):
        prompt = torch.randint(3, 128, (n,), generator=gen).tolist()
        drafter.begin(prompt)
        taps = target.model(torch.tensor([prompt]), target.model.new_cache(1, 32),
                            taps=drafter.tap_layers).taps[0] if drafter.tap_layers else None
        drafter.observe(prompt, taps)
        block = drafter.propose(prompt[-1], 4, SamplingParams(temperature=0.8, top_k=10), torch.Generator())
        proposed += block.tokens
        assert block.probs.shape == (len(block.tokens), 128)
        outside = torch.ones(128, dtype=torch.bool)
        outside[ids] = False
        assert block.probs[:, outside].abs().max() == 0  # p_d is exactly zero outside the vocabulary
        assert torch.allclose(block.probs.sum(-1), torch.ones(len(block.tokens)))
        spec = Decoder(target, make())
        assert spec.generate(prompt, 30).token_ids == ar.generate(prompt, 30).token_ids
    assert set(proposed) <= set(ids)


def test_reduced_vocabulary_is_lossless_on_smollm2_greedy(smollm2_fp32):
    """fp32 SmolLM2, a DSpark drafter over the 4,096 most frequent tokens of the prompts' own greedy
    replies (so drafts do get accepted): speculative greedy output equals plain greedy output."""
    target = smollm2_fp32
    prompts = [target.encode_prompt(p) for p in eval_prompts("mt-bench", 3)]
    ar = Decoder(target)
    want = [ar.generate(p, 40).token_ids for p in prompts]
    ids = vocab.most_frequent(want, 4096, target.cfg.vocab_size).tolist()
    spec = Decoder(target, make_random_dspark(target, "vanilla", block_size=4, std=0.02, draft_vocab=ids),
                   parse_policy("full"))
    for p, w in zip(prompts, want):
        assert spec.generate(p, 40).token_ids == w


@pytest.mark.parametrize("policy", ["fixed:4", "dspark"])
def test_batched_engine_with_a_reduced_vocabulary_is_exact(tiny_targets, policy):
    from dspark.schedule.policies import SPSTable

    target = load_target(tiny_targets[3][1], dtype=torch.float32, require_tokenizer=False)
    drafter = make_random_dspark(target, "rnn", block_size=5, std=0.3, draft_vocab=_reduced(target, 50, seed=2))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (int(n),), generator=gen).tolist() for n in torch.randint(2, 30, (6,), generator=gen)]
    want = [Decoder(target).generate(p, 25).token_ids for p in prompts]
    sps = SPSTable(tuple(100.0 / (1 + 0.06 * (b - 1)) for b in range(1, 129)))
    engine = Engine(target, policy=parse_policy(policy, sps), max_batch=3, draft_model=drafter.model)
    done = engine.run([Request(p, 25) for p in prompts])
    assert [r.token_ids for r in done] == want
    assert sum(x.verified for r in done for x in r.rounds) > 0


CASES = [  # target logits over V = 8, the draft vocabulary {1, 2, 4, 6}: the target's mass is mostly outside
    ([2.0, 1.0, 0.5, 3.0, -1.0, -2.0, 0.7, 1.5], SamplingParams(temperature=1.0)),
    ([2.0, 1.0, 0.5, 3.0, -1.0, -2.0, 0.7, 1.5], SamplingParams(temperature=0.8, top_k=3)),
    ([0.3, 1.0, 2.5, 0.1, 1.2, 2.4, 0.7, 0.0], SamplingParams(temperature=1.2, top_p=0.7)),
    ([0.3, 1.0, 2.5, 0.1, 1.2, 2.4, 0.7, 0.0], SamplingParams(temperature=0.9, top_k=2, top_p=0.9)),
]


class _Target:  # what DraftHead reads of a target: its vocabulary size and LM head
    def __init__(self, vocab_size: int):
        self.cfg = type("Cfg", (), {"vocab_size": vocab_size})()
        self.model = type("M", (), {"lm_head": torch.zeros(vocab_size, 2), "logits": None})()


@pytest.mark.parametrize("case", range(len(CASES)))
def test_verification_stays_exact_when_the_target_has_mass_outside_the_draft_vocabulary(case):
    """200k one-step trials: the committed token follows the target's processed distribution while
    the draft samples from its own processed distribution over K = 4 of 8 tokens."""
    t_logits, params = CASES[case]
    ids = torch.tensor([1, 2, 4, 6])
    head = vocab.DraftHead(ids, _Target(8))
    p_t = probs_from_logits(torch.tensor(t_logits), params)
    assert p_t[[0, 3, 5, 7]].sum() > 0.2  # real mass outside the draft vocabulary
    draft_logits = torch.tensor([[0.5, 2.0, -0.3, 1.0]])  # over the K draft tokens
    p_d = head.full_probs(probs_from_logits(draft_logits, params))[0]
    assert p_d[[0, 3, 5, 7]].sum() == 0
    for n_draft in (1, 3):
        assert tokens_tv(first_committed_tokens(p_t, p_d, n_draft, seed=case), p_t) < 0.005


def test_first_two_tokens_follow_the_target_at_t1_with_half_the_vocabulary(tmp_path):
    """End to end through the Decoder on the 4-token sharp target, drafting over tokens {1, 3}."""
    tv, accept = first_two_tokens_tv(tmp_path, "dspark", head="vanilla", block_size=3, rank=4, std=0.5,
                                     draft_vocab=[1, 3])
    assert 0.05 < accept < 0.95, accept
    assert tv < 0.01, f"total variation {tv:.4f}"


def test_reduced_losses_equal_the_full_vocabulary_ones_when_k_is_v():
    g = torch.Generator().manual_seed(0)
    V, N = 16, 12
    d, t = torch.randn(N, V, generator=g), torch.randn(N, V, generator=g)
    labels, w, conf = torch.randint(0, V, (N,), generator=g), torch.rand(N, generator=g), torch.randn(N, generator=g)
    for weights in [dict(ce_weight=1.0, tv_weight=0.5, conf_weight=0.3), dict(ce_weight=0.0, tv_weight=0.0,
                                                                            conf_weight=0.0, soft_ce_weight=1.0)]:
        full = kd_loss_sums(d, conf, t, labels, w, **weights)
        reduced = kd_loss_sums(d, conf, t, labels, w, **weights, draft_ids=torch.arange(V))
        for a, b in zip(vars(full).values(), vars(reduced).values()):
            assert torch.allclose(a, b, atol=1e-6)
    block_pos = torch.arange(N) % 3
    for a, b in zip(acceptance_sums(d, t, block_pos, 3), acceptance_sums(d, t, block_pos, 3, torch.arange(V))):
        assert torch.allclose(a, b, atol=1e-6)


def test_reduced_losses_match_brute_force_over_the_full_vocabulary():
    """K < V: the draft distribution is zero outside; TV (and the confidence target c*) is exact over
    all V tokens, the cross-entropies cover the draft vocabulary (labels outside left out)."""
    g = torch.Generator().manual_seed(1)
    V, K, N = 10, 4, 9
    ids = torch.tensor([0, 3, 4, 8])
    d, t = torch.randn(N, K, generator=g), torch.randn(N, V, generator=g)
    labels = torch.tensor([3, 1, 8, 0, 9, 4, 4, 2, 3])  # 1, 9, 2 are outside
    w, conf = torch.rand(N, generator=g), torch.randn(N, generator=g)

    p_d = torch.zeros(N, V)
    p_d[:, ids] = F.softmax(d, -1)
    p_t = F.softmax(t, -1)
    l1 = (p_d - p_t).abs().sum(-1)
    inside = torch.isin(labels, ids)
    log_pd_full = torch.log(p_d.clamp_min(1e-30))
    ce = torch.where(inside, -log_pd_full.gather(1, labels[:, None])[:, 0], torch.zeros(N))
    c_star = (1 - 0.5 * l1).clamp(0, 1)
    bce = F.binary_cross_entropy_with_logits(conf, c_star, reduction="none")

    got = kd_loss_sums(d, conf, t, labels, w, 1.0, 0.5, 0.3, draft_ids=ids)
    assert torch.allclose(got.tv, (w * l1).sum(), atol=1e-6)
    assert torch.allclose(got.ce, (w * ce).sum(), atol=1e-5)
    assert torch.allclose(got.conf, (w * bce).sum(), atol=1e-6)
    assert torch.allclose(got.total, got.ce + 0.5 * got.tv + 0.3 * got.conf)

    soft = kd_loss_sums(d, None, t, labels, w, 0.0, 0.0, 0.0, soft_ce_weight=1.0, draft_ids=ids)
    want = (w * -(p_t[:, ids] * torch.log(p_d[:, ids])).sum(-1)).sum()
    assert torch.allclose(soft.ce, want, atol=1e-5)

    s_, c_ = acceptance_sums(d, TargetDist.from_logits(t, ids), torch.arange(N) % 3, 3)
    assert torch.allclose(s_, (1 - 0.5 * l1).clamp(0, 1).view(3, 3).sum(0), atol=1e-6)
    assert c_.tolist() == [3, 3, 3]

    # T = 0: accepted iff the draft's argmax (over all V, zero outside) is the target's
    t[[0, 2, 4, 5], ids[d.argmax(-1)[[0, 2, 4, 5]]]] += 10.0
    hit = (p_d.argmax(-1) == t.argmax(-1)).double()
    assert hit.sum() >= 4
    got = greedy_acceptance_sums(d, TargetDist.from_logits(t, ids), torch.arange(N) % 3, 3, ids)
    assert got.tolist() == hit.view(3, 3).sum(0).tolist()
    assert greedy_acceptance_sums(p_d.log(), t, torch.arange(N) % 3, 3).tolist() == got.tolist()  # full vocabulary


def test_draft_init_picks_the_vocabulary_from_regenerated_data(tiny_targets, tmp_path):
    from helpers import assert_clean_error, make_tiny_regen_data, run_cli
    from safetensors.torch import load_file, save_file

    from dspark.draft.checkpoint import load_drafter_checkpoint
    from dspark.train.data import load_samples

    model_dir = tiny_targets[0][1]
    target = load_target(model_dir, dtype=torch.float32, require_tokenizer=False)
    data = make_tiny_regen_data(target, tmp_path / "regen.jsonl", n=12)
    out = tmp_path / "d"
    proc = run_cli("draft", "init", "--model", str(model_dir), "--out", str(out), "--draft-vocab-size", "32",
                   "--vocab-data", str(data))
    assert proc.returncode == 0, proc.stderr
    assert "covering" in proc.stdout
    drafter = load_drafter_checkpoint(out, target)
    replies = [s.response_ids for s in load_samples(data)]
    assert drafter.model.draft_ids.tolist() == vocab.most_frequent(replies, 32, 128).tolist()
    assert drafter.model.markov_head.markov_w2.weight.shape == (32, 32)  # W2: K rows (rank 32)

    assert_clean_error(run_cli("draft", "init", "--model", str(model_dir), "--out", str(tmp_path / "e"),
                               "--draft-vocab-size", "32"), "go together")
    assert_clean_error(run_cli("draft", "init", "--model", str(model_dir), "--out", str(tmp_path / "e"),
                               "--draft-vocab-size", "500", "--vocab-data", str(data)), "outside 1..128")
    tensors = load_file(out / "model.safetensors")
    tensors["d2t"][3] = tensors["d2t"][2] - 5  # ids no longer increasing
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(DsparkError, match="damaged"):
        load_drafter_checkpoint(out, target)
