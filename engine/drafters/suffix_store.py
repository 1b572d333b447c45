"""SuffixDecoding-style drafting: token trees from frequency counts over many growing documents.

A document is one request's prompt plus its accepted tokens. Every substring of at most `max_depth`
tokens of every document is a path in one trie whose nodes count its occurrences. Appending a token
adds one occurrence of each of the `max_depth` substrings that end at it, so indexing costs
`max_depth` dict steps a token whatever the document's length; removing a document replays it and
takes back exactly what it added, so the trie is always the one its surviving documents would build.

`propose` matches the longest suffix of the context that has been seen followed by some token, then
grows a tree best-first by path probability: a child's share of its siblings' counts (so the
occurrence that ends the context itself, which has no continuation yet, takes no share), times its
parent's. Where a path outruns the trie's depth it re-matches the longest suffix of context + path,
so drafts can go deeper than `max_depth`.

`SuffixStores` keeps a private store per (model, tenant), and one pooled store per model for the
tenants that opt in to sharing; it bounds the number of stores as each store bounds its tokens.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

ROOT = 0
NO_NODE = -1
TOKEN_BITS = 32  # an edge's key is its parent's id << TOKEN_BITS | its token


@dataclass(slots=True)
class _Document:
    tokens: list[int] = field(default_factory=list)
    # Nodes of the suffixes of lengths 1..max_depth-1 ending at the last token: the ones the next
    # token extends (the occurrence of length max_depth cannot grow).
    open_nodes: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class TreeDraft:
    """A token tree (see token_tree: parents before children) and each node's probability of being
    accepted, by the store's own estimate (the product of the shares along its path)."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]

    @property
    def score(self) -> float:
        """Expected number of accepted tokens: what a caller compares drafts from different sources by."""
        return sum(self.probs)


