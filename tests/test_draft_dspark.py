"""The DSpark drafter: both forward paths agree, drafting is lossless, probabilities are exact."""

import pytest
import torch
from helpers import eval_prompts, first_two_tokens_tv, make_random_dspark

from dspark.decode.generate import Decoder
from dspark.model.loading import load_target
from dspark.sampling import SamplingParams, probs_from_logits

HEADS = ["vanilla", "gated", "rnn", "none"]
# every head with DFlash's shared context projection; DFlare's layer-wise fusion with a Markov head and without
SHAPES = [(head, "shared") for head in HEADS] + [("vanilla", "layerwise"), ("none", "layerwise")]


@pytest.fixture(scope="module")
def tiny_loaded(tiny_targets):
    return [(name, load_target(path, dtype=torch.float32, require_tokenizer=False)) for name, path in tiny_targets]


def _teacher_forced_logits(drafter, target, tokens, anchors):
    """Training path: every anchor of `tokens` packed into one forward."""
    g = drafter.block_size
    out = target.model(torch.tensor([tokens]), target.model.new_cache(1, len(tokens)), taps=drafter.tap_layers)
    a = torch.tensor([anchors])
    prev = torch.tensor(tokens)[(a[..., None] + torch.arange(g)).clamp(max=len(tokens) - 1)]
    with torch.no_grad():
        logits, conf = drafter.model.forward_train(out.taps, torch.tensor([tokens]), a, target.model.embed_tokens,
                                                   target.model.lm_head)
    return out.taps[0], prev[0], logits[0], conf


