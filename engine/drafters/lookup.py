"""Longest-suffix lookups for n-gram drafting: one request's n-gram index, and a datastore's suffix array."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SEPARATOR = -1  # between datastore documents: no match or continuation crosses it


class NgramIndex:
    """Every n-gram (n = 1..max_n) of one growing token sequence -> the positions where it ends."""

    def __init__(self, max_n: int = 4):
        self.max_n = max_n
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = defaultdict(list)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            i = len(self.tokens) - 1
            for n in range(1, min(self.max_n, i + 1) + 1):
                self._ends[tuple(self.tokens[i - n + 1 : i + 1])].append(i)

    def continuations(self, length: int, max_matches: int = 8) -> tuple[int, list[list[int]]]:
        """-> (matched suffix length, continuations of its most recent earlier occurrences)."""
        last = len(self.tokens) - 1
        for n in range(min(self.max_n, len(self.tokens)), 0, -1):
            # The most recent first, and only as many as wanted: in a loop an n-gram ends at nearly every
            # position, and slicing them all cost ~50 ms a lookup at 3000 tokens, on the target's step.
            earlier = (e for e in reversed(self._ends.get(tuple(self.tokens[-n:]), ())) if e < last)
            found = [self.tokens[e + 1 : e + 1 + length] for e in itertools.islice(earlier, max_matches)]
            found = [c for c in found if c]
            if found:
                return n, found
        return 0, []


class SuffixArrayDatastore:
    """A suffix array over token ids of many documents; longest-suffix lookup by binary search."""

    def __init__(self, tokens: np.ndarray, suffixes: np.ndarray, max_n: int = 6):
        self.tokens = tokens.astype(np.int32)
        self.suffixes = suffixes.astype(np.int32)
        self.max_n = max_n
        self._list = self.tokens.tolist()  # Python ints: cheaper slicing/comparison in the search

    @classmethod
    def build(cls, documents: Sequence[Sequence[int]], max_n: int = 6) -> SuffixArrayDatastore:
        parts = []
        for doc in documents:
            parts.extend(doc)
            parts.append(SEPARATOR)
        tokens = np.asarray(parts, dtype=np.int64)
        return cls(tokens, suffix_array(tokens), max_n)

    def save(self, path: Path) -> None:
        np.savez_compressed(path, tokens=self.tokens, suffixes=self.suffixes, max_n=self.max_n)

    @classmethod
    def load(cls, path: Path) -> SuffixArrayDatastore:
        data = np.load(path)
        return cls(data["tokens"], data["suffixes"], int(data["max_n"]))

    def __len__(self) -> int:
        return len(self._list)

    def _bound(self, pattern: list[int], lo: int, hi: int, upper: bool) -> int:
        """First suffix index in [lo, hi) whose prefix is >= pattern (> pattern when `upper`)."""
        m, toks, sa = len(pattern), self._list, self.suffixes
        while lo < hi:
            mid = (lo + hi) // 2
            start = int(sa[mid])
            prefix = toks[start : start + m]
            if prefix < pattern or (upper and prefix == pattern):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def continuations(self, context: Sequence[int], length: int, max_matches: int = 8) -> tuple[int, list[list[int]]]:
        """-> (matched suffix length, continuations of up to max_matches occurrences of the longest
        context suffix that occurs in the datastore)."""
        for n in range(min(self.max_n, len(context)), 0, -1):
            pattern = list(context[-n:])
            lo = self._bound(pattern, 0, len(self.suffixes), upper=False)
            hi = self._bound(pattern, lo, len(self.suffixes), upper=True)
            found = []
            for i in range(lo, min(hi, lo + max_matches)):
                after = int(self.suffixes[i]) + n
                cont = self._list[after : after + length]
                if SEPARATOR in cont:
                    cont = cont[: cont.index(SEPARATOR)]
                if cont:
                    found.append(cont)
            if found:
                return n, found
        return 0, []


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Suffix array by prefix doubling (O(N log^2 N) with numpy sorts; ~1 s per million tokens)."""
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64)
    k = 1
    while True:
        second = np.full(n, -1, dtype=np.int64)
        second[: n - k] = rank[k:] if k < n else second[:0]
        order = np.lexsort((second, rank))
        keys_r, keys_s = rank[order], second[order]
        changed = np.ones(n, dtype=np.int64)
        changed[1:] = (keys_r[1:] != keys_r[:-1]) | (keys_s[1:] != keys_s[:-1])
        new_rank = np.empty(n, dtype=np.int64)
        new_rank[order] = np.cumsum(changed) - 1
        rank = new_rank
        if rank.max() == n - 1 or k >= n:
            return order
        k *= 2


