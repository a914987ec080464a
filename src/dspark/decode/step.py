"""The decode step every loop runs: draft -> schedule -> verify -> commit, for a batch of rows.

The single-request `Decoder` is this step with one row; the batched `Engine` adds slots and
admission around it; `dspark eval` and regeneration run on those two. `start` prefills a row; one step:
  1. draft: unless the policy (from past steps only) finds drafting does not pay, the drafter
     proposes up to `budget` tokens per row, with the exact probabilities it sampled them from;
  2. schedule: the policy picks ℓ_r drafts to verify per row, reading calibrated prefix survivals
     lazily (lossless, DESIGN.md §7);
  3. verify: one ragged target forward (row r holds 1 + ℓ_r tokens) and one batched rejection-sampling
     call, each row drawing from its own generator;
  4. commit: cache rows roll back to their committed lengths, the drafter observes the committed
     tokens, the policy records the step.
A row's sample path depends on its own generator alone, never on which rows share its batch. With a
`PrefixCache`, `start` prefills only what the cache does not hold of a prompt. A lone
request under a tree policy drafts, verifies and commits a token tree instead (`_tree_step`, DESIGN.md §7b).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from dspark.decode.prefix_cache import PrefixCache
from dspark.decode.verify import verify_chains, verify_tree_greedy, verify_tree_sampled
from dspark.draft.base import BatchDrafter, DraftBlock
from dspark.draft.tree import DraftTree, TreeLimits
from dspark.sampling import SamplingParams, argmax_rows, probs_from_logits, sample
from dspark.schedule.policies import Policy
from dspark.schedule.survival import AcceptanceEstimate, prefix_survival


@dataclasses.dataclass
class Round:
    """One verification round of one request."""

    verified: int  # draft tokens verified (ℓ)
    accepted: int  # of which accepted
    confidence_logits: list[float] | None = None  # raw confidence logits of the verified drafts
    nodes: int | None = None  # a tree round: its drafts (then `verified` is its depth, the longest path)

    @property
    def computed(self) -> int:
        """Draft tokens the verify forward computed."""
        return self.verified if self.nodes is None else self.nodes


def drafts_per_round(rounds: list[Round]) -> float:
    """Draft tokens the target verified per round (a tree's nodes, a chain's verified drafts)."""
    return sum(r.computed for r in rounds) / len(rounds) if rounds else 0.0


@dataclasses.dataclass
class Row:
    """A request in flight in cache row `index`; `anchor` is its last sampled token, not yet cached."""

    index: int
    anchor: int
    params: SamplingParams
    generator: torch.Generator
    budget: int = 0  # drafts it may verify this step (the next token always comes on top)
    cached: int = 0  # prompt tokens its prefill took from the prefix cache


@dataclasses.dataclass
class RowResult:
    round: Round
    tokens: list[int]  # committed by this step: the accepted drafts, then the next anchor


def keep_path(view, committed: int, rows: list[int]) -> None:
    """Move the K/V of a verified tree's accepted path (its forward rows, in slots `committed + row`)
    to the slots right after the anchor's, `committed + 1..`, in every layer of the one-row cache `view`."""
    if rows != list(range(1, len(rows) + 1)):
        src = committed + torch.tensor(rows)
        for kv in view.kv:
            kv[:, :, committed + 1 : committed + 1 + len(rows)] = kv[:, :, src]


def draft_budget(tokens_left: int, room: int) -> int:
    """Drafts a row may verify: the next token always comes on top, within what is left of its
    budget and of its room in the cache."""
    return max(0, min(tokens_left, room) - 1)


