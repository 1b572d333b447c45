"""What the remote drafter reports, turned into this service's metrics and per-completion counts.
Built before the drafter, the decoder and the scheduler, so none of them needs another's reference."""

from __future__ import annotations

from dataclasses import dataclass

from specpool.target_service.metrics import TargetMetrics
from specpool.target_service.remote.fallback import Fallback
from specpool_client.v1 import speculation_pb2 as pb


@dataclass
class SequenceCounts:
    """One completion's speculation counts, for its SpeculationStats."""

    fallback_rounds: int = 0
    cache_hits: int = 0  # SSD
    cache_lookups: int = 0


class TargetObserver:
    """drafter.SpeculationObserver over the metrics and the counts of the sequences the
    scheduler follows (`follow` at admission, `unfollow` when they leave: reports after that are
    metrics only)."""

    def __init__(self, metrics: TargetMetrics):
        self.metrics = metrics
        self._counts: dict[str, SequenceCounts] = {}

    def follow(self, seq_id: str, counts: SequenceCounts) -> None:
        self._counts[seq_id] = counts

    def unfollow(self, seq_id: str) -> None:
        self._counts.pop(seq_id, None)

    def attached(self, capacity: pb.GetCapacityResponse) -> None:
        self.metrics.endpoint_attached.set(1)

    def fell_back(self, reason: Fallback, seq_ids: list[str]) -> None:
        self.metrics.fallback(reason, len(seq_ids))
        if reason.detaches:
            self.metrics.endpoint_attached.set(0)
        for seq_id in seq_ids:
            counts = self._counts.get(seq_id)
            if counts is not None:
                counts.fallback_rounds += 1

    def round_trip(self, wait_s: float, draft_s: float) -> None:
        self.metrics.spec_round_seconds.observe(wait_s)
        self.metrics.spec_wire_seconds.observe(max(0.0, wait_s - draft_s))

    def cache_stats(self, seq_id: str, hits: int, lookups: int) -> None:
        counts = self._counts.get(seq_id)
        if counts is not None:
            counts.cache_hits += hits
            counts.cache_lookups += lookups
