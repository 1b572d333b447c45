"""Token trees: a drafter's several continuations of one sequence, verified in one target forward.

A tree is its nodes in topological order: `tokens[i]` and `parents[i]`, the index of node i's parent
(< i), or -1 for a child of the root (the sequence's last emitted token). A chain is the tree whose
node i has parent i - 1. The target is fed the root and then every node; a node sits at the position
of its depth and attends to the cached prefix and its own ancestors only, so each node's logits are
exactly those the target would give at the end of that node's path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def padded(rows: Sequence[Sequence[int]], width: int, fill: int = 0) -> torch.Tensor:
    """Ragged rows of ids as one [B, width] long tensor (one tensor call: a call per row dominates a
    large batch's step)."""
    return torch.tensor([list(row) + [fill] * (width - len(row)) for row in rows], dtype=torch.long).reshape(len(rows), width)


def chain(n: int) -> list[int]:
    """The parents of an n-node chain."""
    return list(range(-1, n - 1))


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def check_parents(parents: Sequence[int], what: str = "parents") -> None:
    """Raises ValueError unless every node's parent is -1 or an earlier node."""
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"{what}[{i}] = {p}: a node's parent must be -1 or an earlier node")


def check_tree(tokens: Sequence[int], parents: Sequence[int]) -> None:
    """Raises ValueError unless tokens and parents form a tree whose siblings carry distinct tokens
    (the multi-candidate rule that verifies them needs distinct candidates)."""
    if len(tokens) != len(parents):
        raise ValueError(f"a tree of {len(tokens)} tokens needs as many parents, got {len(parents)}")
    check_parents(parents)
    edges = set(zip(parents, tokens))
    if len(edges) != len(tokens):
        raise ValueError("sibling nodes must carry distinct tokens")


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node: 0 for a child of the root."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node` (empty for node -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def attention_layout(fed_parents: Sequence[Sequence[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows of fed tokens whose parents (in feed order, -1: the cached prefix) form trees ->
    (depth [B, width] long: each fed token's position past the cache, ancestor-or-self [B, width, width]
    bool). Padding columns are their own only ancestors, at depth 0."""
    B = len(fed_parents)
    for row in fed_parents:
        check_parents(row)
    parents = padded(fed_parents, width, fill=-1)
    depth = torch.zeros(B, width, dtype=torch.long)
    anc = torch.eye(width, dtype=torch.bool).repeat(B, 1, 1)
    rows = torch.arange(B)
    for u in range(1, width):  # parents come first: theirs are final when a child is reached
        p = parents[:, u]
        has = p >= 0
        at = p.clamp(min=0)
        anc[:, u] |= anc[rows, at] & has[:, None]
        depth[:, u] = torch.where(has, depth[rows, at] + 1, 0)
    return depth, anc


def first_children(parents: Sequence[int]) -> list[int]:
    """The tree's first-child chain: from the root, each node's earliest child (the drafter's likeliest)."""
    path, node = [], -1
    while (child := next((i for i, p in enumerate(parents) if p == node), None)) is not None:
        path.append(child)
        node = child
    return path


def matched_path(tokens: Sequence[int], parents: Sequence[int], emitted: Sequence[int]) -> list[int]:
    """The nodes the target accepted, given the tokens it emitted after the tree: the longest path
    whose tokens are a prefix of `emitted` (siblings are distinct, so there is one)."""
    path, node = [], -1
    for token in emitted:
        child = next((i for i, (p, t) in enumerate(zip(parents, tokens)) if p == node and t == token), None)
        if child is None:
            break
        path.append(child)
        node = child
    return path
