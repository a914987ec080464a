"""The drafter interfaces the decode step talks to.

`Drafter` drafts for one request at a time (prompt lookup, EAGLE-3, a DSpark model with its own
context cache); `BatchDrafter` drafts for all rows of a batch, which is what the decode step calls:
`PerRequestDrafters` adapts a factory of `Drafter`s, and `draft.batched.BatchedDSparkDrafter` drafts every row
in one pass. Drafters only propose (tokens, the exact probabilities they were sampled from,
confidences) and observe committed context; how many drafts are verified is the policy's choice.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

import torch

from dspark.draft.tree import Admit, DraftTree, TreeLimits, chain_tree
from dspark.errors import DsparkError
from dspark.sampling import SamplingParams, argmax_rows, probs_from_logits, sample


@dataclasses.dataclass
class DraftBlock:
    tokens: list[int]
    # Exact probabilities each token was sampled from, [len(tokens), V]; None when the tokens were
    # proposed deterministically (p_d is one-hot on the proposed token).
    probs: torch.Tensor | None = None
    # Raw confidence-head logits, [len(tokens)], for drafters that have one.
    confidence_logits: torch.Tensor | None = None


class Drafter(abc.ABC):
    """Proposes blocks of draft tokens for one request at a time.

    Call order per request: `begin(prompt)`, `observe(prompt tokens, taps)`, then per round
    `propose(anchor, ...)` followed by `observe(committed tokens, taps)`. Committed tokens are
    those whose target K/V stayed in the cache: the anchor plus the accepted drafts.
    """

    #: target decoder layers whose outputs `observe` needs (empty: none).
    tap_layers: tuple[int, ...] = ()
    #: the most drafts one `propose` returns.
    max_drafts: int = 8
    #: per-position STS temperatures of the confidence logits (None: uncalibrated or no head).
    temperatures: list[float] | None = None
    #: whether `propose` returns confidence logits (policies that read survivals need them).
    has_confidence: bool = False

    @abc.abstractmethod
    def begin(self, prompt_ids: list[int]) -> None: ...

    @abc.abstractmethod
    def observe(self, tokens: list[int], taps: torch.Tensor | None) -> None:
        """`tokens` were committed; `taps` [len(tokens), m, H] are their tapped target features."""

    @abc.abstractmethod
    def propose(
        self, anchor: int, max_tokens: int, params: SamplingParams, generator: torch.Generator
    ) -> DraftBlock:
        """Draft up to `max_tokens` tokens following `anchor` (the last sampled, uncommitted token)."""

    def propose_tree(self, anchor: int, limits: TreeLimits, params: SamplingParams,
                     generator: torch.Generator, branch: Sequence[tuple[int, float]] = ()) -> DraftTree:
        """A token tree within `limits` (`draft/tree.py`), with `branch` as its first path when given;
        a drafter without a tree of its own proposes its chain (and takes no branch)."""
        if branch:
            raise DsparkError(f"{type(self).__name__} grows no trees: it cannot take a prompt-lookup branch")
        if min(limits.depth, limits.nodes) < 1:
            return DraftTree([], [])
        block = self.propose(anchor, min(limits.depth, limits.nodes), params, generator)
        return chain_tree(block.tokens, block.probs)


def token_picker(params: SamplingParams, generator: torch.Generator):
    """`pick(logits [k, V]) -> k tokens`: argmax when greedy, else sampled from the processed
    distribution, whose rows are appended to the returned list (the exact p_d for verification)."""
    probs: list[torch.Tensor] = []

    def pick(logits: torch.Tensor) -> list[int]:
        if params.greedy:
            return argmax_rows(logits)
        p = probs_from_logits(logits, params)
        probs.append(p)
        return sample(p, torch.rand(p.shape[0], generator=generator)).tolist()

    return pick, probs


class BatchDrafter(abc.ABC):
    """Drafts for the rows of a batch (cache rows). Per row: `start` once its prompt is prefilled,
    then per step `propose` for the rows that draft and `observe` of each row's committed tokens."""

    tap_layers: tuple[int, ...] = ()
    max_drafts: int = 8
    temperatures: list[float] | None = None
    tree_rows = 0  # how many rows one step may grow token trees for (`propose_trees`; 0: none)

    @abc.abstractmethod
    def start(self, row: int, prompt_ids: list[int], taps: torch.Tensor | None) -> None:
        """A request takes `row`; `taps` [len(prompt), m, H] are its prompt's tapped target features."""

    @abc.abstractmethod
    def propose(self, rows: list[int], anchors: list[int], budgets: list[int], params: list[SamplingParams],
                generators: list[torch.Generator]) -> list[DraftBlock | None]:
        """Up to `budgets[i]` drafts after `anchors[i]` for each row (None: no draft)."""

    @abc.abstractmethod
    def observe(self, row: int, tokens: list[int], taps: torch.Tensor | None) -> None:
        """`tokens` of `row` were committed (the anchor and its accepted drafts)."""

    def propose_trees(self, rows: list[int], anchors: list[int], limits: list[TreeLimits],
                      params: list[SamplingParams], generators: list[torch.Generator],
                      admit: Admit | None, branches: list[Sequence[tuple[int, float]]] | None = None) -> list[DraftTree]:
        """A token tree per row within its `limits`, grown while `admit` (over all rows' drafts) says so;
        `branches[i]`: row i's given first path (`TreeGrowth`'s `branch`), if any."""
        raise NotImplementedError(f"{type(self).__name__} grows no trees")

    def catch_up(self, rows: list[int]) -> None:  # noqa: B027 (a no-op unless the drafter defers work)
        """Do the work `observe` deferred for `rows` (a lazy drafter's context K/V), before `propose`.
        Timed apart: it is owed to the tokens committed earlier, not to this step's drafts."""


class PerRequestDrafters(BatchDrafter):
    """One `Drafter` per row, made by `make_drafter` when a request takes the row."""

    tree_rows = 1  # a lone request's drafter grows its tree (a batch's rows verify chains)

    def __init__(self, make_drafter):
        self.make_drafter = make_drafter
        self._spare = make_drafter()  # the first row's drafter; it also tells the taps and limits
        self.tap_layers = tuple(self._spare.tap_layers)
        self.max_drafts = self._spare.max_drafts
        self.temperatures = self._spare.temperatures
        self.drafters: dict[int, Drafter] = {}

    def start(self, row, prompt_ids, taps):
        drafter, self._spare = self._spare or self.make_drafter(), None
        drafter.begin(prompt_ids)
        drafter.observe(list(prompt_ids), taps)
        self.drafters[row] = drafter

    def propose(self, rows, anchors, budgets, params, generators):
        return [self.drafters[r].propose(a, n, p, g) if n > 0 else None
                for r, a, n, p, g in zip(rows, anchors, budgets, params, generators)]

    def propose_trees(self, rows, anchors, limits, params, generators, admit, branches=None):
        (row,), (anchor,), (lim,), (p,), (g,) = rows, anchors, limits, params, generators
        return [self.drafters[row].propose_tree(anchor, dataclasses.replace(lim, admit=admit), p, g,
                                                branches[0] if branches else ())]

    def observe(self, row, tokens, taps):
        self.drafters[row].observe(tokens, taps)
