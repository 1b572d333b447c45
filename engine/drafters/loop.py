"""The one drafting loop of a model drafter, and how it picks its tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specpool.engine.drafters.base import Drafts
from specpool.engine.runtime.kv_cache import KVCache
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.sampling import SamplingParams, logits_to_probs, sample


def sample_top_k(q: torch.Tensor, k: int, generator: torch.Generator | None):
    """[N, V] q -> (tokens [N], ids [N, k], probs [N, k]): drawn from q's k likeliest tokens renormalised,
    so the sparse q sent with the drafts is exactly the q they were drawn from."""
    top = torch.topk(q, k, dim=-1)
    weights = top.values / top.values.sum(-1, keepdim=True)
    picked = top.indices.gather(-1, sample(weights, generator)[:, None]).squeeze(-1)
    return picked, top.indices, weights


# pick(step, active rows, their logits [A, V]) -> the tokens [A] those rows draft at that step
Pick = Callable[[int, list[int], torch.Tensor], torch.Tensor]


def draft_steps(model: Llama, cache: KVCache, slots: Sequence[int], feeds: Sequence[list[int]],
                num_tokens: Sequence[int], pick: Pick) -> list[list[int]]:
    """The draft model's drafting loop: row b feeds feeds[b], then each token it drafts, for
    num_tokens[b] steps; one forward a step for every row still drafting. The last draft of a row is
    never fed: its cache holds the feed and its first n - 1 drafts."""
    tokens: list[list[int]] = [[] for _ in slots]
    feed = list(feeds)
    for j in range(max(num_tokens, default=0)):
        active = [b for b, n in enumerate(num_tokens) if n > j]
        logits = model.forward(cache, [slots[b] for b in active], [feed[b] for b in active])
        for b, t in zip(active, pick(j, active, logits).tolist()):
            tokens[b].append(t)
            feed[b] = [t]
    return tokens


class DraftPicker:
    """How a model drafter picks its tokens from its logits, and the q it records for them: greedy, or
    sampled from the target's transform of its logits with q kept dense, or as the top-k pairs sampled
    from (so q on the wire is exactly the q used)."""

    def __init__(self, batch: int, k: int, vocab_size: int, params: SamplingParams,
                 generator: torch.Generator | None, sparse: bool):
        self.params, self.generator = params, generator
        self.sampled = not params.greedy
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
