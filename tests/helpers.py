"""Tiny random-weight targets and test drafters shared by the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from dspark.draft.base import DraftBlock, Drafter
from dspark.draft.tree import DraftTree
from dspark.sampling import SamplingParams

EVAL_DIR = Path(__file__).resolve().parents[1] / "src" / "dspark" / "eval" / "data"


def eval_prompts(name: str, n: int) -> list[str]:
    with open(EVAL_DIR / f"{name}.jsonl") as f:
        return [json.loads(line)["turns"][0] for line, _ in zip(f, range(n))]


def make_tiny_hf_model(
    family: str, out_dir: Path, tie: bool = False, vocab: int = 128, seed: int = 0, layers: int = 4, hidden: int = 64,
    max_positions: int = 512,
) -> Path:
    """Write a random tiny HF checkpoint (safetensors) of a supported family; returns its directory."""
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    elif family == "qwen3":
        cfg, cls = transformers.Qwen3Config(head_dim=32, **common), transformers.Qwen3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: make every weight matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


class RandomDrafter(Drafter):
    """Proposes uniformly random tokens (one-hot p_d): losslessness must not depend on draft quality."""

    def __init__(self, vocab_size: int, num_draft_tokens: int = 4, seed: int = 0):
        self.vocab_size = vocab_size
        self.k = num_draft_tokens
        self.gen = torch.Generator().manual_seed(seed)

    def begin(self, prompt_ids):
        pass

    def observe(self, tokens, taps):
        pass

    def propose(self, anchor, max_tokens, params: SamplingParams, generator):
        n = min(self.k, max_tokens)
        return DraftBlock(tokens=torch.randint(self.vocab_size, (n,), generator=self.gen).tolist())


class BranchOracle(Drafter):
    """Trees whose accepted path runs through the *last* child at every level, behind (up to) two decoys
    within the node budget: the target's own greedy `continuation` of a `prompt_len`-token prompt,
    known in advance (3 levels)."""

    def __init__(self, continuation: list[int], prompt_len: int, vocab: int):
        self.continuation, self.prompt_len, self.vocab, self.done = continuation, prompt_len, vocab, 0

    def begin(self, prompt_ids):
        self.done = 0

    def observe(self, tokens, taps):
        self.done += len(tokens)

    def propose(self, anchor, max_tokens, params, generator):
        return DraftBlock([])

    def propose_tree(self, anchor, limits, params, generator, branch=()):
        assert not branch, "the oracle takes no given branch"
        tokens, parents, parent = [], [], -1
        truth = self.continuation[self.done - self.prompt_len + 1:][: min(3, limits.depth)]
        for t in truth:
            decoys = min(2, limits.nodes - len(tokens) - 1)
            if decoys < 0:
                break
            for x in [(t + 1 + i) % self.vocab for i in range(decoys)] + [t]:  # decoys, then the truth
                tokens.append(x)
                parents.append(parent)
            parent = len(tokens) - 1
        return DraftTree(tokens, parents)


def toy_expand(first: torch.Tensor, second: torch.Tensor | None):
    """A two-level toy drafter for `grow_tree`: logits `first` after the anchor, `second[x]` after token x."""
    return lambda node, depth, token, state: ((first if depth == 0 else second[token]), None)


def joint_tree_trials(seed: int, trials: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`trials` rounds of sampled two-level tree growth (V = 5, T 0.9, top-k 4, top-p 0.9, two children
    per node, six nodes, a given two-token branch 3 -> 2 as prompt lookup brings: both the drafter's
    favourites, the second one the target never takes) and recursive rejection sampling against a
    fixed two-step target: each round's first two committed tokens as a * 5 + b (the second drawn
    from the target where a round commits one), and the target's exact joint distribution of them.
    Module-level, so a process pool can run it."""
    from dspark.decode.verify import verify_tree_sampled
    from dspark.draft.tree import TreeLimits, grow_tree
    from dspark.sampling import probs_from_logits

    torch.set_num_threads(1)
    V, params = 5, SamplingParams(temperature=0.9, top_k=4, top_p=0.9)
    torch.manual_seed(0)  # the same toy drafter and target in every process
    d1, d2, t1, t2 = torch.randn(V), torch.randn(V, V), torch.randn(V), torch.randn(V, V)
    p1, p2 = probs_from_logits(t1, params), probs_from_logits(t2, params)
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(trials, dtype=torch.long)
    for i in range(trials):
        tree = grow_tree(toy_expand(d1, d2), 0, TreeLimits(6, 2, 2), params, g, branch=[(3, 0.6), (2, 0.5)])
        path, nxt = verify_tree_sampled(tree, torch.stack([p1] + [p2[x] for x in tree.tokens]), g)
        committed = [tree.tokens[n] for n in path] + [nxt]
        if len(committed) == 1:
            committed.append(int(torch.multinomial(p2[committed[0]], 1, generator=g)))
        out[i] = committed[0] * V + committed[1]
    return out, (p1[:, None] * p2).flatten()


