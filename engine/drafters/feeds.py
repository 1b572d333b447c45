"""What a model drafter feeds with each token, and so what of its KV cache outlives a round.

The draft model feeds tokens alone (TokenFeed): the K/V of drafts the target accepted stay valid. A head
(EAGLE style: a one-layer Llama, `ModelConfig.feature_fed`) feeds each token with a feature, the
target's last hidden state at the position before it, or past the first draft its own prediction of it
(FeatureFeed). K/V made from predicted features never outlive their round: each outcome truncates the
sequence back to its true-feature positions, and the emitted tokens are fed next with the features
the target sends with them.

Every model drafter (the draft model and the head, chains or trees, and SSD's forks) keeps one
DraftState per sequence and asks its feed these questions instead of which kind of model it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specpool.engine.drafters.base import accepted_prefix
from specpool.engine.runtime.kv_cache import KVCache
from specpool.engine.runtime.model import Llama


@dataclass(slots=True)
class DraftState:
    """One sequence in a model drafter's KV cache."""

    slot: int
    pending: list[int]  # tokens not yet in the cache, fed first next time
    features: torch.Tensor | None = None  # a head's: the target's features paired with `pending` [n, d]
    # A head's features of tokens observed since, joined to `features` when taken: appending each outcome's
    # to one tensor copied all the pending ones every round, quadratic while the policy does not draft.
    more_features: list[torch.Tensor] = field(default_factory=list)
    fed: int = 0  # this round's drafts whose K/V are in the cache
    drafts: Sequence[int] = ()  # this round's drafts (a tree's: none; its K/V all go at the next outcome)
    kept: int = 0  # a head's: the cached positions made from true features
    last: tuple[int, torch.Tensor] | None = None  # a head's: the last true pair fed


