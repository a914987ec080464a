"""Exact losslessness of verification and correctness of the sampling transform."""

import pytest
import torch
from helpers import first_committed_tokens
from helpers import tokens_tv as total_variation

from dspark.decode.verify import verify_chains
from dspark.sampling import SamplingParams, probs_from_logits, sample

CASES = [
    # (target logits, draft logits, params)
    ([2.0, 1.0, 0.5, 0.0, -1.0, -2.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0], SamplingParams(temperature=1.0)),
    ([0.0, 3.0, 0.1, -0.5, 1.0, 0.2], [3.0, 0.0, 0.1, 1.0, -0.5, 0.2], SamplingParams(temperature=0.7)),
    ([1.0, 0.9, 0.8, 0.7, -3.0, 2.0], [2.0, -1.0, 0.8, 1.5, 0.0, 0.0], SamplingParams(temperature=1.0, top_k=3)),
    ([1.0, 0.9, 0.8, 0.7, -3.0, 2.0], [0.0, 1.0, 2.0, 1.5, 0.0, 0.0], SamplingParams(temperature=1.3, top_p=0.8)),
    ([0.5, 2.5, 0.8, 0.7, 1.0, 2.0], [2.5, 0.5, 0.8, 0.1, 0.0, 0.0], SamplingParams(temperature=0.9, top_k=4, top_p=0.9)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("n_draft", [1, 3])
def test_committed_token_follows_target_distribution(case, n_draft):
    t_logits, d_logits, params = CASES[case]
    p_t = probs_from_logits(torch.tensor(t_logits), params)
    p_d = probs_from_logits(torch.tensor(d_logits), params)
    assert total_variation(first_committed_tokens(p_t, p_d, n_draft, seed=case), p_t) < 0.005


@pytest.mark.parametrize("case", range(len(CASES)))
def test_deterministic_drafts_are_lossless(case):
    t_logits, _, params = CASES[case]
    p_t = probs_from_logits(torch.tensor(t_logits), params)
    assert total_variation(first_committed_tokens(p_t, None, 2, seed=10 + case), p_t) < 0.005


def test_greedy_verification_accepts_exactly_the_matching_prefix():
    logits = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 1.0], [0.0, 1.0, 6.0], [9.0, 0.0, 0.0]])
    p_t = probs_from_logits(logits, SamplingParams())
    for drafts, want_acc, want_next in [([1, 0, 2], 3, 0), ([1, 2, 2], 1, 0), ([0, 0, 2], 0, 1), ([1, 0, 1], 2, 2)]:
        acc, nxt = verify_chains(torch.tensor([drafts]), None, p_t[None], torch.tensor([3]), torch.rand(1, 4))
        assert (acc.item(), nxt.item()) == (want_acc, want_next)


def test_verify_respects_per_row_lengths():
    p_t = probs_from_logits(torch.tensor([[0.0, 5.0]] * 4), SamplingParams())
    drafts = torch.ones(2, 3, dtype=torch.long)
    acc, nxt = verify_chains(drafts, None, p_t.expand(2, 4, 2), torch.tensor([3, 1]), torch.rand(2, 4))
    assert acc.tolist() == [3, 1] and nxt.tolist() == [1, 1]


def test_top_k_and_top_p_truncation():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert p[2:].sum() == 0 and torch.isclose(p.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)  # [0.644, 0.237, 0.087, 0.032]
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.85))
    assert (p > 0).tolist() == [True, True, False, False]
    assert torch.allclose(p[:2], full[:2] / full[:2].sum())
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert (p > 0).tolist() == [True, False, False, False]


def test_sampling_never_picks_zero_probability_tokens():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    u = torch.cat([torch.tensor([0.0, 0.5, 0.9999999]), torch.rand(10_000)])
    picked = sample(probs.expand(len(u), 5), u)
    assert set(picked.tolist()) <= {1, 3}


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.01), dict(top_k=-1), dict(temperature=float("nan"))])
def test_invalid_sampling_params_are_rejected(kwargs):
    from dspark.errors import DsparkError

    with pytest.raises(DsparkError):
        SamplingParams(**kwargs)


def test_nucleus_shortcut_equals_the_full_sort():
    """top-p through top-k candidates must keep exactly the tokens a full sort keeps."""
    from dspark.sampling import SamplingParams, probs_from_logits

    gen = torch.Generator().manual_seed(0)
    scales = (0.3, 1.0, 4.0, torch.tensor([[4.0], [0.3], [1.0], [4.0], [0.3], [8.0]]))
    for scale in scales:  # flat rows need the 4096 tier or the full sort, peaked ones not; mixed in one batch
        logits = scale * torch.randn(6, 49152, generator=gen)
        for top_p in (0.5, 0.9, 0.99):
            got = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))
            probs = torch.softmax(logits, -1)
            sorted_p, order = probs.sort(-1, descending=True)
            drop = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, (sorted_p.cumsum(-1) - sorted_p) >= top_p)
            want = probs.masked_fill(drop, 0.0)
            want = want / want.sum(-1, keepdim=True)
            assert torch.equal(got > 0, want > 0)
            assert torch.allclose(got, want, atol=1e-7)


def test_greedy_rows_verify_exactly_as_rejection_sampling_with_one_hot_targets(tiny_targets):
    """The decode step verifies greedy rows by argmax comparison, without distributions; it must
    give exactly what rejection sampling with one-hot target probabilities gives, row by row, in a
    step that mixes greedy and sampled rows and drafts that match the argmax for a while."""
    from dspark.decode.step import DecodeStep, Row
    from dspark.model.loading import load_target
    from dspark.schedule.policies import VerifyAllPolicy

    model = load_target(tiny_targets[0][1], dtype=torch.float32, require_tokenizer=False).model
    step = DecodeStep(model, None, VerifyAllPolicy())
    g = torch.Generator().manual_seed(0)
    R, V = 6, model.cfg.vocab_size
    hidden = torch.randn(R, 5, model.cfg.hidden_size, generator=g)
    argmax = model.logits(hidden).argmax(-1)
    lengths = [0, 4, 2, 4, 3, 1]
    drafts = [argmax[r, : lengths[r]].tolist() for r in range(R)]
    drafts[1][2] = (drafts[1][2] + 1) % V  # row 1 is rejected at its third draft
    greedy = SamplingParams()
    params = [greedy, greedy, SamplingParams(temperature=0.8), greedy, SamplingParams(temperature=1.0), greedy]
    rows = [Row(r, 0, p, torch.Generator().manual_seed(r)) for r, p in enumerate(params)]
    accepted, nxt = step._verify(hidden, rows, [None] * R, drafts, lengths)
    assert accepted[0] == 0 and accepted[1] == 2 and accepted[3] == 4  # the argmax path was taken
    for r in (0, 1, 3, 5):
        want = step._rejection_sample([(Row(r, 0, greedy, torch.Generator().manual_seed(9)), None, drafts[r],
                                        lengths[r], model.logits(hidden[r, : lengths[r] + 1]))])
        assert (accepted[r], nxt[r]) == (want[0][0], want[1][0]), r