def _random_drafter(cfg, target, seed: int, std: float, draft_vocab: list[int] | None = None):
    """Init `cfg`'s model with weights large enough that every part visibly matters (the default
    0.02 init makes the heads near no-ops), perturb the norms, and wrap it for inference.
    `draft_vocab`: the target tokens of a reduced draft vocabulary (sorted)."""
    import dataclasses

    from dspark.draft.checkpoint import new_model, wrap_drafter

    torch.manual_seed(seed)
    if draft_vocab is not None:
        cfg = dataclasses.replace(cfg, draft_vocab_size=len(draft_vocab))
    model = new_model(cfg)
    if draft_vocab is not None:
        model.set_draft_vocab(torch.tensor(draft_vocab))
    model.reset_parameters(std)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name == "layer_fusion_weights":
                p.add_(0.2 * torch.randn_like(p) if name.endswith("norm.weight") else torch.randn_like(p))
    return wrap_drafter(model.to(target.model.dtype).requires_grad_(False), target)


def make_random_dspark(target, head: str = "vanilla", block_size: int = 4, layers: int = 1, rank: int = 8,
                       confidence: bool = True, seed: int = 0, std: float = 0.15, draft_vocab: list[int] | None = None,
                       fusion: str = "shared"):
    """A randomly initialised DSpark drafter for `target` (over `draft_vocab` only, if given;
    `fusion`: its context fusion)."""
    from dspark.draft.checkpoint import new_draft_config

    cfg = new_draft_config(target, block_size=block_size, num_hidden_layers=layers, markov_head_type=head,
                           markov_rank=rank, enable_confidence_head=confidence, context_fusion=fusion)
    return _random_drafter(cfg, target, seed, std, draft_vocab)


def make_tiny_regen_data(target, path: Path, n: int = 40, prompt_len: int = 6, new_tokens: int = 40, seed: int = 0) -> Path:
    """Regenerated-data JSONL for a tokenizer-less tiny target: the target's own T=1 samples."""
    from dspark.decode.generate import Decoder

    gen = torch.Generator().manual_seed(seed)
    dec = Decoder(target)
    with open(path, "w") as f:
        for i in range(n):
            prompt = torch.randint(3, target.cfg.vocab_size, (prompt_len,), generator=gen).tolist()
            out = dec.generate(prompt, new_tokens, SamplingParams(temperature=1.0), seed=seed * 1000 + i)
            f.write(json.dumps({"id": f"s{i}", "prompt_ids": prompt, "response_ids": out.token_ids}) + "\n")
    return path


def make_random_eagle3(target, block_size: int = 4, seed: int = 0, std: float = 0.15,
                       draft_vocab: list[int] | None = None):
    """A randomly initialised EAGLE-3 drafter for `target` (over `draft_vocab` only, if given)."""
    from dspark.draft.checkpoint import new_draft_config

    return _random_drafter(new_draft_config(target, block_size=block_size, kind="eagle3"), target, seed, std,
                           draft_vocab)


def tiny_sharp_target(tmp_path: Path):
    """A tiny 4-token, 2-layer llama target without EOS and with sharpened logits: its 16-outcome
    joint distribution of two tokens is estimable from ~10k seeded runs (sum of sqrt(p(1-p)) = 1.28,
    so the expected sampling noise is TV ~0.005)."""
    import dataclasses

    from dspark.model.loading import load_target

    target = load_target(make_tiny_hf_model("llama", tmp_path / "v4", vocab=4, layers=2, hidden=32),
                         dtype=torch.float32, pack=False, require_tokenizer=False)
    target = dataclasses.replace(target, eos_token_ids=frozenset())
    with torch.no_grad():
        target.model.lm_head.mul_(3.0)
    return target


TV_PROMPT = [2, 3, 2, 1]


