"""Token trees from a suffix store where it is sure, from a model (a head or a draft model) elsewhere.

SuffixDecoding's hybrid with a model drafter: each round, every sequence's suffix-store tree is
scored by the store's own estimate of the tokens it gets accepted (the sum of its nodes' path
probabilities). At `threshold` or above it is sent as it is, at no model cost; below, the model grows
the sequence's tree, in one batched call for all such rows. The store holds every request's prompt
and verified tokens (and, in a server, its tenant's earlier requests), so text that repeats, within
a request or across requests, is drafted for free. Both kinds of tree are deterministic: the target
verifies them with the tree rule whatever the sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import count

from specpool.engine.drafters.base import Capabilities, Drafter, Drafts
from specpool.engine.drafters.model import ModelDrafter
from specpool.engine.drafters.suffix_store import SuffixStore
from specpool.engine.policy.draft_length import ModelShare


class HybridTreeDrafter(Drafter):
    """Trees from `store` when it expects `threshold` accepted tokens or more, else from `model` (a
    ModelDrafter or HeadDrafter built with a TreeShape); `num_tokens` is each tree's node budget.
    `share`: where it reports how many rows the model drafted (HybridDraftLength reads it)."""

    _documents = count()  # document ids unique across drafters sharing one store

    def __init__(self, model: ModelDrafter, store: SuffixStore, threshold: float = 1.5, min_prob: float = 0.05,
                 share: ModelShare | None = None):
        if model.tree is None:
            raise ValueError("the model drafter must grow trees (give it a TreeShape)")
        self.model, self.store = model, store
        self.threshold, self.min_prob = threshold, min_prob
        self.share = share or ModelShare()
        self.caps = Capabilities(features=model.caps.features)
        self.store_rounds = self.model_rounds = 0  # rows drafted by each source
        self._docs: dict[str, tuple[str, list[int]]] = {}  # seq_id -> (its document, its tokens)

    def start(self, seq_id: str, context: Sequence[int], **inputs) -> None:
        self.model.start(seq_id, context, **inputs)
        doc = f"{seq_id}#{next(self._documents)}"
        self.store.extend(doc, context)
        self._docs[seq_id] = (doc, list(context))

    def observe(self, seq_id: str, tokens: Sequence[int], **inputs) -> None:
        self.model.observe(seq_id, tokens, **inputs)
        doc, context = self._docs[seq_id]
        self.store.extend(doc, tokens)
        context.extend(tokens)

    def release(self, seq_id: str) -> None:
        self.model.release(seq_id)
        self._docs.pop(seq_id, None)  # its document stays: later requests draft from it

    def propose(self, seq_ids, num_tokens, params, generator) -> Drafts:
        tokens: list[list[int]] = [[] for _ in seq_ids]
        parents: list[list[int]] = [[] for _ in seq_ids]
        from_model = []
        for b, (seq_id, n) in enumerate(zip(seq_ids, num_tokens)):
            draft = self.store.propose(self._docs[seq_id][1], n, min_prob=self.min_prob)
            if n > 0 and draft.score >= self.threshold:
                tokens[b], parents[b] = draft.tokens, draft.parents
                self.store_rounds += 1
            elif n > 0:
                from_model.append(b)
        drafted = sum(n > 0 for n in num_tokens)
        if drafted:
            self.share.add(len(from_model), drafted)
        if from_model:
            grown = self.model.propose([seq_ids[b] for b in from_model], [num_tokens[b] for b in from_model],
                                       params, generator)
            for i, b in enumerate(from_model):
                tokens[b], parents[b] = grown.tokens[i], grown.parents[i]
            self.model_rounds += len(from_model)
        return Drafts(tokens=tokens, parents=parents)