class TokenFeed:
    """The draft model's: tokens alone."""

    inputs: frozenset[str] = frozenset()  # what the target sends beside token ids

    def __init__(self, model: Llama):
        self.model = model

    def check(self, n: int, features: torch.Tensor | None, what: str) -> None:
        """Raises ValueError unless `features` is what this feed needs with n tokens (here: nothing)."""

    def first_feed(self, context: Sequence[int], features: torch.Tensor | None = None):
        """A new sequence's context -> (tokens, features) pending in its DraftState."""
        return list(context), None

    def take(self, cache: KVCache, seq: DraftState) -> tuple[list[int], torch.Tensor | None]:
        """The pending tokens (and features), which the caller feeds next."""
        tokens, seq.pending = seq.pending, []
        return tokens, None

    def row_features(self, true: torch.Tensor | None, predicted: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """A row's features: the true ones of its pending tokens, then the predicted ones of its drafts."""
        return None

    def forward(self, cache: KVCache, slots: list[int], tokens: Sequence[list[int]],
                features: Sequence[torch.Tensor | None], all_logits: bool = False,
                parents: list[list[int]] | None = None, own_vocab: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward -> (logits, hidden [B, T, d]: the feature the model predicts after each position)."""
        return self.model.forward(cache, slots, list(tokens), all_logits=all_logits, features=True, parents=parents,
                                  own_vocab=own_vocab)

    def observe(self, cache: KVCache, seq: DraftState, tokens: Sequence[int], features: torch.Tensor | None) -> None:
        """The tokens the target emitted after this round's drafts: keep the accepted drafts' K/V, pend
        the rest. The last token is always fed again, as the next forward's input, even when it equals
        a fed draft (a residual that fell back to p may re-emit the rejected token)."""
        keep = min(accepted_prefix(seq.drafts, tokens), seq.fed, max(len(tokens) - 1, 0))
        cache.truncate(seq.slot, cache.lengths[seq.slot] - seq.fed + keep)
        seq.pending.extend(tokens[keep:])

    def observe_hit(self, cache: KVCache, seq: DraftState, tokens: Sequence[int], features: torch.Tensor | None):
        """SSD's hit: seq.slot is now the fork that holds context, these tokens and the fork's drafts."""
        seq.pending = []

    def keep_hit_drafts(self, cache: KVCache, seq: DraftState, held: int, n: int) -> int:
        """Of a hit's `held` cached drafts, n are handed out: keep the first n - 1 (the last is never
        fed) -> how many stay fed."""
        cache.truncate(seq.slot, cache.lengths[seq.slot] - held + n - 1)
        return n - 1

    def undo_hit(self, cache: KVCache, seq: DraftState, bonus: int, held: int) -> None:
        """A hit nobody drafted from: drop its `held` drafts, and its bonus back to pending (the next
        forward needs a token to feed, also after an outcome with no new tokens)."""
        cache.truncate(seq.slot, cache.lengths[seq.slot] - held - 1)
        seq.pending = [bonus, *seq.pending]

    def known(self, drafts: Sequence[int], predicted: Sequence[torch.Tensor]) -> int:
        """How many of the drafts can be fed in one forward (their inputs known)."""
        return len(drafts)


class FeatureFeed(TokenFeed):
    """A head's: each token with the feature of the position before it."""

    inputs = frozenset({"features"})

    def check(self, n: int, features: torch.Tensor | None, what: str) -> None:
        if features is None or len(features) != n:
            raise ValueError(f"a head needs the target's features at the {n} {what}, "
                             f"got {None if features is None else len(features)}")

    def first_feed(self, context: Sequence[int], features: torch.Tensor | None = None):
        """features [len(context) - 1, d]: the target's at every context position but the last (feature i
        pairs with context[i + 1])."""
        self.check(len(context) - 1, features, "positions before the context's last")
        return list(context[1:]), features.to(self.model.device)

    def take(self, cache: KVCache, seq: DraftState) -> tuple[list[int], torch.Tensor | None]:
        """The true positions end after the pending pairs."""
        tokens, features = seq.pending, seq.features
        if seq.more_features:
            features, seq.more_features = torch.cat([features, *seq.more_features]), []
        if tokens:
            seq.kept, seq.last = cache.lengths[seq.slot] + len(tokens), (tokens[-1], features[-1])
            seq.features = features[:0]
        seq.pending = []
        return tokens, features

    def row_features(self, true: torch.Tensor | None, predicted: Sequence[torch.Tensor]) -> torch.Tensor | None:
        return torch.cat([true.to(self.model.dtype), *[p[None] for p in predicted]])

    def forward(self, cache, slots, tokens, features, all_logits=False, parents=None, own_vocab=False):
        fed = torch.zeros(len(slots), max(map(len, tokens)), self.model.config.d_model, dtype=self.model.dtype,
                          device=self.model.device)
        for b, f in enumerate(features):
            fed[b, : len(f)] = f
        return self.model.forward(cache, slots, list(tokens), all_logits=all_logits, features=True,
                                  fed_features=fed, parents=parents, own_vocab=own_vocab)

    def observe(self, cache, seq, tokens, features):
        """features [len(tokens), d]: the target's at the position before each token. Drafts were fed
        predicted features: keep only true pairs, then pend these. With none (an outcome that emitted
        nothing), the last true pair is fed again: the next forward needs an input.

        Example: context [5, 6, 7] went in as the true pairs (6, f0), (7, f1) (seq.kept == 2), then the
        draft 8 with its predicted feature (3 cached positions). The target accepts 8 and emits 4, with
        its features g [2, d]: observe(cache, seq, [8, 4], g) cuts the cache back to 2 positions and
        pends seq.pending == [8, 4] (g joins seq.more_features); the next take feeds (8, g[0]), (4, g[1]).
        """
        self.check(len(tokens), features, "emitted tokens")
        cache.truncate(seq.slot, seq.kept)
        seq.pending += tokens
        if tokens:
            seq.more_features.append(features.to(seq.features))
        if not seq.pending and seq.last is not None:
            seq.kept -= 1
            cache.truncate(seq.slot, seq.kept)
            seq.pending, seq.features = [seq.last[0]], seq.last[1][None]

    def observe_hit(self, cache, seq, tokens, features):
        """A hit's fork holds its drafts from predicted features too: cut back the same way."""
        self.observe(cache, seq, tokens, features)

    def keep_hit_drafts(self, cache, seq, held, n) -> int:
        return 0  # observe_hit kept true pairs only: the drafts are fed again with the next pairs

    def undo_hit(self, cache, seq, bonus, held) -> None:
        pass  # the hit left neither drafts nor bonus in the cache: its bonus is a pending true pair

    def known(self, drafts, predicted) -> int:
        """A draft's input is the feature predicted at the position before it."""
        return min(len(drafts), len(predicted))


def feed_for(model: Llama) -> TokenFeed:
    return FeatureFeed(model) if model.config.feature_fed else TokenFeed(model)
