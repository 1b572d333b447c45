"""What a bench mode's runner fills over a run's chunks (bench/modes.py builds the runners, bench/runner.py reads
the totals into a report row). Its own module so that bench/remote.py fills them without importing the modes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ModeTotals:
    new_tokens: int = 0
    seconds: float = 0.0
    target_steps: int | None = None
    first_tokens: int = 0
    drafted: int = 0
    fallback_rounds: int | None = None  # remote modes: rounds the target drafted locally
    cache_hits: int = 0  # SSD: rounds whose drafts came from the speculation cache
    cache_lookups: int = 0
    # remote modes: what the servers' /metrics counted over the chunks (bench/remote.py SERVER_COUNTS)
    server_counts: Counter[str] = field(default_factory=Counter)
    drafter_threads: int | None = None  # remote modes: the endpoint's threads (its busy seconds x these: core-seconds)
    predicted_speedups: list[float] = field(default_factory=list)  # the targets' policies' own, after each chunk
    outputs: list[list[int]] = field(default_factory=list)
    # modes of several targets at once (the -x2 modes): each target's own totals; the fields above sum them
    targets: list[ModeTotals] = field(default_factory=list)
