"""The drafts the target receives, in the engine's terms: checked here before they reach verification,
and a sampling group's rows made into one Drafts. The messages themselves are read and built in wire.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpool.engine.drafters.base import Drafts
from specpool.engine.verification import token_tree
from specpool.engine.verification.sampling import SamplingParams

# A row's draft distribution: dense [K, V], sparse (ids [K, k], probs [K, k]), or None (a point mass).
Q = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None


@dataclass(frozen=True, slots=True)
class DraftRow:
    """One sequence's drafts for a step, from whichever source drafted them (the endpoint, an SSD table,
    the target's n-gram index)."""

    tokens: list[int]  # [K] draft ids (a tree's nodes, each after its parent)
    q: Q = None  # dense [K, V] float32, sparse (ids [K, k] int64, probs [K, k] float32), or None: a point mass
    parents: list[int] | None = None  # [K] each node's parent (-1: the last emitted token); None: a chain


def unusable(tokens: list[int], q: Q, asked: int, q_sent: bool, vocab_size: int,
             parents: list[int] | None = None) -> str:
    """Why an endpoint's drafts for one sequence cannot be verified ('' when they can). Checked here:
    in verification a bad id or shape would fail every sequence of the batch, not only this one."""
    if len(tokens) > asked:
        return f"{len(tokens)} drafts where {asked} were asked"
    if any(not 0 <= t < vocab_size for t in tokens):
        return f"a draft token outside the vocabulary [0, {vocab_size})"
    if parents is not None:
        if q_sent:
            return "a token tree with a draft distribution (tree nodes are deterministic)"
        try:
            token_tree.check_tree(tokens, parents)
        except ValueError as e:
            return f"a malformed token tree ({e})"
    if q_sent and q is None:
        return "its draft distribution is malformed"
    if isinstance(q, torch.Tensor):
        if tuple(q.shape) != (len(tokens), vocab_size):
            return f"dense q of shape {tuple(q.shape)} for {len(tokens)} drafts"
        probs = q
    elif q is not None:
        ids, probs = q
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab_size):
            return "a sparse q id outside the vocabulary"
    if q is not None and not (torch.isfinite(probs).all() and (probs >= 0).all()):
        return "negative or non-finite draft probabilities"
    return ""


def assemble(rows: list[DraftRow], params: SamplingParams) -> Drafts:
    """One Drafts for a sampling group whose rows came from different sources.

    Rows drafted deterministically (n-gram, fallback, trees) are written as a one-hot q, which the
    dense and sparse rules verify exactly as the point-mass rule does. Trees are verified as trees
    unless another row of the group carries a q (the tree rule takes none): they then send their
    first-child chain, a deterministic chain.

    Example: a sampled group (temperature 1, top_k 2) of an n-gram row and a sparse one,
    assemble([DraftRow([4, 6]), DraftRow([7], (tensor([[7, 8]]), tensor([[0.6, 0.4]])))], params),
    gives Drafts(tokens=[[4, 6], [7]]) with topk_ids [[[4, 4], [6, 6]], [[7, 8], [0, 0]]] and
    topk_probs [[[1, 0], [1, 0]], [[0.6, 0.4], [0, 0]]]: the n-gram drafts as one-hot rows, the
    shorter row padded with weight 0.
    """
    sampled = not params.greedy and any(r.q is not None for r in rows)
    if any(r.parents is not None for r in rows):
        if not sampled:
            return Drafts(tokens=[r.tokens for r in rows],
                          parents=[r.parents if r.parents is not None else token_tree.chain(len(r.tokens))
                                   for r in rows])
        rows = [r if r.parents is None else DraftRow([r.tokens[i] for i in token_tree.first_children(r.parents)])
                for r in rows]
    tokens = [r.tokens for r in rows]
    if not sampled:
        return Drafts(tokens=tokens)
    k_max = max((len(t) for t in tokens), default=0)
    if any(isinstance(r.q, torch.Tensor) for r in rows):
        vocab = next(r.q.shape[-1] for r in rows if isinstance(r.q, torch.Tensor))
        probs = torch.zeros(len(rows), k_max, vocab)
        for b, r in enumerate(rows):
            n = len(r.tokens)
            if isinstance(r.q, torch.Tensor):
                probs[b, :n] = r.q
            elif n:
                probs[b, torch.arange(n), torch.tensor(r.tokens)] = 1.0
        return Drafts(tokens=tokens, probs=probs)
    # Sparse: every row shares the sampler's top-k; one-hot rows repeat their token with weight 0.
    k = max(r.q[0].shape[-1] for r in rows if r.q is not None)  # rows pad to the widest (weight 0)
    ids = torch.zeros(len(rows), k_max, k, dtype=torch.long)
    weights = torch.zeros(len(rows), k_max, k)
    for b, r in enumerate(rows):
        n = len(r.tokens)
        if r.q is not None:
            width = r.q[0].shape[-1]
            ids[b, :n, :width], weights[b, :n, :width] = r.q
        elif n:
            ids[b, :n] = torch.tensor(r.tokens)[:, None]
            weights[b, :n, 0] = 1.0
    return Drafts(tokens=tokens, topk_ids=ids, topk_probs=weights)
