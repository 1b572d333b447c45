"""The registry as a router sees it: a snapshot re-read at most every max_age_s, kept through outages.

Redis going away must not stop the router: requests are placed on the last snapshot for up to
stale_ok_s. A Redis that comes back empty (restarted without persistence) refills within one
heartbeat; until then, for up to rebuild_grace_s, an empty read is taken for a rebuild, not for a
cluster that vanished, and the previous snapshot is kept.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from specpool.registry import EndpointRegistration, Registry, TargetRegistration

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Snapshot:
    targets: list[TargetRegistration] = field(default_factory=list)
    endpoints: list[EndpointRegistration] = field(default_factory=list)
    read_at: float = 0.0  # monotonic time of the read it came from (0: never read)
    reachable: bool = True  # False: Redis could not be read; this is an older snapshot

    def models(self) -> list[str]:
        return sorted({t.model for t in self.targets})


class ClusterView:
    def __init__(self, registry: Registry, max_age_s: float = 0.25, stale_ok_s: float = 30.0,
                 rebuild_grace_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 on_error: Callable[[], None] | None = None):
        self.registry = registry
        self.max_age_s = max_age_s
        self.stale_ok_s = stale_ok_s
        self.rebuild_grace_s = rebuild_grace_s
        self.clock = clock
        self.on_error = on_error
        self._snapshot = Snapshot()
        self._last_full: Snapshot | None = None  # the newest read that found members
        self._lock = threading.Lock()

    def snapshot(self) -> Snapshot:
        with self._lock:
            now = self.clock()
            last = self._snapshot
            if last.reachable and last.read_at and now - last.read_at < self.max_age_s:
                return last
            try:
                fresh = Snapshot(self.registry.targets(), self.registry.endpoints(), now)
            except redis.RedisError as e:
                if self.on_error is not None:
                    self.on_error()
                if self._snapshot.reachable:
                    log.warning("registry unreachable (%s); placing on the last snapshot for up to %.0fs",
                                e, self.stale_ok_s)
                last = self._last_full or self._snapshot
                usable = last.read_at and now - last.read_at < self.stale_ok_s
                self._snapshot = Snapshot(last.targets if usable else [], last.endpoints if usable else [],
                                          last.read_at, reachable=False)
                return self._snapshot
            if not self._snapshot.reachable:
                log.info("registry reachable again")
            if fresh.targets or fresh.endpoints:
                self._last_full = fresh
            elif self._last_full is not None and now - self._last_full.read_at < self.rebuild_grace_s:
                # Everything gone at once: a restarted, empty Redis that heartbeats are refilling.
                fresh = Snapshot(self._last_full.targets, self._last_full.endpoints, now)
            self._snapshot = fresh
            return fresh
