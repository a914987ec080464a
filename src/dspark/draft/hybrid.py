"""Hybrid proposals: a model drafter's token tree with prompt lookup's continuation as one more
branch (`DRAFTER+lookup`), one request at a time (`LookupBranchDrafter`) or for a batch's rows
(`BatchLookupBranches`). The two succeed on different tokens — lookup on text the context already
holds (code, quoted numbers), the model everywhere else — and a tree verifies both in one pass.

The branch enters growth with estimated survivals (`LOOKUP_SURVIVAL`) in place of draft
probabilities; its tokens are deterministic children, so verification stays exact (DESIGN.md §7b).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark.draft.base import BatchDrafter, DraftBlock, Drafter
from dspark.draft.prompt_lookup import PromptLookupDrafter
from dspark.draft.tree import DraftTree, TreeLimits
from dspark.errors import DsparkError
from dspark.sampling import SamplingParams

# Prompt lookup's conditional acceptance at branch positions 1, 2, 3, 4+ (macro over the five eval sets,
# SmolLM2-135M, benchmarks/results/eval-smollm2/report.md): greedy requests, sampled ones (T = 1)
LOOKUP_SURVIVAL = {True: (0.45, 0.72, 0.81, 0.86), False: (0.20, 0.46, 0.54, 0.67)}
SUFFIX = "+lookup"  # the drafter-name suffix that adds the branch


class LookupBranchDrafter(Drafter):
    """`drafter`'s trees plus the prompt-lookup branch; chains are `drafter`'s own."""

    def __init__(self, drafter: Drafter):
        if type(drafter).propose_tree is Drafter.propose_tree:
            raise DsparkError(f"{type(drafter).__name__} grows no trees: `{SUFFIX}` needs a model drafter")
        self.drafter = drafter
        self.model = getattr(drafter, "model", None)  # the weights that draft (evaluation reads their vocabulary)
        self.lookup = PromptLookupDrafter(drafter.max_drafts)
        self.tap_layers, self.max_drafts = drafter.tap_layers, drafter.max_drafts
        self.temperatures, self.has_confidence = drafter.temperatures, drafter.has_confidence

    def begin(self, prompt_ids: list[int]) -> None:
        self.drafter.begin(prompt_ids)
        self.lookup.begin(prompt_ids)

    def observe(self, tokens: list[int], taps: torch.Tensor | None) -> None:
        self.drafter.observe(tokens, taps)
        self.lookup.observe(tokens, None)

    def propose(self, anchor: int, max_tokens: int, params: SamplingParams, generator: torch.Generator) -> DraftBlock:
        return self.drafter.propose(anchor, max_tokens, params, generator)

    def propose_tree(self, anchor: int, limits: TreeLimits, params: SamplingParams, generator: torch.Generator,
                     branch: Sequence[tuple[int, float]] = ()) -> DraftTree:
        if branch:
            raise DsparkError("a lookup-branch drafter brings its own branch")
        return self.drafter.propose_tree(anchor, limits, params, generator,
                                         lookup_branch(self.lookup, anchor, limits.depth, params))


def lookup_branch(lookup: PromptLookupDrafter, anchor: int, depth: int, params: SamplingParams) -> list[tuple[int, float]]:
    """Prompt lookup's continuation after `anchor` (up to `depth` tokens), as a tree branch: (token,
    estimated survival) per token."""
    survival = LOOKUP_SURVIVAL[params.greedy]
    found = lookup.continuation(anchor, min(depth, lookup.max_drafts))
    return [(t, survival[min(i, len(survival) - 1)]) for i, t in enumerate(found)]


class BatchLookupBranches(BatchDrafter):
    """A batch drafter's trees with each row's prompt-lookup branch (the engine's `DRAFTER+lookup`);
    its chains are the drafter's own."""

    def __init__(self, drafter: BatchDrafter):
        if type(drafter).propose_trees is BatchDrafter.propose_trees:
            raise DsparkError(f"{type(drafter).__name__} grows no trees: `{SUFFIX}` needs a model drafter")
        self.drafter = drafter
        self.tap_layers, self.max_drafts = drafter.tap_layers, drafter.max_drafts
        self.temperatures, self.tree_rows = drafter.temperatures, drafter.tree_rows
        self.lookups: dict[int, PromptLookupDrafter] = {}

    def start(self, row, prompt_ids, taps) -> None:
        self.drafter.start(row, prompt_ids, taps)
        self.lookups[row] = lookup = PromptLookupDrafter(self.max_drafts)
        lookup.observe(list(prompt_ids), None)

    def observe(self, row, tokens, taps) -> None:
        self.drafter.observe(row, tokens, taps)
        self.lookups[row].observe(tokens, None)

    def catch_up(self, rows) -> None:
        self.drafter.catch_up(rows)

    def propose(self, rows, anchors, budgets, params, generators):
        return self.drafter.propose(rows, anchors, budgets, params, generators)

    def propose_trees(self, rows, anchors, limits, params, generators, admit, branches=None):
        if branches is not None:
            raise DsparkError("a lookup-branch drafter brings its own branches")
        branches = [lookup_branch(self.lookups[r], a, lim.depth, p) for r, a, lim, p in zip(rows, anchors, limits, params)]
        return self.drafter.propose_trees(rows, anchors, limits, params, generators, admit, branches)