def exact_first_two(target, params) -> torch.Tensor:
    """The target's exact joint distribution of the first two tokens after TV_PROMPT, flattened."""
    from dspark.sampling import probs_from_logits

    m, vocab = target.model, target.cfg.vocab_size
    exact = torch.zeros(vocab, vocab, dtype=torch.float64)
    p1 = probs_from_logits(m.logits(m(torch.tensor([TV_PROMPT]), m.new_cache(1, 8)).hidden[0, -1]), params)
    for a in range(vocab):
        p2 = probs_from_logits(m.logits(m(torch.tensor([TV_PROMPT + [a]]), m.new_cache(1, 8)).hidden[0, -1]), params)
        exact[a] = p1[a].double() * p2.double()
    return exact.flatten()


def total_variation(samples: list[list[int]], exact: torch.Tensor, vocab: int) -> float:
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    for ids in samples:
        counts[ids[0] * vocab + ids[1]] += 1
    return 0.5 * (counts / len(samples) - exact).abs().sum().item()


def first_two_tokens_tv(tmp_path: Path, kind: str, n: int = 10_000, **drafter_kw) -> tuple[float, float]:
    """Seeded speculative runs at T=1 through the single-request Decoder on the tiny sharp target, the
    drafter `make_random_<kind>(target, **drafter_kw)` (kind: dspark or eagle3): total variation of the
    first two generated tokens from the exact joint, and the acceptance rate of the one draft verified
    for token 2. The seeds run in two processes (the CI machine's two cores)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        parts = list(pool.map(first_two_tokens, [tmp_path / "a", tmp_path / "b"], [kind] * 2,
                              [range(0, n, 2), range(1, n, 2)], [drafter_kw] * 2))
    samples = [ids for part, _ in parts for ids in part]
    target = tiny_sharp_target(tmp_path / "exact")
    exact = exact_first_two(target, SamplingParams(temperature=1.0))
    return total_variation(samples, exact, 4), sum(accepted for _, accepted in parts) / n


def first_two_tokens(tmp: Path, kind: str, seeds: range, drafter_kw: dict) -> tuple[list[list[int]], int]:
    """The first two tokens of T=1 runs seeded `seeds` and how many of their round-1 drafts were
    accepted (module-level, so a process pool can run it)."""
    from dspark.decode.generate import Decoder

    torch.set_num_threads(1)
    target = tiny_sharp_target(tmp)
    make = {"dspark": make_random_dspark, "eagle3": make_random_eagle3}[kind]
    spec = Decoder(target, make(target, **drafter_kw))
    samples, accepted = [], 0
    for seed in seeds:
        r = spec.generate(TV_PROMPT, 3, SamplingParams(temperature=1.0), seed=seed)  # round 1 verifies token 2's draft
        samples.append(r.token_ids)
        accepted += r.rounds[0].accepted
    return samples, accepted


# ---- verification, one step, many trials -----------------------------------------------------
def first_committed_tokens(p_t: torch.Tensor, p_d: torch.Tensor | None, n_draft: int, seed: int,
                           N: int = 200_000) -> torch.Tensor:
    """Run N independent verification steps; return each step's first committed token.

    p_t / p_d: [V] distributions (the same at every position, so the first committed token must be
    distributed exactly as p_t). p_d None = deterministic drafts of token 0 (one-hot p_d)."""
    from dspark.decode.verify import verify_chains
    from dspark.sampling import sample

    g = torch.Generator().manual_seed(seed)
    V = p_t.shape[-1]
    if p_d is None:
        drafts = torch.zeros(N, n_draft, dtype=torch.long)
        draft_probs = None
    else:
        drafts = sample(p_d.expand(N, n_draft, V), torch.rand(N, n_draft, generator=g))
        draft_probs = p_d.expand(N, n_draft, V)
    accepted, nxt = verify_chains(
        drafts, draft_probs, p_t.expand(N, n_draft + 1, V), torch.full((N,), n_draft), torch.rand(N, n_draft + 1, generator=g)
    )
    return torch.where(accepted > 0, drafts[:, 0], nxt)


def tokens_tv(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Total variation between the empirical distribution of `tokens` and `p` [V]."""
    emp = torch.bincount(tokens, minlength=p.shape[0]).double() / tokens.numel()
    return 0.5 * (emp - p.double()).abs().sum().item()


# ---- the `dspark` command ---------------------------------------------------------------------
def run_cli(*args, env_extra=None, timeout=300):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "dspark.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def assert_clean_error(proc, needle):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0], lines[0]


def start_cli(*args, env=None) -> subprocess.Popen:
    """`dspark ARGS` in the background (pipes for stdout / stderr), for tests that kill it."""
    return subprocess.Popen([sys.executable, "-m", "dspark.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
