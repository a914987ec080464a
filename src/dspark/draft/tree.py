"""Token trees: many candidate continuations of one anchor, grown best-first under a node budget
(DESIGN.md §7b) and verified by one target pass.

A node is a draft token; node 0's parent is the anchor (-1). Nodes are numbered in creation order, so
a parent always precedes its children, and the children of a node are numbered in the order they
were drawn — what recursive rejection sampling (`decode/verify.py`) walks through.

Growth runs over *slots*: slot s of node n is n's s-th child. Its priority is n's path score times
the s-th largest probability of n's child distribution — known before the child is drawn, so whether a
slot exists never depends on the token that fills it (the condition that keeps tree verification
lossless when the children are sampled). Greedy requests fill slot s with the s-th most likely token;
sampled ones with the s-th draw without replacement (Gumbel top-k) from the exact distribution the
request samples from.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Sequence

import torch

from dspark.sampling import SamplingParams, probs_from_logits


@dataclasses.dataclass
class DraftTree:
    tokens: list[int]  # node i's token (target ids)
    parents: list[int]  # node i's parent; -1 is the anchor
    # per node with children (-1: the anchor): the draft distribution its children were drawn from
    # without replacement, in order, over `vocab`; absent when they were chosen deterministically (greedy)
    child_probs: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    vocab: torch.Tensor | None = None  # the target ids child_probs are over (a draft vocabulary); None: all
    given: set[int] = dataclasses.field(default_factory=set)  # nodes whose token was given, not drawn

    def draft_probs(self, node: int, vocab_size: int) -> torch.Tensor | None:
        """A copy of the distribution node's children were drawn from, over the whole vocabulary
        [vocab_size]; None where they were chosen deterministically."""
        probs = self.child_probs.get(node)
        if probs is None or self.vocab is None:
            return None if probs is None else probs.clone()
        return probs.new_zeros(vocab_size).index_copy_(0, self.vocab, probs)

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> dict[int, list[int]]:
        """node (or -1) -> its children in draw order."""
        out: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            out.setdefault(p, []).append(i)
        return out

    def depths(self) -> list[int]:
        """Depth of each node: 1 for the anchor's children."""
        depth: list[int] = []
        for p in self.parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        return depth

    def path(self, node: int) -> list[int]:
        """The nodes from the anchor's child down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def attention(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(depth offsets [1 + n], visibility [1 + n, 1 + n] bool) of the verify forward's tokens
        [anchor, node 0, ..., node n-1]: each sees the anchor, its ancestors and itself."""
        n = len(self)
        visible = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        visible[:, 0] = True
        for i, p in enumerate(self.parents):
            if p >= 0:
                visible[i + 1] = visible[p + 1]
            visible[i + 1, i + 1] = True
        return torch.tensor([0] + self.depths()), visible


def chain_tree(tokens: list[int], probs: torch.Tensor | None = None) -> DraftTree:
    """A chain of drafts as a tree (each node the only child of the one before)."""
    tree = DraftTree(list(tokens), list(range(-1, len(tokens) - 1)))
    if probs is not None:
        tree.child_probs = {i - 1: probs[i] for i in range(len(tokens))}
    return tree


# (parent node or -1, its depth, its token, its state) -> (child logits [K] fp32, the children's state)
Expand = Callable[[int, int, int, object], tuple[torch.Tensor, object]]
# (drafts grown so far, their gain 1 + Σ priorities, the next one's priority) -> whether to grow it
Admit = Callable[[int, float, float], bool]


@dataclasses.dataclass(frozen=True)
class TreeLimits:
    nodes: int  # drafts at most
    depth: int  # depth at most (a path never commits more drafts than this)
    children: int = 8  # children per node at most
    admit: Admit | None = None  # the verification policy's say on each next draft (None: grow to `nodes`)


@dataclasses.dataclass
class _Node:
    token: int
    score: float  # product of draft probabilities (or given survivals) along the path
    state: object  # what `expand` gave its parent for it
    given: tuple[int, float, int | None] | None = None  # its given first child: token, survival, draft index
    order: list[int] | None = None  # once expanded: children's draft indices in draw order (-1: the given one)
    probs: torch.Tensor | None = None  # the distribution drawn children come from [K]
    priorities: list[float] | None = None  # slot s's probability (its priority over the node's score)
    child_state: object = None  # what `expand` gave for its children


