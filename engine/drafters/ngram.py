"""SSSD-style training-free drafting: n-gram matches in the request itself and in a datastore.

Three sources propose continuations of the current context:
- `NgramIndex`, per request, over prompt + generated tokens (code and chat answers repeat their
  own identifiers, signatures and phrases);
- `SuffixArrayDatastore`, shared, over model-generated text, built once by `specpool build-datastore`;
- a `SuffixStore` (engine/drafters/suffix_store.py) attached to the sequence: online, over its tenant's recent
  prompts and outputs, this one's included as it grows (SuffixDecoding).
All back off from the longest matching suffix to shorter ones. Their continuations are merged in
a trie, weighted by how many times and how specifically (suffix length, source) they occurred,
and the heaviest path is the draft (or, for trees, the heaviest nodes). The drafts are deterministic: the verifier treats them as a
point mass and never sees these scores.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from specpool.engine.drafters.base import Capabilities, Drafter, Drafts
from specpool.engine.drafters.lookup import NgramIndex, SuffixArrayDatastore
from specpool.engine.drafters.suffix_store import SuffixStore
from specpool.engine.plan import TreeShape
from specpool.engine.verification import token_tree


@dataclass
class _Trie:
    weight: float = 0.0
    children: dict[int, _Trie] = field(default_factory=dict)


def _merge(sources: Sequence[tuple[float, list[list[int]]]], length: int) -> _Trie:
    root = _Trie()
    for weight, conts in sources:
        for cont in conts:
            node = root
            for t in cont[:length]:
                node = node.children.setdefault(t, _Trie())
                node.weight += weight
    return root


def merge_candidates(sources: Sequence[tuple[float, list[list[int]]]], length: int) -> list[int]:
    """Merge weighted continuation sets into a trie; -> the heaviest path (at most `length` tokens)."""
    path, node = [], _merge(sources, length)
    while node.children and len(path) < length:
        tok, node = max(node.children.items(), key=lambda kv: kv[1].weight)
        path.append(tok)
    return path


def merge_candidates_tree(sources: Sequence[tuple[float, list[list[int]]]], budget: int,
                          max_depth: int) -> tuple[list[int], list[int]]:
    """The same trie -> its `budget` heaviest nodes as a token tree (tokens, parents), parents first.
    A node weighs at most its parent (every continuation through it also passes its parent), so the
    heaviest nodes, ties broken shallow-first, form a tree; siblings are distinct trie children."""
    nodes: list[tuple[float, int, int, int, int]] = []  # (-weight, depth, order, parent's order, token)
    frontier = deque([(-1, 0, _merge(sources, max_depth))])
    while frontier:  # breadth first: a parent is listed before its children
        parent, depth, trie = frontier.popleft()
        for tok, child in trie.children.items():
            nodes.append((-child.weight, depth, len(nodes), parent, tok))
            frontier.append((len(nodes) - 1, depth + 1, child))
    chosen = sorted(sorted(nodes)[:budget], key=lambda n: n[2])
    index = {n[2]: i for i, n in enumerate(chosen)}
    return [n[4] for n in chosen], [index[n[3]] if n[3] >= 0 else -1 for n in chosen]


class NgramDrafter(Drafter):
    """The Drafter for SSSD: per-request n-gram index, an optional shared datastore and, per sequence,
    an optional suffix store (`attach_store`)."""

    caps = Capabilities(deterministic=True, grows_trees=True)

    REQUEST_WEIGHT = 2.0  # a match in the request itself is worth more than one in the datastore
    # A suffix-store continuation of probability 1 weighs as a 4-token match in the request.
    STORE_WEIGHT = 8.0
    STORE_MIN_PROB = 0.05  # rarer suffix-store continuations are not drafted

    def __init__(self, datastore: SuffixArrayDatastore | None = None, max_n: int = 4, max_matches: int = 8):
        self.datastore = datastore
        self.max_n = max_n
        self.max_matches = max_matches
        self._index: dict[str, NgramIndex] = {}
        self._stores: dict[str, tuple[SuffixStore, str]] = {}  # seq_id -> (its tenant's store, its document)

    def start(self, seq_id: str, context: Sequence[int]) -> None:
        self.add_index(seq_id, self.index(context))

    def index(self, context: Sequence[int]) -> NgramIndex:
        """A request's index on its own (about 5 us a token): a caller may build it outside its lock."""
        index = NgramIndex(self.max_n)
        index.extend(context)
        return index

    def add_index(self, seq_id: str, index: NgramIndex) -> None:
        self._index[seq_id] = index

    def attach_store(self, seq_id: str, store: SuffixStore, doc_id: str) -> None:
        """Draft this sequence from `store` too, and add its context and every token it emits to the
        store as document `doc_id`, which outlives the sequence (later requests draft from it)."""
        store.extend(doc_id, self._index[seq_id].tokens)
        self._stores[seq_id] = (store, doc_id)

    def observe(self, seq_id: str, tokens: Sequence[int]) -> None:
        self._index[seq_id].extend(tokens)
        if seq_id in self._stores:
            store, doc_id = self._stores[seq_id]
            store.extend(doc_id, tokens)

    def release(self, seq_id: str) -> None:
        self._index.pop(seq_id, None)
        self._stores.pop(seq_id, None)

    def draft(self, seq_id: str, length: int) -> list[int]:
        """The heaviest continuation of up to `length` tokens."""
        return merge_candidates(self._sources(seq_id, length), length) if length > 0 else []

    def draft_tree(self, seq_id: str, budget: int, shape: TreeShape) -> tuple[list[int], list[int]]:
        """The heaviest `budget` nodes of every continuation found, up to the shape's depth -> (tokens, parents)."""
        if budget <= 0:
            return [], []
        return merge_candidates_tree(self._sources(seq_id, shape.max_depth), budget, shape.max_depth)

    def _sources(self, seq_id: str, length: int) -> list[tuple[float, list[list[int]]]]:
        index = self._index[seq_id]
        sources = []
        n, conts = index.continuations(length, self.max_matches)
        if conts:
            sources.append((self.REQUEST_WEIGHT * n, conts))
        if self.datastore is not None:
            n, conts = self.datastore.continuations(index.tokens, length, self.max_matches)
            if conts:
                sources.append((float(n), conts))
        if seq_id in self._stores:  # each leaf of the store's tree: a continuation weighted by its probability
            draft = self._stores[seq_id][0].propose(index.tokens, 2 * length, min_prob=self.STORE_MIN_PROB)
            leaves = set(range(len(draft.tokens))) - set(draft.parents)
            for leaf in sorted(leaves):
                path = [draft.tokens[i] for i in token_tree.path_to(draft.parents, leaf)]
                sources.append((self.STORE_WEIGHT * draft.probs[leaf], [path]))
        return sources

    def propose(self, seq_ids, num_tokens, params, generator, *, tree: TreeShape | None = None) -> Drafts:
        """tree: token trees of num_tokens nodes each (None: chains)."""
        if tree is None:
            return Drafts(tokens=[self.draft(s, n) for s, n in zip(seq_ids, num_tokens)])
        drafted = [self.draft_tree(s, n, tree) for s, n in zip(seq_ids, num_tokens)]
        return Drafts(tokens=[t for t, _ in drafted], parents=[p for _, p in drafted])


def build(sources) -> NgramDrafter:
    """The registry's n-gram drafter (drafters/registry.py): it needs no model, so every host has one."""
    return NgramDrafter(sources.datastore)