@pytest.mark.parametrize("head,fusion", SHAPES)
def test_training_and_inference_paths_give_the_same_logits(tiny_loaded, head, fusion):
    gen = torch.Generator().manual_seed(0)
    for name, target in tiny_loaded:
        drafter = make_random_dspark(target, head, block_size=5, layers=2, fusion=fusion)
        tokens = torch.randint(target.cfg.vocab_size, (48,), generator=gen).tolist()
        anchors = [0, 1, 9, 23, 40, 47]  # incl. an anchor with no context and blocks running past the end
        taps, prev, logits, conf = _teacher_forced_logits(drafter, target, tokens, anchors)
        assert logits.abs().max() > 1.0
        for i, p in enumerate(anchors):
            drafter.begin(tokens[:p])
            for lo in range(0, p, 7):  # the context arrives in rounds, as during decoding
                drafter.observe(tokens[lo : min(p, lo + 7)], taps[lo : min(p, lo + 7)])
            h, base = drafter.block_outputs(tokens[p], drafter.block_size)
            forced = iter(prev[i, 1:].tolist() + [0])
            pick = (lambda lg: [next(forced) for _ in range(lg.shape[0])])
            _, inf_logits, inf_conf = drafter.run_heads(h, base, tokens[p], pick)
            err = (inf_logits - logits[i]).abs().max().item()
            assert err <= 1e-4, f"{name}/{head}/{fusion} anchor {p}: logits differ by {err}"
            assert conf is not None and inf_conf is not None  # every head here has a confidence head
            assert (inf_conf - conf[0, i]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("head", HEADS)
def test_sampled_block_carries_the_exact_probabilities_it_was_drawn_from(tiny_loaded, head):
    """The returned p_d rows must be the processed distributions of U_k + B(d_{k-1}) for the tokens
    actually drawn (checked against the teacher-forced training path), for every sampling setting."""
    name, target = tiny_loaded[3]
    drafter = make_random_dspark(target, head, block_size=6)
    tokens = list(range(3, 40))
    gen = torch.Generator().manual_seed(1)
    for params in [SamplingParams(1.0), SamplingParams(0.7, top_k=20), SamplingParams(1.3, top_p=0.8)]:
        drafter.begin(tokens)
        out = target.model(torch.tensor([tokens]), target.model.new_cache(1, 64), taps=drafter.tap_layers)
        drafter.observe(tokens, out.taps[0])
        anchor = 77  # the token sampled after the prompt, at position len(tokens)
        block = drafter.propose(anchor, 6, params, gen)
        seq = tokens + [anchor] + block.tokens
        taps = target.model(torch.tensor([seq]), target.model.new_cache(1, 64), taps=drafter.tap_layers).taps
        with torch.no_grad():  # teacher forcing with the sampled tokens: prev = [anchor, d_0, ...]
            logits, conf = drafter.model.forward_train(
                taps, torch.tensor([seq]), torch.tensor([[len(tokens)]]), target.model.embed_tokens,
                target.model.lm_head)
        want = probs_from_logits(logits[0, 0], params)
        assert block.probs.shape == want.shape
        assert (block.probs - want).abs().max() < 1e-5
        assert all(block.probs[k, t] > 0 for k, t in enumerate(block.tokens))
        if conf is not None:
            assert (block.confidence_logits - conf[0, 0]).abs().max() < 1e-4


@pytest.mark.parametrize("head,fusion", SHAPES)
def test_greedy_with_random_drafter_equals_plain_greedy_on_tiny_targets(tiny_loaded, head, fusion):
    for name, target in tiny_loaded:
        drafter = make_random_dspark(target, head, block_size=4, fusion=fusion)
        ar, spec = Decoder(target), Decoder(target, drafter)
        for seed in range(3):
            prompt = torch.randint(3, target.cfg.vocab_size, (5 + 7 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
            want = ar.generate(prompt, 40).token_ids
            got = spec.generate(prompt, 40)
            assert got.token_ids == want, f"{name}/{head}/{fusion} diverged"
            assert len(got.rounds) < 40  # drafts were verified and some accepted: not plain AR in disguise


@pytest.mark.parametrize("head", HEADS)
def test_greedy_with_random_drafter_equals_plain_greedy_on_smollm2(smollm2_fp32, head):
    target = smollm2_fp32
    drafter = make_random_dspark(target, head, block_size=4, layers=1, rank=16, std=0.02)
    ar, spec = Decoder(target), Decoder(target, drafter)
    for prompt in [eval_prompts("gsm8k", 1)[0], eval_prompts("humaneval", 1)[0]]:
        ids = target.encode_prompt(prompt)
        assert spec.generate(ids, 32).token_ids == ar.generate(ids, 32).token_ids


def test_first_two_tokens_follow_the_target_distribution_at_t1(tmp_path):
    """Seeded end-to-end runs at T=1 with a Markov drafter: the empirical joint distribution of the
    first two generated tokens matches the target's exact one (total variation < 0.01)."""
    tv, accept = first_two_tokens_tv(tmp_path, "dspark", head="vanilla", block_size=3, rank=4, std=0.5)
    assert 0.1 < accept < 0.9, accept  # drafts accepted and rejected: both paths exercised
    assert tv < 0.01, f"total variation {tv:.4f}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_rope_table_equals_the_computed_values(tiny_loaded, dtype):
    model = make_random_dspark(tiny_loaded[0][1], "vanilla").model.to(dtype)
    for pos in (torch.tensor([[3, 4, 5]]), torch.tensor([[250, 251], [900, 901]]), torch.tensor([[0, 17, 4000]])):
        with torch.inference_mode():  # the table grows past 256, then 1024 positions
            looked_up = model.rope(pos)
        for a, b in zip(looked_up, model.rope(pos)):  # outside inference mode: computed
            assert a.dtype == dtype and a.shape == (pos.shape[0], 1, pos.shape[1], a.shape[-1])
            assert torch.equal(a, b)


@pytest.mark.parametrize("detach", [False, True])
def test_confidence_bce_reaches_the_backbone_unless_the_head_trains_alone(tiny_loaded, detach):
    """DeepSpec lets the confidence BCE train what the head reads (h, W1[prev]); with `detach_inputs`
    (training option conf_into_backbone = false) it trains the confidence head's own weights alone."""
    _, target = tiny_loaded[0]
    drafter = make_random_dspark(target, "vanilla", block_size=4, layers=1)
    model = drafter.model.float().train().requires_grad_(True)
    model.confidence_head.detach_inputs = detach
    tokens = torch.randint(target.cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        out = target.model(torch.tensor([tokens]), target.model.new_cache(1, len(tokens)), taps=drafter.tap_layers)
    _, conf = model.forward_train(out.taps.clone(), torch.tensor([tokens]), torch.tensor([[2, 9, 15]]),
                                  target.model.embed_tokens, target.model.lm_head)
    torch.nn.functional.binary_cross_entropy_with_logits(conf, torch.full_like(conf, 0.7)).backward()
    grads = {n: p.grad is not None and bool(p.grad.abs().sum() > 0) for n, p in model.named_parameters()}
    assert all(g for n, g in grads.items() if n.startswith("confidence_head."))
    others = [n for n, g in grads.items() if g and not n.startswith("confidence_head.")]
    assert (others == []) if detach else any(n.startswith("layers.") for n in others) and any(
        n.startswith("markov_head.") for n in others)
