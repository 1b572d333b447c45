"""The endpoint's Prometheus metrics (own registry; labelled by tenant/model, never by request id).

A tenant is a name in the request, so any client can invent new ones: only a bounded set of them
becomes label values (TenantLabels), and the rest are counted together.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class BusyWindow:
    """Fraction of recent wall time spent drafting, over a sliding window."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._spans: deque[tuple[float, float]] = deque()
        self._lock = threading.Lock()

    def add(self, start: float, end: float) -> None:
        with self._lock:
            self._spans.append((start, end))

    def ratio(self) -> float:
        now = self.clock()
        lo = now - self.window_s
        with self._lock:
            while self._spans and self._spans[0][1] <= lo:
                self._spans.popleft()
            busy = sum(min(end, now) - max(start, lo) for start, end in self._spans)
        return min(1.0, max(0.0, busy / self.window_s))


OTHER_TENANTS = "_other"  # not a DNS label, so no tenant the Helm chart names can collide with it


class TenantLabels:
    """The tenant label values: the first `limit` tenants to open a session keep their own name for the
    endpoint's life (a series never changes name); every later tenant is counted under OTHER_TENANTS."""

    def __init__(self, limit: int):
        self.limit = limit
        self._named: set[str] = set()
        self._lock = threading.Lock()

    def admit(self, tenant: str) -> None:
        with self._lock:
            if len(self._named) < self.limit:
                self._named.add(tenant)

    def of(self, tenant: str) -> str:
        return tenant if tenant in self._named else OTHER_TENANTS


