"""The one drafting loop of every model drafter (the draft model, the head, SSD's forks), and how a
drafter that samples picks its tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specpool.engine.drafters.base import Drafts
from specpool.engine.drafters.feeds import TokenFeed
from specpool.engine.runtime.kv_cache import KVCache
from specpool.engine.verification.sampling import SamplingParams, logits_to_probs, sample


def sample_top_k(q: torch.Tensor, k: int, generator: torch.Generator | None):
    """[N, V] q -> (tokens [N], ids [N, k], probs [N, k]): drawn from q's k likeliest tokens renormalised,
    so the sparse q sent with the drafts is exactly the q they were drawn from."""
    top = torch.topk(q, k, dim=-1)
    weights = top.values / top.values.sum(-1, keepdim=True)
    picked = top.indices.gather(-1, sample(weights, generator)[:, None]).squeeze(-1)
    return picked, top.indices, weights


def after_last(hidden: torch.Tensor, fed: Sequence[list[int]]) -> torch.Tensor:
    """hidden [B, T, d] of a forward that fed each row fed[b] -> [B, d]: the feature predicted after each
    row's last fed token."""
    return hidden[torch.arange(len(fed)), torch.tensor([len(f) - 1 for f in fed])]


# pick(step, active rows, their logits [A, V]) -> the tokens [A] those rows draft at that step
Pick = Callable[[int, list[int], torch.Tensor], torch.Tensor]


def draft_steps(feed: TokenFeed, cache: KVCache, slots: Sequence[int], tokens: Sequence[list[int]],
                features: Sequence[torch.Tensor | None], num_tokens: Sequence[int], pick: Pick,
                own_vocab: bool = False):
    """The drafting loop of every model drafter: row b feeds tokens[b] (with features[b], for a feed that
    reads them), then each token it drafts (with the feature predicted at the step before), for
    num_tokens[b] steps; one forward a step for every row still drafting. The last draft of a row is
    never fed: its cache holds the feed and its first n - 1 drafts. `own_vocab`: `pick` gets the logits
    of the model's own output rows (Llama.forward) and picks rows, mapped here to tokens.
    -> (drafts per row, the feature predicted after each of its steps)."""
    drafts: list[list[int]] = [[] for _ in slots]
    predicted: list[list[torch.Tensor]] = [[] for _ in slots]
    feed_tokens, feed_features = list(tokens), list(features)
    for j in range(max(num_tokens, default=0)):
        active = [b for b, n in enumerate(num_tokens) if n > j]
        fed = [feed_tokens[b] for b in active]
        logits, hidden = feed.forward(cache, [slots[b] for b in active], fed, [feed_features[b] for b in active],
                                      own_vocab=own_vocab)
        last = after_last(hidden, fed)
        for a, b in enumerate(active):
            predicted[b].append(last[a])
            feed_features[b] = last[a][None]
        picked = pick(j, active, logits)
        for b, t in zip(active, (feed.model.token_ids(picked) if own_vocab else picked).tolist()):
            drafts[b].append(t)
            feed_tokens[b] = [t]
    return drafts, predicted


class DraftPicker:
    """How a model drafter picks its tokens from its logits, and the q it records for them: greedy, or
    sampled from the target's transform of its logits with q kept dense, or as the top-k pairs sampled
    from (so q on the wire is exactly the q used)."""

    def __init__(self, batch: int, k: int, vocab_size: int, params: SamplingParams,
                 generator: torch.Generator | None, sparse: bool):
        self.params, self.generator = params, generator
        self.sampled = not params.greedy
        self.own_vocab = not self.sampled  # a greedy pick needs no q over the whole vocabulary
        self.sparse = self.sampled and sparse and params.top_k > 0
        self.probs = torch.zeros(batch, k, vocab_size) if self.sampled and not self.sparse else None
        self.topk_ids = torch.zeros(batch, k, params.top_k, dtype=torch.long) if self.sparse else None
        self.topk_probs = torch.zeros(batch, k, params.top_k) if self.sparse else None

    def pick(self, j: int, active: list[int], logits: torch.Tensor) -> torch.Tensor:
        if self.sparse:
            picked, self.topk_ids[active, j], self.topk_probs[active, j] = sample_top_k(
                logits_to_probs(logits, self.params), self.params.top_k, self.generator)
            return picked
        if self.sampled:
            q = logits_to_probs(logits, self.params)  # [A, V]
            self.probs[active, j] = q
            return sample(q, self.generator)
        return logits.argmax(-1)

    def drafts(self, tokens: list[list[int]]) -> Drafts:
        return Drafts(tokens=tokens, probs=self.probs, topk_ids=self.topk_ids, topk_probs=self.topk_probs)
