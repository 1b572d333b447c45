"""The draft model as a drafter: a small Llama that shares the target's tokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specpool.engine.drafters.base import Drafter, Drafts, accepted_prefix
from specpool.engine.drafters.loop import DraftPicker, Pick, draft_steps
from specpool.engine.drafters.trees import Candidates, TreeShape, grow_trees, tree_logprobs
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.sampling import SamplingParams


@dataclass(slots=True)
class _DraftSeq:
    slot: int
    pending: list[int]  # context tokens not yet in the draft KV cache
    fed_drafts: int = 0  # this round's drafts whose K/V are in the cache
    drafts: tuple[int, ...] = ()


class ModelDrafter(Drafter):
    """Autoregressive drafting with a small Llama that shares the target's tokenizer.

    Sampled drafts come from the same temperature/top-k/top-p transform as the target, and q is
    sent with them: sparsely as (id, prob) pairs when top-k bounds its support, densely otherwise.
    """

    sparse_q_per_call = True
    grows_trees = True

    def __init__(self, model: Llama, max_sequences: int, max_len: int, sparse_top_k: bool = True,
                 tree: TreeShape | None = None):
        """tree: propose token trees of this shape (num_tokens is then each tree's node budget), not chains."""
        self.model = model
        self.cache = model.new_cache(max_sequences, max_len)
        self.sparse_top_k = sparse_top_k
        self.tree = tree
        self._seqs: dict[str, _DraftSeq] = {}

    def start(self, seq_id: str, context: Sequence[int]) -> None:
        self._seqs[seq_id] = _DraftSeq(slot=self.cache.allocate(), pending=list(context))

    def release(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.cache.release(seq.slot)

    def observe(self, seq_id: str, tokens: Sequence[int]) -> None:
        seq = self._seqs[seq_id]
        # Drafts d_1..d_j that the target accepted are already cached; keep them, drop the rest.
        # The last token is always fed again, as the next forward's input, even when it equals a fed
        # draft (a residual that fell back to p may re-emit the rejected token).
        keep = min(accepted_prefix(seq.drafts, tokens), seq.fed_drafts, max(len(tokens) - 1, 0))
        self.cache.truncate(seq.slot, self.cache.lengths[seq.slot] - seq.fed_drafts + keep)
        seq.pending.extend(tokens[keep:])
        seq.fed_drafts, seq.drafts = 0, ()

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
        return picker.drafts(self._draft(seqs, num_tokens, picker.pick))

    def _draft(self, seqs: list[_DraftSeq], num_tokens: Sequence[int], pick: Pick) -> list[list[int]]:
        tokens = draft_steps(self.model, self.cache, [s.slot for s in seqs], [s.pending for s in seqs],
                             num_tokens, pick)
        for seq, n, drafted in zip(seqs, num_tokens, tokens):
            if n > 0:
                seq.pending, seq.fed_drafts, seq.drafts = [], n - 1, tuple(drafted)
        return tokens

    # -- trees ------------------------------------------------------------------------------------

    def _propose_trees(self, seqs, budgets: Sequence[int], params: SamplingParams, shape: TreeShape) -> Drafts:
        tokens: list[list[int]] = [[] for _ in seqs]
        parents: list[list[int]] = [[] for _ in seqs]
        active = [b for b, n in enumerate(budgets) if n > 0]
        if active:
            act = [seqs[b] for b in active]
            cands = [Candidates() for _ in act]

            def expand(rows: list[int], picks: list[list[int]]) -> torch.Tensor:
                logits = self._tree_expand([act[a] for a in rows], [cands[a] for a in rows], picks)
                return tree_logprobs(logits, params)

            first = tree_logprobs(self._tree_root(act), params)
            trees = grow_trees(first, [budgets[b] for b in active], shape, expand, cands)
            for a, b in enumerate(active):
                tokens[b], parents[b] = trees[a]
                self._drafted_tree(act[a], cands[a])
        return Drafts(tokens=tokens, parents=parents)

    def _tree_root(self, seqs: list) -> torch.Tensor:
        """Feeds each sequence's pending tokens -> the logits for its next token [A, V]."""
        logits = self.model.forward(self.cache, [s.slot for s in seqs], [s.pending for s in seqs])
        for seq in seqs:
            seq.pending = []
        return logits

    def _tree_expand(self, seqs: list, cands: list[Candidates], picks: list[list[int]]) -> torch.Tensor:
        """Feeds the picked candidates of each sequence's tree -> the logits after each [A, T, V]."""
        feeds = [[c.tokens[n] for n in pick] for c, pick in zip(cands, picks)]
        parents = [c.feed(pick) for c, pick in zip(cands, picks)]
        return self.model.forward(self.cache, [s.slot for s in seqs], feeds, all_logits=True, parents=parents)

    def _drafted_tree(self, seq, cand: Candidates) -> None:
        # The tree's K/V are dropped at the next observe (no accepted draft is kept: it is fed again).
        seq.fed_drafts, seq.drafts = len(cand.fed_parents), ()


