"""The feature-fed draft head (EAGLE style) as a drafter.

A head is a one-layer Llama (`ModelConfig.feature_fed`) whose input at a position fuses a token's
embedding with the feature of the position before it: the target's last hidden state there, or,
past the first draft, the head's own prediction of it. So it is fed pairs (feature, token): the
target sends the features of every position it kept (its prompt, then each round's last token and
accepted drafts), each paired with the token that followed it.

Drafts are made from predicted features, so their K/V are never kept: each round drops them and
feeds the round's true pairs instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specpool.engine.drafters.loop import Pick
from specpool.engine.drafters.model import ModelDrafter
from specpool.engine.drafters.trees import Candidates, TreeShape
from specpool.engine.runtime.model import Llama


@dataclass(slots=True)
class _HeadSeq:
    slot: int
    tokens: list[int]  # pairs not yet in the head's cache: these tokens ...
    features: torch.Tensor  # [n, d] ... and the target's features at the positions before them
    kept: int = 0  # cached positions made from true features (the rest: this round's drafts)
    # While a tree grows: the head's predicted feature after its root, and after each fed candidate.
    predicted: dict[int, torch.Tensor] = field(default_factory=dict)


class HeadDrafter(ModelDrafter):
    inputs = frozenset({"features"})

    def __init__(self, model: Llama, max_sequences: int, max_len: int, sparse_top_k: bool = True,
                 tree: TreeShape | None = None):
        if not model.config.feature_fed:
            raise ValueError("HeadDrafter needs a feature-fed model (a draft head checkpoint)")
        super().__init__(model, max_sequences, max_len, sparse_top_k, tree)

    def start(self, seq_id: str, context: Sequence[int], features: torch.Tensor | None = None) -> None:
        """features [len(context) - 1, d]: the target's at every context position but the last."""
        if features is None or len(features) != len(context) - 1:
            raise ValueError(f"a head needs the target's features at the {len(context) - 1} positions "
                             f"before the context's last, got {None if features is None else len(features)}")
        self._seqs[seq_id] = _HeadSeq(self.cache.allocate(), list(context[1:]), features.to(self.model.device))

    def observe(self, seq_id: str, tokens: Sequence[int], features: torch.Tensor | None = None) -> None:
        """features [len(tokens), d]: the target's at the position before each token."""
        if features is None or len(features) != len(tokens):
            raise ValueError(f"a head needs {len(tokens)} features with {len(tokens)} tokens")
        seq = self._seqs[seq_id]
        self.cache.truncate(seq.slot, seq.kept)
        seq.tokens += tokens
        seq.features = torch.cat([seq.features, features.to(seq.features)])

    def _feed_pending(self, seqs: list[_HeadSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feeds each sequence's pending pairs -> (logits [A, V], predicted feature [A, d]) after the last."""
        rows = [s.tokens for s in seqs]
        d = self.model.config.d_model
        fed = torch.zeros(len(seqs), max(map(len, rows)), d, dtype=self.model.dtype, device=self.model.device)
        for a, seq in enumerate(seqs):
            fed[a, : len(rows[a])] = seq.features
        logits, hidden = self.model.forward(self.cache, [s.slot for s in seqs], rows, features=True, fed_features=fed)
        last = hidden[torch.arange(len(seqs)), torch.tensor([len(r) - 1 for r in rows])]
        for seq in seqs:
            seq.kept, seq.tokens, seq.features = self.cache.lengths[seq.slot], [], seq.features[:0]
        return logits, last

    def _tree_root(self, seqs: list[_HeadSeq]) -> torch.Tensor:
        logits, last = self._feed_pending(seqs)
        for seq, feature in zip(seqs, last):
            seq.predicted = {-1: feature}
        return logits

    def _tree_expand(self, seqs: list[_HeadSeq], cands: list[Candidates], picks: list[list[int]]) -> torch.Tensor:
        # A candidate's input is its token with the feature the head predicted at its parent.
        fed = torch.zeros(len(seqs), max(map(len, picks)), self.model.config.d_model, dtype=self.model.dtype,
                          device=self.model.device)
        for a, (seq, cand, pick) in enumerate(zip(seqs, cands, picks)):
            fed[a, : len(pick)] = torch.stack([seq.predicted[cand.parents[n]] for n in pick])
        feeds = [[c.tokens[n] for n in pick] for c, pick in zip(cands, picks)]
        parents = [c.feed(pick) for c, pick in zip(cands, picks)]
        logits, hidden = self.model.forward(self.cache, [s.slot for s in seqs], feeds, all_logits=True,
                                            features=True, fed_features=fed, parents=parents)
        for a, (seq, pick) in enumerate(zip(seqs, picks)):
            seq.predicted.update((n, hidden[a, j]) for j, n in enumerate(pick))
        return logits

    def _drafted_tree(self, seq: _HeadSeq, cand: Candidates) -> None:
        seq.predicted = {}  # observe drops the tree's K/V: the head keeps only true pairs

    def _draft(self, seqs: list[_HeadSeq], num_tokens: Sequence[int], pick: Pick) -> list[list[int]]:
        """Chains: step 0 feeds each row's pending pairs, later steps (the predicted feature, the last
        draft); one forward a step for every row still drafting."""
        out: list[list[int]] = [[] for _ in seqs]
        predicted: dict[int, torch.Tensor] = {}
        for j in range(max(num_tokens, default=0)):
            active = [b for b, n in enumerate(num_tokens) if n > j]
            if j == 0:
                logits, last = self._feed_pending([seqs[b] for b in active])
            else:
                fed = torch.stack([predicted[b] for b in active])[:, None]
                logits, hidden = self.model.forward(self.cache, [seqs[b].slot for b in active],
                                                    [[out[b][-1]] for b in active], features=True, fed_features=fed)
                last = hidden[:, 0]
            for a, b in enumerate(active):
                predicted[b] = last[a]
            for b, t in zip(active, pick(j, active, logits).tolist()):
                out[b].append(t)
        return out