class SuffixStore:
    """Occurrence counts of the substrings (up to `max_depth` tokens) of at most `max_tokens` tokens
    of documents; the least recently extended documents are evicted whole to stay within it.
    Not thread-safe: the caller serialises access."""

    def __init__(self, max_tokens: int, max_depth: int = 16):
        if max_tokens < 1 or max_depth < 2:
            raise ValueError("a store needs max_tokens >= 1 and max_depth >= 2 (a match plus one token)")
        self.max_tokens = max_tokens
        self.max_depth = max_depth
        self.num_tokens = 0
        self._docs: OrderedDict[Hashable, _Document] = OrderedDict()  # least recently extended first
        # The trie is flat arrays indexed by node id, not an object per node: a million small objects
        # make every full garbage collection of the process slow (measured: 1.2 s at 2M nodes).
        self._edges: dict[int, int] = {}  # parent << TOKEN_BITS | token -> child
        self._counts = array("q", [0])  # occurrences of the substring spelled by the path to the node
        self._tokens = array("q", [0])  # the token on the edge into the node
        # Each node's children, as a doubly linked list of siblings (unlinking one is O(1)).
        self._first_child = array("q", [NO_NODE])
        self._next_sibling = array("q", [NO_NODE])
        self._prev_sibling = array("q", [NO_NODE])
        self._free: list[int] = []  # ids of deleted nodes, to reuse

    @property
    def num_nodes(self) -> int:
        """Trie nodes but the root: about max_depth a token on text that rarely repeats itself."""
        return len(self._counts) - 1 - len(self._free)

    def __contains__(self, doc_id: Hashable) -> bool:
        return doc_id in self._docs

    def extend(self, doc_id: Hashable, tokens: Sequence[int]) -> None:
        """Appends tokens to a document (creating it), first evicting the least recently extended
        documents as far as needed to stay within max_tokens."""
        tokens = list(tokens)
        if not tokens:  # an empty document would hold memory that max_tokens does not count
            return
        if not (0 <= min(tokens) and max(tokens) < 1 << TOKEN_BITS):
            raise ValueError(f"token ids must lie in [0, 2**{TOKEN_BITS})")
        doc = self._docs.pop(doc_id, None) or _Document()
        if len(doc.tokens) + len(tokens) > self.max_tokens:
            # It can never fit whole: it restarts from its newest tokens.
            self._count(doc.tokens, [], -1)
            doc, tokens = _Document(), tokens[max(0, len(tokens) - self.max_tokens) :]
        while self._docs and self.num_tokens + len(tokens) > self.max_tokens:
            self.remove(next(iter(self._docs)))
        self._docs[doc_id] = doc
        doc.open_nodes = self._count(tokens, doc.open_nodes, +1)
        doc.tokens += tokens

    def remove(self, doc_id: Hashable) -> None:
        doc = self._docs.pop(doc_id, None)
        if doc is not None:
            self._count(doc.tokens, [], -1)

    def _count(self, tokens: list[int], open_nodes: list[int], delta: int) -> list[int]:
        """Adds delta to the count of every substring that ends in `tokens` and starts at most
        max_depth - 1 tokens earlier (at `open_nodes`) -> the open nodes after the last token."""
        edges, counts, deepest = self._edges, self._counts, self.max_depth - 1
        for t in tokens:
            grown = []
            for node in (ROOT, *open_nodes):
                key = node << TOKEN_BITS | t
                child = edges.get(key)
                if child is None:
                    child = edges[key] = self._new_node(node, t)
                counts[child] += delta
                if counts[child] == 0:
                    # Unlinked and freed; a replay still walks it, and so empties its subtree, before
                    # it ends (no node is created meanwhile to reuse its id).
                    del edges[key]
                    self._free_node(node, child)
                grown.append(child)
            open_nodes = grown[:deepest]
        self.num_tokens += delta * len(tokens)
        return open_nodes

    def _new_node(self, parent: int, token: int) -> int:
        node = self._free.pop() if self._free else self._grow()
        self._counts[node], self._tokens[node], self._first_child[node] = 0, token, NO_NODE
        head = self._first_child[parent]
        self._next_sibling[node], self._prev_sibling[node] = head, NO_NODE
        if head != NO_NODE:
            self._prev_sibling[head] = node
        self._first_child[parent] = node
        return node

    def _grow(self) -> int:
        """Adds a block of free ids (appending one at a time cost a third of indexing) -> one of them."""
        n = len(self._counts)
        block = array("q", [0]) * max(256, n // 4)
        for column in (self._counts, self._tokens, self._first_child, self._next_sibling, self._prev_sibling):
            column.extend(block)
        self._free.extend(range(len(self._counts) - 1, n, -1))
        return n

    def _free_node(self, parent: int, node: int) -> None:
        prev, next_ = self._prev_sibling[node], self._next_sibling[node]
        if prev == NO_NODE:
            self._first_child[parent] = next_
        else:
            self._next_sibling[prev] = next_
        if next_ != NO_NODE:
            self._prev_sibling[next_] = prev
        self._free.append(node)

    def _children(self, node: int) -> list[int]:
        children, child = [], self._first_child[node]
        while child != NO_NODE:
            children.append(child)
            child = self._next_sibling[child]
        return children

    def count(self, pattern: Sequence[int]) -> int:
        """Occurrences of a pattern of 1..max_depth tokens in the stored documents."""
        node = self._find(pattern)
        return 0 if node is None or not pattern else self._counts[node]

    def _find(self, pattern: Sequence[int]) -> int | None:
        edges, node = self._edges, ROOT
        for t in pattern:
            node = edges.get(node << TOKEN_BITS | t)
            if node is None:
                return None
        return node

    def _match(self, context: list[int]) -> int | None:
        """The node of the longest suffix of context (at most max_depth - 1 tokens) that occurs
        followed by some token, or None. A suffix of such a suffix is also followed by that token,
        so the length is found by bisection, trying the longest first: that is the usual answer
        along a draft that ran out of depth."""
        lo, hi, best = 1, min(len(context), self.max_depth - 1), None
        n = hi
        while lo <= hi:
            node = self._find(context[len(context) - n :])
            if node is not None and self._first_child[node] != NO_NODE:
                best, lo = node, n + 1
            else:
                hi = n - 1
            n = (lo + hi) // 2
        return best

    def propose(self, context: Sequence[int], budget: int, *, min_prob: float = 0.0) -> TreeDraft:
        """A tree of at most `budget` nodes continuing `context`, most probable nodes first (so
        parents before children, and siblings by decreasing count), none below `min_prob`."""
        tail = list(context[max(0, len(context) - self.max_depth + 1) :])
        start = self._match(tail) if budget > 0 else None
        tokens, parents, probs = [], [], []  # the TreeDraft's columns, filled best first
        if start is None:
            return TreeDraft(tokens, parents, probs)
        counts, edge_tokens = self._counts, self._tokens
        heap: list[tuple[float, int, int, int]] = []  # (-prob, tie, parent index, trie node)
        tie = itertools.count()

        def push_children(node: int, parent: int, prob: float) -> None:
            children = self._children(node)
            total = sum(counts[c] for c in children)
            room = budget - len(tokens)  # a sibling ranked below this many can never be drafted
            for child in heapq.nsmallest(room, children, key=lambda c: (-counts[c], edge_tokens[c])):
                p = prob * counts[child] / total
                if p < min_prob:
                    break
                heapq.heappush(heap, (-p, next(tie), parent, child))

        push_children(start, -1, 1.0)
        while heap and len(tokens) < budget:
            neg_prob, _, parent, node = heapq.heappop(heap)
            tokens.append(edge_tokens[node])
            parents.append(parent)
            probs.append(-neg_prob)
            if self._first_child[node] == NO_NODE:  # out of depth (or data) here: back off to context + path
                path, i = [], len(tokens) - 1
                while i >= 0:
                    path.append(tokens[i])
                    i = parents[i]
                node = self._match((tail + path[::-1])[-(self.max_depth - 1) :])
            if node is not None:
                push_children(node, len(tokens) - 1, -neg_prob)
        return TreeDraft(tokens, parents, probs)


class SuffixStores:
    """Suffix stores by tenant. A tenant's documents and drafts use its private store for the model
    unless it opts in (`share`), in which case they use the model's pooled store, which only
    opted-in tenants of that model read or write. The least recently used store is dropped beyond
    `max_stores`, so invented tenant names cannot exhaust memory."""

    def __init__(self, max_tokens: int, max_stores: int = 256, max_depth: int = 16):
        if max_stores < 1:
            raise ValueError("max_stores must be at least 1")
        self.max_tokens = max_tokens
        self.max_stores = max_stores
        self.max_depth = max_depth
        self._stores: OrderedDict[tuple[str, ...], SuffixStore] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._stores)

    @property
    def num_tokens(self) -> int:
        """Tokens held by every store."""
        return sum(store.num_tokens for store in self._stores.values())

    def for_tenant(self, model: str, tenant: str, *, share: bool = False) -> SuffixStore:
        """The store for a tenant's requests to a model (its vocabulary). `share` must be the
        tenant's own standing choice, not a request's: the pooled store holds every opted-in tenant's
        text, and its document ids must be unique across them (prefix them with the tenant)."""
        key = ("pool", model) if share else ("tenant", model, tenant)
        store = self._stores.pop(key, None)
        if store is None:
            store = SuffixStore(self.max_tokens, self.max_depth)
            if len(self._stores) >= self.max_stores:
                self._stores.popitem(last=False)
        self._stores[key] = store
        return store
