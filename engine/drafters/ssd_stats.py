"""What SSD measures online, and the fan-out it sizes from it: how many forks each acceptance length gets."""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


MIN_HIT_GAIN = 0.01  # one more fork per sequence must add this much to the expected hit ratio
RANKS_TO_TRUST = 50  # bonus ranks measured before the curve caps the forks


@dataclass
class SsdStats:
    """Measured online; they drive the fan-out and the backup choice, and feed the metrics."""

    lookups: int = 0
    hits: int = 0
    bonus_top1: int = 0  # outcomes whose bonus was the first candidate of its row
    accepted_on_hit: int = 0  # drafts accepted in rounds that were served from the cache
    rounds_on_hit: int = 0
    accepted_on_miss: dict[str, int] = field(default_factory=lambda: {"neural": 0, "fast": 0})
    rounds_on_miss: dict[str, int] = field(default_factory=lambda: {"neural": 0, "fast": 0})
    backups: dict[str, int] = field(default_factory=lambda: {"neural": 0, "fast": 0})
    # rank of the real bonus among its row's candidates (0 = first); misses beyond the list at the end
    bonus_ranks: list[int] = field(default_factory=lambda: [0] * 33)
    accept_ema: float = 0.5  # per-token acceptance a
    prespec_s: float = 0.0  # EMA seconds of one pre-speculation pass
    neural_s: float = 0.0  # EMA seconds of one neural backup draft
    verify_s: float = 0.0  # EMA seconds between handing out drafts and the arrival of their outcome

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def p_hit(self, fanout: int) -> float:
        total = sum(self.bonus_ranks)
        return sum(self.bonus_ranks[:fanout]) / total if total else 0.5

    def miss_exponent(self) -> float:
        """r in 1 - p_hit(F) = F^-r, least squares on log(1 - p_hit(F)) over F = 2..8."""
        xs, ys = [], []
        for f in range(2, 9):
            miss = 1 - self.p_hit(f)
            if 0 < miss < 1:
                xs.append(math.log(f))
                ys.append(math.log(miss))
        if not xs:
            return 1.0
        r = -sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
        return min(max(r, 0.05), 5.0)

    def expected_hits(self, most: int, k_max: int) -> list[float]:
        """[the hit ratio F forks per sequence would buy, for F = 0..most], spread as geometric_fanout spreads
        them: the chance of each accepted length k (a^k (1-a); a^K for all K) times that its bonus ranks within
        F_k. One pass over the curve for every F (it runs after every pre-speculation pass)."""
        a = min(max(self.accept_ema, 1e-3), 1 - 1e-3)
        r, total = self.miss_exponent(), sum(self.bonus_ranks)
        below = list(itertools.accumulate(self.bonus_ranks, initial=0))  # below[F]: ranks under F, as p_hit sums

        def p_hit(fanout: int) -> float:
            return below[min(fanout, len(self.bonus_ranks))] / total if total else 0.5

        chance = [(a ** k) * (1 - a if k < k_max else 1.0) for k in range(k_max + 1)]
        return [0.0] + [sum(c * p_hit(f) for c, f in zip(chance, geometric_fanout(forks, k_max, a, r)))
                        for forks in range(1, most + 1)]

    def useful_forks(self, k_max: int, most: int) -> int:
        """The fewest forks per sequence that no larger count up to `most` beats by MIN_HIT_GAIN of expected
        hit ratio per extra fork (`most` until RANKS_TO_TRUST bonus ranks are measured): past the knee of the
        bonus-rank curve a fork costs the endpoint a KV slot and a row of every pass, for other targets too,
        and buys nothing. Slopes over any span, not one step: the fan-out hands forks to accepted lengths
        unevenly, so a single extra fork may add nothing where the next adds a lot."""
        if sum(self.bonus_ranks) < RANKS_TO_TRUST:
            return most
        hits = self.expected_hits(most, k_max)
        for f in range(1, most):
            if all(hits[g] - hits[f] < MIN_HIT_GAIN * (g - f) for g in range(f + 1, most + 1)):
                return f
        return most

    def learn(self, k: int, tokens: Sequence[int], drafts: Sequence[int], rows: Sequence[torch.Tensor], source: str,
              forked: Collection[tuple[int, int]]) -> None:
        """Acceptance, hit and bonus-rank figures from one outcome: k of the drafts accepted, then `tokens`
        emitted; `rows` the candidate ids of each draft row, `forked` the outcomes pre-speculated."""
        K = len(drafts)
        self.accept_ema = ema(self.accept_ema, k / K if k < K else 1.0, 0.1)
        if source == "cache":
            self.accepted_on_hit += k
            self.rounds_on_hit += 1
        else:
            self.accepted_on_miss[source] = self.accepted_on_miss.get(source, 0) + k
            self.rounds_on_miss[source] = self.rounds_on_miss.get(source, 0) + 1
        if len(tokens) <= k or k >= len(rows):
            return
        bonus, banned = tokens[k], drafts[k] if k < K else -1
        ranked = [t for t in rows[k].tolist() if t != banned]
        rank = ranked.index(bonus) if bonus in ranked else len(self.bonus_ranks) - 1
        self.bonus_ranks[min(rank, len(self.bonus_ranks) - 1)] += 1
        self.bonus_top1 += rank == 0
        if forked:
            self.lookups += 1
            self.hits += (k, bonus) in forked and len(tokens) == k + 1

    def best_backup(self) -> str:
        """Neural (draft now) or fast (n-gram, no drafting time), from the expected-speedup formula
        [p_hit E_hit + (1-p_hit) E_miss] / [p_hit max(1, T_p) + (1-p_hit)(1 + T_b)], times in verify units."""
        if self.verify_s == 0.0 or self.rounds_on_miss.get("fast", 0) < 3:
            # Measure the fast backup a few times before trusting a comparison.
            return "fast" if self.backups["neural"] >= 3 and self.backups["fast"] < 3 else "neural"
        p = self.hit_ratio
        e_hit = 1 + (self.accepted_on_hit / self.rounds_on_hit if self.rounds_on_hit else 1.0)
        t_p = self.prespec_s / self.verify_s

        def speedup(kind: str, t_b: float) -> float:
            rounds = self.rounds_on_miss.get(kind, 0)
            e_miss = 1 + (self.accepted_on_miss.get(kind, 0) / rounds if rounds else 0.0)
            return (p * e_hit + (1 - p) * e_miss) / (p * max(1.0, t_p) + (1 - p) * (1 + t_b))

        return "neural" if speedup("neural", self.neural_s / self.verify_s) >= speedup("fast", 0.0) else "fast"


def ema(old: float, new: float, weight: float = 0.2) -> float:
    return new if old == 0.0 else (1 - weight) * old + weight * new


def geometric_fanout(budget: int, k_max: int, a: float, r: float) -> list[int]:
    """Forks per acceptance length k = 0..K: F_k ~ a^(k/(1+r)); the all-accepted term (k = K) scaled by
    (1-a)^(-1/(1+r)), since its probability a^K lacks the (1-a) of a rejection. Sums to `budget`."""
    a = min(max(a, 1e-3), 1 - 1e-3)
    w = [a ** (k / (1 + r)) for k in range(k_max + 1)]
    w[k_max] *= (1 - a) ** (-1 / (1 + r))
    total = sum(w)
    raw = [budget * x / total for x in w]
    fan = [int(x) for x in raw]
    # Largest remainders get the leftover forks.
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - fan[i], reverse=True)[: budget - sum(fan)]:
        fan[i] += 1
    return fan

