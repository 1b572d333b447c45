"""The narrow interface every drafter implements, and the draft-model drafter.

A drafter keeps its own per-sequence state and sees only deltas: the context once, then the
tokens each round appended. The n-gram drafter, the draft model and the remote speculation
endpoint all plug into `specpool.engine.decoding.generate` through this interface.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from specpool.engine.kv_cache import KVCache
from specpool.engine.model import Llama
from specpool.engine.sampling import SamplingParams, logits_to_probs, sample
from specpool.engine.tree_drafting import Candidates, TreeShape, grow_trees, tree_logprobs

if TYPE_CHECKING:
    from specpool.engine.ssd import Fork


@dataclass(frozen=True, slots=True)
class Drafts:
    """Proposed tokens for a batch of sequences, and how they were chosen.

    With `probs` the tokens were sampled from that dense q; with `topk_ids`/`topk_probs` from the
    top-k-truncated q those pairs describe; with neither they are deterministic (a point mass).
    """

    tokens: list[list[int]]  # ragged: row b may hold 0..K tokens
    probs: torch.Tensor | None = None  # [B, K, V]
    topk_ids: torch.Tensor | None = None  # [B, K, k]
    topk_probs: torch.Tensor | None = None  # [B, K, k]
    # Token trees: row b's node i has parent parents[b][i] (engine/token_tree.py). None: every row is a
    # chain. Tree nodes are deterministic, so trees come without q.
    parents: list[list[int]] | None = None

    @staticmethod
    def empty(batch: int) -> Drafts:
        return Drafts(tokens=[[] for _ in range(batch)])

    def select(self, rows: Sequence[int | None]) -> Drafts:
        """These rows in this order; None: a row without drafts (its q rows are zero, never read)."""
        if list(rows) == list(range(len(self.tokens))):
            return self

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            out = t.new_zeros((len(rows), *t.shape[1:]))
            for i, r in enumerate(rows):
                if r is not None:
                    out[i] = t[r]
            return out

        tokens = [list(self.tokens[r]) if r is not None else [] for r in rows]
        parents = None if self.parents is None else [list(self.parents[r]) if r is not None else [] for r in rows]
        return Drafts(tokens, pick(self.probs), pick(self.topk_ids), pick(self.topk_probs), parents)


class Drafter(Protocol):
    """The role every drafter plays, local or remote, model or n-gram or SSD: it is told a sequence's
    context once (`start`), proposes drafts for it (`propose`), observes what the target emitted after
    verifying them (`observe`), and forgets it (`release`).

    The members below `release` are optional: a drafter that subclasses Drafter gets their defaults,
    and a pooled endpoint reads them instead of asking which kind of drafter it holds."""

    # Inputs beyond token ids this drafter wants from the target ("features": the target's last hidden
    # states, for a feature-fed head). The caller passes each one declared here to `start` and
    # `observe` as a keyword argument of that name, and sends none that is not declared.
    inputs: frozenset[str] = frozenset()

    def start(self, seq_id: str, context: Sequence[int]) -> None: ...

    def propose(
        self,
        seq_ids: Sequence[str],
        num_tokens: Sequence[int],
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Drafts: ...

    def observe(self, seq_id: str, tokens: Sequence[int]) -> None:
        """The tokens the target emitted for this sequence in the round just verified: the accepted
        prefix of the last drafts (see accepted_prefix), then the target's own token."""
        ...

    def release(self, seq_id: str) -> None: ...

    # -- optional members -----------------------------------------------------------------------

    # The KV cache of a drafter that runs a model (None: it holds no model state). Such a drafter
    # continues from the tokens emitted since its previous drafts, and n drafts take n - 1 positions.
    cache: KVCache | None = None
    # Drafts that no sampler changes (n-gram: point masses): one propose call serves every sampler.
    deterministic: bool = False
    # `propose` takes `sparse=` (q as top-k pairs, else dense rows) per call: one drafter then serves
    # sequences of either transport.
    sparse_q_per_call: bool = False
    # `propose` takes `tree=` per call: a TreeShape grows token trees of num_tokens nodes each, None
    # drafts chains (or, for a drafter built with a shape, trees of that one).
    grows_trees: bool = False
    # It works while the target verifies (SSD pre-speculates the likely outcomes): the caller calls
    # `prespeculate` after sending drafts, and `adopt` for drafts the target made itself instead.
    prespeculates: bool = False

    def outcome_arrived(self, seq_id: str, at: float) -> None:
        """When the outcome that `observe` gets next arrived (time.monotonic()), for a drafter that times
        the target's verification (SSD sizes its forks by it); without it, the time `observe` runs."""

    def served_from_cache(self, seq_id: str) -> bool:
        """Whether the sequence's last drafts were ready before it asked (an SSD hit)."""
        return False

    def adopt(self, seq_id: str, drafts: Sequence[int]) -> None:
        """The target verifies drafts of its own next (a miss it resolved locally)."""
        raise NotImplementedError(f"{type(self).__name__} does not pre-speculate")

    def prespeculate(self, seq_ids: Sequence[str]) -> None:
        """Prepare the next drafts of these sequences for the likely outcomes of their last ones."""

    def outcome_table(self, seq_id: str) -> dict[tuple[int, int], Fork]:
        """The prepared drafts by outcome (accepted drafts, bonus token): what push mode streams out."""
        return {}

    def fast_backup(self) -> bool:
        """Whether an outcome with no prepared drafts is best met by fast local (n-gram) drafts."""
        return False


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """One `propose` call's arguments: sequences sharing sampling parameters."""

    seq_ids: list[str]
    num_tokens: list[int]
    params: SamplingParams
    generator: torch.Generator | None


def accepted_prefix(drafts: Sequence[int], emitted: Sequence[int]) -> int:
    """How many of the drafts the target accepted, given the tokens it emitted after them: the length
    of their common prefix (the token after it is the target's own)."""
    n = 0
    for draft, token in zip(drafts, emitted, strict=False):
        if draft != token:
            break
        n += 1
    return n


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


def propose_all(drafter: Drafter, requests: Sequence[DraftRequest]) -> list[Drafts]:
    """Drafts for several sampling-parameter groups of one step. A drafter that can serve them all
    at once (the remote endpoint: one message per step) defines `propose_groups`."""
    if hasattr(drafter, "propose_groups"):
        return drafter.propose_groups(requests)
    return [drafter.propose(r.seq_ids, r.num_tokens, r.params, r.generator) for r in requests]


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
