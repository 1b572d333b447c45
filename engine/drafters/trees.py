"""Growing draft trees with a model (EAGLE-2's dynamic trees): branch where the draft is unsure.

Every node's score is the draft's log-probability of its whole path. Level by level, the `beam`
likeliest nodes of the deepest level are fed to the draft (in one forward for every row, as a tree
over its cache), and each gets its `branch` likeliest next tokens as candidate children. The tree
sent for verification is the `budget` likeliest candidates: a child never outscores its parent, so
they form a tree. Where the draft is sure, the budget goes deep along one path; where it is not, it
spreads over siblings. The tree depends only on the context, never on the sampler's randomness, as
the target's tree verification requires.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specpool.engine.plan import TreeShape
from specpool.engine.verification.sampling import SamplingParams, logits_to_probs


@dataclass(slots=True)
class Candidates:
    """One row's candidate nodes: every node ever proposed, in the order they were made."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # candidate index, -1: a child of the root
    scores: list[float] = field(default_factory=list)  # log-probability of the path
    depth: list[int] = field(default_factory=list)
    fed: dict[int, int] = field(default_factory=dict)  # candidate -> its index in the draft cache's tree
    fed_parents: list[int] = field(default_factory=list)  # the draft cache's tree, in feed order

    def add_children(self, parent: int, logprobs: list[float], tokens: list[int]) -> None:
        """Candidate children of `parent` (-1: the root): the draft's likeliest next tokens after it."""
        base = self.scores[parent] if parent >= 0 else 0.0
        d = self.depth[parent] + 1 if parent >= 0 else 0
        for lp, tok in zip(logprobs, tokens):
            self.tokens.append(tok)
            self.parents.append(parent)
            self.scores.append(base + lp)
            self.depth.append(d)

    def feed(self, nodes: list[int]) -> list[int]:
        """Marks nodes as fed to the draft, -> the cache tree's parents after feeding them."""
        for n in nodes:
            p = self.parents[n]
            self.fed[n] = len(self.fed_parents)
            self.fed_parents.append(-1 if p < 0 else self.fed[p])
        return self.fed_parents

    def best(self, budget: int) -> tuple[list[int], list[int]]:
        """The `budget` likeliest candidates as a tree -> (tokens, parents), in creation order."""
        order = sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], self.depth[i], i))[:budget]
        index: dict[int, int] = {}
        tokens, parents = [], []
        for c in sorted(order):  # creation order: parents first
            p = self.parents[c]
            if p >= 0 and p not in index:  # only a tie can rank a child above its parent: drop it
                continue
            index[c] = len(tokens)
            tokens.append(self.tokens[c])
            parents.append(index[p] if p >= 0 else -1)
        return tokens, parents


# expand(rows, nodes): feed each listed row's candidate nodes (its Candidates say their tokens and
# parents) and return the draft's log-probabilities after each, [A, max nodes, V].
Expand = Callable[[list[int], list[list[int]]], torch.Tensor]


def grow_trees(first: torch.Tensor, budgets: Sequence[int], shape: TreeShape, expand: Expand,
               rows: list[Candidates], token_ids: torch.Tensor | None = None) -> list[tuple[list[int], list[int]]]:
    """first [B, V]: the draft's log-probabilities for each row's next token -> (tokens, parents) of
    each row's tree of at most budgets[b] nodes. token_ids: the token of each column of `first` and of
    `expand`'s results (a reduced vocabulary's), None: the column's index."""

    def tokens(indices: torch.Tensor) -> list:
        return (indices if token_ids is None else token_ids[indices]).tolist()

    branch = min(shape.branch, first.shape[-1])
    top = torch.topk(first, branch)  # one call for every row: per-row calls dominate at large batches
    for cand, n, lps, toks in zip(rows, budgets, top.values.tolist(), tokens(top.indices)):
        if n > 0:
            cand.add_children(-1, lps[: min(branch, n)], toks[: min(branch, n)])
    for depth in range(1, min(shape.max_depth, max(budgets, default=0))):
        active, picks = [], []
        for b, cand in enumerate(rows):
            if depth >= budgets[b]:
                continue
            level = [i for i, d in enumerate(cand.depth) if d == depth - 1]
            level = sorted(level, key=lambda i: -cand.scores[i])[: shape.beam]
            if level:
                active.append(b)
                picks.append(level)
        if not active:
            break
        top = torch.topk(expand(active, picks), branch)  # [A, T, branch]
        values, indices = top.values.tolist(), tokens(top.indices)
        for a, (b, level) in enumerate(zip(active, picks)):
            n = min(branch, budgets[b])
            for j, node in enumerate(level):
                rows[b].add_children(node, values[a][j][:n], indices[a][j][:n])
    return [cand.best(n) if n > 0 else ([], []) for cand, n in zip(rows, budgets)]


def tree_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What a tree's scores are made of: the draft's log-probabilities under the sampler's transform
    (temperature, top-k, top-p), or at temperature 1 for a greedy target."""
    if params.greedy:
        return logits.float().log_softmax(-1)
    return logits_to_probs(logits, params).log()
