"""A model as a drafter: the draft model (a small Llama sharing the target's tokenizer) or, with a
feature feed, the head; chains through the one drafting loop, or EAGLE-2 token trees."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specpool.engine.drafters.base import Capabilities, Drafter, Drafts
from specpool.engine.drafters.feeds import DraftState, feed_for
from specpool.engine.drafters.loop import DraftPicker, after_last, draft_steps
from specpool.engine.drafters.trees import Candidates, grow_trees, tree_logprobs
from specpool.engine.plan import TreeShape
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.sampling import SamplingParams


class ModelDrafter(Drafter):
    """Autoregressive drafting with a model: the draft model, or a head (its feed reads the target's
    features, which the caller passes to `start` and `observe`).

    Sampled drafts come from the same temperature/top-k/top-p transform as the target, and q is
    sent with them: sparsely as (id, prob) pairs when top-k bounds its support, densely otherwise.
    """

    def __init__(self, model: Llama, max_sequences: int, max_len: int, sparse_top_k: bool = True,
                 tree: TreeShape | None = None):
        """tree: propose token trees of this shape (num_tokens is then each tree's node budget), not chains."""
        self.model = model
        self.feed = feed_for(model)
        self.caps = Capabilities(kv_cache=True, sparse_q_per_call=True, grows_trees=True,
                                 features="features" in self.feed.inputs)
        self.cache = model.new_cache(max_sequences, max_len)
        self.sparse_top_k = sparse_top_k
        self.tree = tree
        self._seqs: dict[str, DraftState] = {}

    def start(self, seq_id: str, context: Sequence[int], features: torch.Tensor | None = None) -> None:
        """A head's features [len(context) - 1, d]: the target's at every context position but the last."""
        pending, features = self.feed.first_feed(context, features)
        self._seqs[seq_id] = DraftState(self.cache.allocate(), pending, features)

    def release(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.cache.release(seq.slot)

    def observe(self, seq_id: str, tokens: Sequence[int], features: torch.Tensor | None = None) -> None:
        """A head's features [len(tokens), d]: the target's at the position before each token."""
        seq = self._seqs[seq_id]
        self.feed.observe(self.cache, seq, tokens, features)
        seq.fed, seq.drafts = 0, ()

    def propose(self, seq_ids, num_tokens, params, generator, *, sparse: bool | None = None,
                tree: TreeShape | None = None) -> Drafts:
        """`sparse` and `tree` override the constructor's `sparse_top_k` and `tree` for this call (a
        pooled endpoint serves sessions of either transport and shape); top-k pairs still need
        `params.top_k > 0`."""
        seqs = [self._seqs[s] for s in seq_ids]
        tree = tree or self.tree
        if tree is not None:
            return self._propose_trees(seqs, num_tokens, params, tree)
        sparse = self.sparse_top_k if sparse is None else sparse
        picker = DraftPicker(len(seq_ids), max(num_tokens, default=0), self.model.config.vocab_size, params,
                             generator, sparse)
        # A row with nothing to draft keeps its pending tokens for the next round.
        taken = [self.feed.take(self.cache, s) if n > 0 else ([], None) for s, n in zip(seqs, num_tokens)]
        drafts, _ = draft_steps(self.feed, self.cache, [s.slot for s in seqs], [t for t, _ in taken],
                                [f for _, f in taken], num_tokens, picker.pick, own_vocab=picker.own_vocab)
        for seq, n, drafted in zip(seqs, num_tokens, drafts):
            if n > 0:
                seq.fed, seq.drafts = n - 1, tuple(drafted)
        return picker.drafts(drafts)

    def _propose_trees(self, seqs: list[DraftState], budgets: Sequence[int], params: SamplingParams,
                       shape: TreeShape) -> Drafts:
        """Each row's root feeds its pending tokens; each level feeds the picked candidates, as a tree over
        the row's cache, each with the feature predicted at its parent (for a feed that reads them)."""
        tokens: list[list[int]] = [[] for _ in seqs]
        parents: list[list[int]] = [[] for _ in seqs]
        active = [b for b, n in enumerate(budgets) if n > 0]
        if not active:
            return Drafts(tokens=tokens, parents=parents)
        act = [seqs[b] for b in active]
        cands = [Candidates() for _ in act]
        predicted: list[dict[int, torch.Tensor]] = [{} for _ in act]  # node -> the feature after it (-1: root)

        def expand(rows: list[int], picks: list[list[int]]) -> torch.Tensor:
            features = [torch.stack([predicted[a][cands[a].parents[n]] for n in pick]) for a, pick in zip(rows, picks)]
            feeds = [[cands[a].tokens[n] for n in pick] for a, pick in zip(rows, picks)]
            fed_parents = [cands[a].feed(pick) for a, pick in zip(rows, picks)]
            logits, hidden = self.feed.forward(self.cache, [act[a].slot for a in rows], feeds, features,
                                               all_logits=True, parents=fed_parents, own_vocab=True)
            for i, (a, pick) in enumerate(zip(rows, picks)):
                predicted[a].update((n, hidden[i, j]) for j, n in enumerate(pick))
            return tree_logprobs(logits, params)

        feeds, features = zip(*(self.feed.take(self.cache, s) for s in act))
        # Trees score the model's own rows (a head's reduced vocabulary): every sampler transform gives the
        # tokens outside them no probability anyway.
        logits, hidden = self.feed.forward(self.cache, [s.slot for s in act], feeds, features, own_vocab=True)
        for a, feature in enumerate(after_last(hidden, feeds)):
            predicted[a][-1] = feature
        trees = grow_trees(tree_logprobs(logits, params), [budgets[b] for b in active], shape, expand, cands,
                           self.model.output_ids)
        for a, b in enumerate(active):
            tokens[b], parents[b] = trees[a]
            # The tree's K/V all go at the next observe (no accepted node is kept: it is fed again).
            act[a].fed, act[a].drafts = len(cands[a].fed_parents), ()
        return Drafts(tokens=tokens, parents=parents)


def build(sources) -> ModelDrafter | None:
    """The registry's draft-model drafter (drafters/registry.py); a growing tree takes cache room past a sequence."""
    if sources.draft is None:
        return None
    return ModelDrafter(sources.draft, sources.max_sequences, sources.max_len + sources.tree_shape.fed_room,
                        tree=sources.tree_shape if sources.trees else None)
