"""Hybrid proposals: a model drafter's token tree with prompt lookup's continuation as one more
branch (`DRAFTER+lookup`). The two succeed on different tokens — lookup on text the context already
holds (code, quoted numbers), the model everywhere else — and a tree verifies both in one pass.

The branch enters growth with estimated survivals (`LOOKUP_SURVIVAL`) in place of draft
probabilities; its tokens are deterministic children, so verification stays exact (DESIGN.md §7b).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark.draft.base import DraftBlock, Drafter
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
        survival = LOOKUP_SURVIVAL[params.greedy]
        found = self.lookup.continuation(anchor, min(limits.depth, self.max_drafts))
        branch = [(t, survival[min(i, len(survival) - 1)]) for i, t in enumerate(found)]
        return self.drafter.propose_tree(anchor, limits, params, generator, branch)