class DecodeStep:
    """The step for a target model, an optional drafter and a verification policy."""

    def __init__(self, model, drafter: BatchDrafter | None, policy: Policy, prefix_cache_bytes: int = 0):
        self.model, self.policy = model, policy
        self.drafter = drafter if policy.drafts else None  # plain AR: no drafter to run or feed
        self.taps = tuple(self.drafter.tap_layers) if self.drafter else ()
        self.prefix_cache = PrefixCache(prefix_cache_bytes, with_taps=bool(self.taps)) if prefix_cache_bytes else None
        self.estimate = AcceptanceEstimate(self.drafter.max_drafts if self.drafter else 1)
        self.steps = 0
        self.draft_s = 0.0  # seconds spent in drafting passes
        self.verify_s = 0.0  # seconds spent in verify forwards, rejection sampling and commits
        self.drafted_last = False  # whether the last step drafted: its catch-up is then drafting's own

    @torch.inference_mode()
    def start(self, cache, index: int, prompt_ids: list[int], params: SamplingParams,
              generator: torch.Generator) -> Row:
        """A request takes cache row `index`: run its prompt in (what the prefix cache does not hold of
        it), sample its first token (the row's anchor) and hand the prompt's tapped features to the drafter."""
        view = cache.row(index)
        view.lengths.zero_()
        cached, cached_taps = 0, None
        if self.prefix_cache is not None:
            cached, cached_taps = self.prefix_cache.restore(prompt_ids, view)
        out = self.model(torch.tensor([prompt_ids[cached:]]), view, taps=self.taps)
        cache.lengths[index] = int(view.lengths[0])
        taps = out.taps[0] if self.taps else None
        if cached_taps is not None:
            taps = torch.cat([cached_taps, taps])
        if self.prefix_cache is not None:
            self.prefix_cache.store(prompt_ids, view, taps, start=cached)
        probs = probs_from_logits(self.model.logits(out.hidden[0, -1:]), params)
        token = int(sample(probs, torch.rand(1, generator=generator))[0])
        if self.drafter is not None:
            self.drafter.start(index, prompt_ids, taps)
        return Row(index, token, params, generator, cached=cached)

    @torch.inference_mode()
    def __call__(self, cache, rows: list[Row]) -> list[RowResult]:
        drafted = self.drafter is not None and self.policy.should_draft(len(rows))  # from past steps only
        if drafted and self.policy.tree_nodes and len(rows) <= self.drafter.tree_rows:
            return self._tree_step(cache, rows)
        t_begin = time.perf_counter()
        blocks, draft_s, owed_s = self._draft(rows) if drafted else ([None] * len(rows), 0.0, 0.0)
        drafts = [b.tokens[: r.budget] if b else [] for b, r in zip(blocks, rows)]
        lengths = self._schedule(blocks, drafts)
        t0 = time.perf_counter()
        committed, out, computed = self._forward(cache, rows, drafts, lengths)
        accepted, nxt = self._verify(out.hidden, rows, blocks, drafts, lengths)
        for r, a in zip(rows, accepted):
            committed[r.index] += 1 + a
        cache.truncate(committed)
        results = []
        for r, blk, d, ell, a, t in zip(rows, blocks, drafts, lengths, accepted, nxt):
            if self.drafter:
                self.drafter.observe(r.index, [r.anchor] + d[:a], out.taps[r.index, : a + 1] if self.taps else None)
            conf = blk.confidence_logits if blk is not None else None
            if blk is not None and conf is None:
                self.estimate.update(ell, a)
            results.append(RowResult(Round(ell, a, None if conf is None else conf[:ell].tolist()), d[:a] + [t]))
        t_end = time.perf_counter()
        self.policy.record_step(len(rows), drafted, computed, sum(len(x.tokens) for x in results), draft_s,
                                t_end - t_begin - self._owed_elsewhere(owed_s))
        self.drafted_last = drafted
        self.draft_s += draft_s + owed_s
        self.verify_s += t_end - t0
        return results

    def _tree_step(self, cache, rows: list[Row]) -> list[RowResult]:
        """Each row verifies a token tree (grown together: DESIGN.md §7b), all in one target forward;
        the accepted paths' K/V move into place behind the committed context, the rest is dropped."""
        t0 = time.perf_counter()
        self.drafter.catch_up([r.index for r in rows])
        t1 = time.perf_counter()
        committed = [int(cache.lengths[r.index]) for r in rows]
        limits = [TreeLimits(nodes=min(self.policy.tree_nodes, cache.max_len - c - 1), depth=r.budget)
                  for r, c in zip(rows, committed)]
        trees = self.drafter.propose_trees([r.index for r in rows], [r.anchor for r in rows], limits,
                                           [r.params for r in rows], [r.generator for r in rows],
                                           self.policy.tree_admit(len(rows)))
        t2 = time.perf_counter()
        hidden, taps = self._forward_trees(cache, rows, trees)
        sizes = [1 + len(t) for t in trees]  # one LM-head product over every row's anchor and nodes
        logits = self.model.logits(torch.cat([hidden[i, :n] for i, n in enumerate(sizes)])).split(sizes)
        results = []
        for i, (r, tree, c) in enumerate(zip(rows, trees, committed)):
            path, nxt = self._verify_tree(tree, logits[i], r)
            kept = [1 + n for n in path]  # the accepted nodes' forward rows (and cache slots past `c`)
            keep_path(cache.row(r.index), c, kept)
            cache.lengths[r.index] = c + 1 + len(path)
            tokens = [tree.tokens[n] for n in path]
            self.drafter.observe(r.index, [r.anchor] + tokens, taps[i, [0] + kept] if self.taps else None)
            results.append(RowResult(Round(max(tree.depths(), default=0), len(path), nodes=len(tree)), tokens + [nxt]))
        t_end = time.perf_counter()
        self.policy.record_step(len(rows), True, sum(1 + len(t) for t in trees),
                                sum(len(x.tokens) for x in results), t2 - t1, t_end - t0 - self._owed_elsewhere(t1 - t0))
        self.drafted_last = True
        self.draft_s += t2 - t0
        self.verify_s += t_end - t2
        return results

    def _forward_trees(self, cache, rows: list[Row], trees: list[DraftTree]):
        """One forward of every row's [anchor, tree nodes]: (hidden [R, q, H], taps [R, q, m, H] or
        None) in `rows` order. A lone row runs its whole cache row (the compiled runner's path); more
        run ragged (`_ragged_forward`)."""
        if len(rows) == 1:
            (row,), (tree,) = rows, trees
            self.steps += 1
            out = self.model(torch.tensor([[row.anchor] + tree.tokens]), cache.row(row.index), taps=self.taps,
                             tree=tree.attention())
            return out.hidden, out.taps
        out, _ = self._ragged_forward(cache, rows, [[r.anchor] + t.tokens for r, t in zip(rows, trees)], trees)
        index = torch.tensor([r.index for r in rows])
        return out.hidden[index], out.taps[index] if self.taps else None

    @staticmethod
    def _verify_tree(tree: DraftTree, logits: torch.Tensor, row: Row) -> tuple[list[int], int]:
        """(accepted nodes, next token) from the target's logits after the anchor and every node."""
        if row.params.greedy:
            return verify_tree_greedy(tree.children(), tree.tokens, argmax_rows(logits))
        return verify_tree_sampled(tree, probs_from_logits(logits, row.params), row.generator)

    def _owed_elsewhere(self, catch_up_s: float) -> float:
        """The part of a step's catch-up its timing leaves out. After a drafting step, catching up on
        what it committed (and on prompts that joined) is what drafting at every step costs, and the
        step pays it. After plain steps it is their backlog, owed to them: counting it made the gate of a
        server think drafting never pays, and drafting less only grows the backlog."""
        return 0.0 if self.drafted_last else catch_up_s

    def _draft(self, rows: list[Row]) -> tuple[list[DraftBlock | None], float, float]:
        """(the rows' draft blocks, seconds of the proposal, seconds of catching up on earlier tokens)."""
        t0 = time.perf_counter()
        self.drafter.catch_up([r.index for r in rows if r.budget > 0])
        t1 = time.perf_counter()
        blocks = self.drafter.propose([r.index for r in rows], [r.anchor for r in rows], [r.budget for r in rows],
                                      [r.params for r in rows], [r.generator for r in rows])
        return blocks, time.perf_counter() - t1, t1 - t0

    def _schedule(self, blocks: list[DraftBlock | None], drafts: list[list[int]]) -> list[int]:
        drafted = [len(d) for d in drafts]
        survivals = [[] for _ in drafted]
        if self.policy.needs_survivals:
            temps = self.drafter.temperatures if self.drafter else None
            survivals = [prefix_survival(b.confidence_logits[:n].tolist(), temps)
                         if b is not None and b.confidence_logits is not None else self.estimate.survivals(n)
                         for b, n in zip(blocks, drafted)]
        return [min(ell, n) for ell, n in zip(self.policy.lengths(survivals, drafted), drafted)]

    def _forward(self, cache, rows, drafts, lengths):
        """(committed lengths before the step, the forward's output, positions computed): row r holds
        [anchor, ℓ_r drafts] in one ragged forward."""
        out, num_new = self._ragged_forward(cache, rows, [[r.anchor] + d[:ell] for r, d, ell in zip(rows, drafts, lengths)])
        committed = cache.lengths.clone()
        committed[: num_new.shape[0]] -= num_new
        return committed, out, int(num_new.sum())

    def _ragged_forward(self, cache, rows: list[Row], tokens: list[list[int]], trees: list[DraftTree] | None = None):
        """One forward over the cache rows up to the last one in use, row r bringing `tokens[i]`
        right-padded (rows between without a request are reset and bring none; the target computes the
        real tokens alone), each row's token tree under `trees` if given. Returns (output, tokens per row [B])."""
        B, q = 1 + max(r.index for r in rows), max(map(len, tokens))
        ids = torch.zeros(B, q, dtype=torch.long)
        num_new = torch.zeros(B, dtype=torch.long)
        for r, t in zip(rows, tokens):
            ids[r.index, : len(t)] = torch.tensor(t)
            num_new[r.index] = len(t)
        tree = None
        if trees is not None:
            depth = torch.zeros(B, q, dtype=torch.long)
            visible = torch.eye(q, dtype=torch.bool).repeat(B, 1, 1)  # padding sees itself only
            for r, t in zip(rows, trees):
                n = 1 + len(t)
                depth[r.index, :n], visible[r.index, :n, :n] = t.attention()
            tree = (depth, visible)
        idle = torch.ones(cache.batch_size, dtype=torch.bool)
        idle[[r.index for r in rows]] = False
        cache.lengths[idle] = 0
        view = cache.rows(0, B) if B < cache.batch_size else cache
        out = self.model(ids, view, num_new=num_new, taps=self.taps, tree=tree)
        if view is not cache:
            cache.lengths[:B] = view.lengths
        self.steps += 1
        return out, num_new

    def _verify(self, hidden, rows, blocks, drafts, lengths) -> tuple[list[int], list[int]]:
        """(accepted drafts, next token) per row, from one LM-head product over the verified positions
        of every row. Greedy rows need no probabilities: verification at temperature 0 accepts while a
        draft equals the target's argmax and commits the argmax after it (what rejection sampling with
        one-hot p_t does, without the [ℓ + 1, V] distributions); sampled rows share one
        rejection-sampling call."""
        logits = self.model.logits(torch.cat([hidden[r.index, : ell + 1] for r, ell in zip(rows, lengths)]))
        offsets = [0]
        for ell in lengths:
            offsets.append(offsets[-1] + ell + 1)
        accepted, nxt = [0] * len(rows), [0] * len(rows)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if greedy:
            best = argmax_rows(logits)  # every row's, in one call: cheaper than gathering the greedy ones
            for i in greedy:
                a, d, at = 0, drafts[i], offsets[i]
                while a < lengths[i] and d[a] == best[at + a]:
                    a += 1
                accepted[i], nxt[i] = a, best[at + a]
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            got = self._rejection_sample([(rows[i], blocks[i], drafts[i], lengths[i],
                                           logits[offsets[i] : offsets[i + 1]]) for i in sampled])
            for i, (a, t) in zip(sampled, zip(*got)):
                accepted[i], nxt[i] = a, t
        return accepted, nxt

    def _rejection_sample(self, chains) -> tuple[list[int], list[int]]:
        """(accepted, next token) of sampled rows, each chain (row, block, drafts, ℓ, logits [ℓ + 1, V]),
        in one rejection-sampling call, each row drawing from its own generator."""
        R, L = len(chains), max(ell for _, _, _, ell, _ in chains)
        V = self.model.cfg.vocab_size
        tokens = torch.zeros(R, L, dtype=torch.long)
        uniforms = torch.zeros(R, L + 1)
        # positions past a row's ℓ are never read (verify masks them): no need to clear them
        target_probs = torch.empty(R, L + 1, V)
        sampled = any(b is not None and b.probs is not None for _, b, _, ell, _ in chains if ell)
        draft_probs = torch.empty(R, L, V) if sampled else None
        for params, members in _by_params(chains).items():  # one call per setting: its rows' ops batch
            probs = probs_from_logits(torch.cat([chains[i][4] for i in members]), params)
            at = 0
            for i in members:
                n = chains[i][3] + 1
                target_probs[i, :n] = probs[at : at + n]
                at += n
        for i, (r, blk, d, ell, logits) in enumerate(chains):
            tokens[i, :ell] = torch.tensor(d[:ell], dtype=torch.long)
            uniforms[i, : ell + 1] = torch.rand(ell + 1, generator=r.generator)
            if draft_probs is not None and ell:
                if blk.probs is not None:
                    draft_probs[i, :ell] = blk.probs[:ell]
                else:  # proposed deterministically: one-hot p_d
                    draft_probs[i, :ell].zero_()
                    draft_probs[i, torch.arange(ell), tokens[i, :ell]] = 1.0
        lengths = torch.tensor([ell for _, _, _, ell, _ in chains])
        accepted, nxt = verify_chains(tokens, draft_probs, target_probs, lengths, uniforms)
        return accepted.tolist(), nxt.tolist()


def _by_params(chains) -> dict[SamplingParams, list[int]]:
    """The chains' indices grouped by their rows' sampling settings."""
    groups: dict[SamplingParams, list[int]] = {}
    for i, chain in enumerate(chains):
        groups.setdefault(chain[0].params, []).append(i)
    return groups