class TreeGrowth:
    """One tree's best-first growth, a slot at a time: `next_priority()` then `take()` while wanted.

    Slots are taken in descending priority; whether to take the next one is the caller's, from
    priorities known before each draw (lossless). `expand` gives a node's child logits over the draft
    vocabulary `vocab` (sorted target ids; None: the whole vocabulary). A node is expanded only when
    its path score could still win a slot (its score bounds its children's), so leaves cost nothing.

    `branch` is a continuation given from elsewhere (prompt lookup: DESIGN.md §7b), (target token,
    estimated survival) per token: each is its parent's first child, a deterministic one, and the
    children drawn beside it come from the draft distribution with it removed."""

    def __init__(self, expand: Expand, anchor: int, limits: TreeLimits, params: SamplingParams,
                 generator: torch.Generator | None, vocab: torch.Tensor | None = None,
                 branch: Sequence[tuple[int, float]] = ()):
        self.expand, self.limits, self.params, self.generator, self.vocab = expand, limits, params, generator, vocab
        self.given = [(token, survival, _draft_index(vocab, token)) for token, survival in branch[: limits.depth]]
        self.nodes = {-1: _Node(anchor, 1.0, None, self.given[0] if self.given else None)}
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.given_nodes: set[int] = set()  # the nodes `branch` gave
        self.depth = {-1: 0}
        self.gain = 1.0  # expected tokens the tree commits: 1 + the priorities taken
        # (-priority, node, slot); slot -1: a node to expand
        self.heap: list[tuple[float, int, int]] = [(-1.0, -1, -1)] if min(limits.nodes, limits.depth) > 0 else []

    def __len__(self) -> int:
        return len(self.tokens)

    def next_priority(self) -> float:
        """The next slot's priority (0: none left within the limits), expanding the nodes that could win it."""
        while self.heap and len(self.tokens) < self.limits.nodes:
            neg_priority, n, slot = self.heap[0]
            if neg_priority >= 0 or slot >= 0:  # 0: only impossible candidates remain
                return -neg_priority
            heapq.heappop(self.heap)
            node = self.nodes[n]
            _expand(node, self.expand(n, self.depth[n], node.token, node.state), self.limits.children,
                    self.params, self.generator)
            if node.priorities:
                heapq.heappush(self.heap, (-node.score * node.priorities[0], n, 0))
        return 0.0

    def take(self) -> None:
        """Add the slot `next_priority` gave as the next node."""
        neg_priority, n, slot = heapq.heappop(self.heap)
        node, child = self.nodes[n], len(self.tokens)
        self.gain -= neg_priority
        index = node.order[slot]
        on_branch = index < 0
        self.tokens.append(node.given[0] if on_branch else _target_id(self.vocab, index))
        self.parents.append(n)
        if on_branch:
            self.given_nodes.add(child)
        depth = self.depth[child] = self.depth[n] + 1
        if slot + 1 < len(node.order):
            heapq.heappush(self.heap, (-node.score * node.priorities[slot + 1], n, slot + 1))
        if depth < self.limits.depth:
            nxt = self.given[depth] if on_branch and depth < len(self.given) else None
            self.nodes[child] = _Node(self.tokens[child], node.score * node.priorities[slot], node.child_state, nxt)
            heapq.heappush(self.heap, (-self.nodes[child].score, child, -1))

    def tree(self) -> DraftTree:
        child_probs = {} if self.params.greedy else {n: self.nodes[n].probs for n in sorted(set(self.parents))}
        return DraftTree(self.tokens, self.parents, child_probs, self.vocab, self.given_nodes)


def grow_tree(expand: Expand, anchor: int, limits: TreeLimits, params: SamplingParams,
              generator: torch.Generator | None, vocab: torch.Tensor | None = None,
              branch: Sequence[tuple[int, float]] = ()) -> DraftTree:
    """A tree grown best-first within `limits` (`TreeGrowth`), stopping at the first node
    `limits.admit` refuses."""
    growth = TreeGrowth(expand, anchor, limits, params, generator, vocab, branch)
    while (priority := growth.next_priority()) > 0:
        if limits.admit is not None and not limits.admit(len(growth), growth.gain, priority):
            break
        growth.take()
    return growth.tree()


def grow_forest(growths: list[TreeGrowth], admit: Admit | None) -> list[DraftTree]:
    """The trees of a batch's rows grown together, best-first across rows: the slot of highest
    priority in any row next, while `admit(drafts of all rows, their total gain, priority)` says so
    (a batch's verify cost is its total tokens; None: each row grows to its limits)."""
    while True:
        priority, best = max(((g.next_priority(), i) for i, g in enumerate(growths)), default=(0.0, -1))
        if priority <= 0 or admit is not None and not admit(sum(map(len, growths)), sum(g.gain for g in growths),
                                                            priority):
            return [g.tree() for g in growths]
        growths[best].take()


def _draft_index(vocab: torch.Tensor | None, token: int) -> int | None:
    """A target token's index in the draft vocabulary (None: outside it)."""
    if vocab is None:
        return token
    i = int(torch.searchsorted(vocab, token))
    return i if i < vocab.numel() and int(vocab[i]) == token else None


def _target_id(vocab: torch.Tensor | None, index: int) -> int:
    return index if vocab is None else int(vocab[index])


def _expand(node: _Node, expanded: tuple[torch.Tensor, object], max_children: int, params: SamplingParams,
            generator: torch.Generator | None) -> None:
    """A node's child distribution and children order: its given child first (if any), then the most
    likely tokens when greedy, else the first draws without replacement (Gumbel top-k) from the
    distribution the request samples from, the given token removed."""
    logits, node.child_state = expanded
    probs = torch.softmax(logits, -1) if params.greedy else probs_from_logits(logits, params)
    rest, order, priorities = probs, [], []
    if node.given is not None:
        _, survival, index = node.given
        order.append(-1)
        priorities.append(max(survival, float(probs[index]) if index is not None else 0.0))
        if index is not None:
            rest = probs.clone()
            rest[index] = 0.0
    k = min(max_children - len(order), int((rest > 0).sum()))
    top = rest.topk(k)
    if params.greedy:
        order += top.indices.tolist()
    else:
        gumbel = -torch.log(-torch.log(torch.rand(probs.shape, generator=generator).clamp_(min=1e-20)))
        order += (rest.log() + gumbel).topk(k).indices.tolist()
    node.order, node.probs, node.priorities = order, probs, priorities + top.values.tolist()