class EndpointMetrics:
    def __init__(self, busy: BusyWindow | None = None, tenant_labels: int = 64):
        self.registry = CollectorRegistry()
        self.busy = busy or BusyWindow()
        self.tenants = TenantLabels(tenant_labels)
        r = self.registry
        self.rounds = Counter("specpool_spec_rounds", "Round requests received", ["tenant"], registry=r)
        self.draft_batches = Counter(
            "specpool_spec_draft_batches", "Batched draft calls (one per model, drafter and sampler group)", registry=r
        )
        self.shared_batches = Counter(
            "specpool_spec_shared_batches", "Draft batches whose forward served more than one tenant", registry=r
        )
        self.batch_tenants = Histogram(
            "specpool_spec_batch_tenants", "Tenants per draft batch", buckets=(1, 2, 3, 4, 6, 8, 16, 32), registry=r
        )
        self.batch_sequences = Histogram(
            "specpool_spec_batch_sequences", "Sequences per draft batch",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r,
        )
        self.drafted = Counter(
            "specpool_spec_drafted_tokens", "Draft tokens sent", ["tenant", "model"], registry=r
        )
        self.draft_forwards = Counter(
            "specpool_spec_draft_forwards", "Forwards of the draft models (one serves every sequence it batches): "
            "per target token, what pooling saves", ["model"], registry=r,
        )
        self.target_tokens = Counter(
            "specpool_spec_target_tokens", "Tokens the targets emitted in their sessions here (their outcomes)",
            ["model"], registry=r,
        )
        self.accepted = Counter(
            "specpool_spec_accepted_tokens", "Draft tokens the target accepted (its reported new tokens)",
            ["tenant", "model"], registry=r,
        )
        self.active_sessions = Gauge("specpool_spec_active_sessions", "Open sessions", ["tenant"], registry=r)
        self.max_sessions = Gauge("specpool_spec_max_sessions", "Sessions this endpoint holds at most "
                                  "(--max-sessions)", registry=r)
        self.sessions_expired = Counter(
            "specpool_spec_sessions_expired", "Sessions closed because their lease ran out", registry=r
        )
        self.draft_seconds = Histogram(
            "specpool_spec_draft_seconds", "Drafting time of one engine step",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0), registry=r,
        )
        self.busy_ratio = Gauge(
            "specpool_spec_draft_busy_ratio", "Fraction of recent wall time spent drafting (0-1)", registry=r
        )
        self.busy_ratio.set_function(self.busy.ratio)
        self.draft_threads = Gauge(
            "specpool_spec_draft_threads", "CPU threads its drafting runs on (torch's): times the busy ratio, the "
            "drafter cores busy; times the drafting seconds, drafter core-seconds", registry=r)
        self.draft_threads.set_function(torch.get_num_threads)
        self.dense_bytes = Counter(
            "specpool_spec_dense_bytes", "Bytes of dense q rows sent on tensor channels", registry=r
        )
        # SSD, per target model (engine/drafters/ssd_stats.py SsdStats, read after each pre-speculation pass)
        self.ssd_hit_ratio = Gauge("specpool_spec_ssd_cache_hit_ratio", "Outcomes found in the speculation cache",
                                   ["model"], registry=r)
        # The same as counters, which add up across endpoints and windows: rate(hits) / rate(lookups).
        self.ssd_hits = Counter("specpool_spec_ssd_cache_hits", "Outcomes found in the speculation cache",
                                ["model"], registry=r)
        self.ssd_lookups = Counter("specpool_spec_ssd_cache_lookups", "Outcomes looked up in the speculation cache",
                                   ["model"], registry=r)
        self.ssd_bonus_accuracy = Gauge("specpool_spec_ssd_bonus_prediction_accuracy",
                                        "Outcomes whose bonus token was the first candidate of its row", ["model"],
                                        registry=r)
        self.ssd_accept_length = Gauge("specpool_spec_ssd_accept_length",
                                       "Mean drafts accepted per round, by where the drafts came from",
                                       ["model", "source"], registry=r)
        self.ssd_backups = Counter("specpool_spec_ssd_backups", "Cache misses by the backup chosen",
                                   ["model", "backup"], registry=r)
        self.ssd_prespec_seconds = Gauge("specpool_spec_ssd_prespeculation_seconds",
                                         "Moving average of one pre-speculation pass", ["model"], registry=r)
        self.ssd_forks = Gauge("specpool_spec_ssd_forks_per_sequence",
                               "Forks per sequence now: as many as fit in the verify time", ["model"], registry=r)
        self._seen: dict[tuple[int, str], int] = {}  # (id of an SsdStats, a running total's name) -> counted
        # n-gram sessions' online suffix stores (engine.suffix_store), every model's: read at scrape time.
        self.suffix_tokens = Gauge("specpool_spec_suffix_store_tokens", "Tokens held by the tenants' suffix stores",
                                   registry=r)
        self.suffix_stores = Gauge("specpool_spec_suffix_stores", "Suffix stores held (one per tenant and model, "
                                   "one per model for the tenants that share)", registry=r)

    def observe_prespeculation(self, model: str, ssd) -> None:
        """After a pre-speculation pass of `ssd` (the drafter that pre-speculates: engine/drafters/ssd.py SsdDrafter)."""
        stats = ssd.stats
        self.ssd_hit_ratio.labels(model).set(stats.hit_ratio)
        if stats.lookups:
            self.ssd_bonus_accuracy.labels(model).set(stats.bonus_top1 / stats.lookups)
        if stats.rounds_on_hit:
            self.ssd_accept_length.labels(model, "cache").set(stats.accepted_on_hit / stats.rounds_on_hit)
        for source, rounds in stats.rounds_on_miss.items():
            if rounds:
                self.ssd_accept_length.labels(model, source).set(stats.accepted_on_miss[source] / rounds)
        for backup, count in stats.backups.items():
            self._count_up(self.ssd_backups.labels(model, backup), stats, f"backups/{backup}", count)
        self._count_up(self.ssd_hits.labels(model), stats, "hits", stats.hits)
        self._count_up(self.ssd_lookups.labels(model), stats, "lookups", stats.lookups)
        self.ssd_prespec_seconds.labels(model).set(stats.prespec_s)
        self.ssd_forks.labels(model).set(ssd.forks)

    def _count_up(self, counter, stats, name: str, total: int) -> None:
        """Moves `counter` on by what a running total of `stats` gained since the last pass (each drafter
        keeps its own SsdStats; a model's may be several)."""
        key = (id(stats), name)
        gained = total - self._seen.get(key, 0)
        if gained > 0:
            counter.inc(gained)
        self._seen[key] = total

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's current value (0 when absent): for tests and the capacity API."""
        return self.registry.get_sample_value(name, labels or {}) or 0.0
