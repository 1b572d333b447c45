"""The registry as a router sees it: a snapshot re-read at most every max_age_s, kept through outages.

Redis going away must not stop the router. While it is unreachable, requests are placed on the
members of the last snapshot, and `DirectChecks` health-checks those members over gRPC: one that
stops answering is no longer used, one that answers again is used again. Once Redis answers, the
registry is the source of truth again. A Redis that comes back empty (restarted without persistence)
refills within one heartbeat; until then, for up to rebuild_grace_s, an empty read is taken for a
rebuild, not for a cluster that vanished, and the members known before are kept.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import redis

from specpool.common.registry import Registry
from specpool.common.registry_schema import EndpointRegistration, TargetRegistration

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Snapshot:
    targets: list[TargetRegistration] = field(default_factory=list)
    endpoints: list[EndpointRegistration] = field(default_factory=list)
    read_at: float = 0.0  # monotonic time of the read it came from (0: never read)
    reachable: bool = True  # False: Redis could not be read; these are the members read before

    def models(self) -> list[str]:
        return sorted({t.model for t in self.targets})


class DirectChecks:
    """Health checks straight to the members, for while the registry cannot say who is alive.

    `check(addresses)` says which answered (all at once, each within its own timeout). From start() to
    stop(), every interval_s each watched member is checked; one that failed `misses` checks in a row
    is down until it answers again. Two misses, not one: a single slow answer from a busy member
    should not take it out of service.
    """

    def __init__(self, check: Callable[[list[str]], list[bool]], interval_s: float = 1.0, misses: int = 2):
        if interval_s <= 0 or misses < 1:
            raise ValueError(f"need interval_s > 0 and misses >= 1, got {interval_s} and {misses}")
        self.check = check
        self.interval_s = interval_s
        self.misses = misses
        self._addresses: list[str] = []
        self._failures: dict[str, int] = {}
        self._lock = threading.Lock()
        self._active = False
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, addresses: Iterable[str]) -> None:
        """Checks these members from now on; each counts as up until it fails."""
        with self._lock:
            self._addresses = sorted(set(addresses))
            self._failures = {}
            self._active = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="member-checks", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """Stops checking; what the last checks found stays readable through up()."""
        with self._lock:
            self._active = False

    def close(self) -> None:
        self._closed.set()

    def up(self, address: str) -> bool:
        with self._lock:
            return self._failures.get(address, 0) < self.misses

    def check_once(self) -> None:
        with self._lock:
            addresses = list(self._addresses)
        answered = self.check(addresses) if addresses else []
        with self._lock:
            for address, ok in zip(addresses, answered):
                before = self._failures.get(address, 0)
                self._failures[address] = 0 if ok else before + 1
                if ok and before >= self.misses:
                    log.info("%s answers health checks again; placing on it", address)
                elif not ok and before + 1 == self.misses:
                    log.warning("%s failed %d health checks in a row; not placing on it", address, self.misses)

    def _run(self) -> None:
        while not self._closed.wait(self.interval_s):
            with self._lock:
                active = self._active
            if not active:
                continue
            try:
                self.check_once()
            except Exception:  # a broken check must not end the checking
                log.exception("direct health checks failed")


class ClusterView:
    def __init__(self, registry: Registry, max_age_s: float = 0.25, rebuild_grace_s: float = 5.0,
                 checks: DirectChecks | None = None, clock: Callable[[], float] = time.monotonic,
                 on_error: Callable[[], None] | None = None):
        """checks: None trusts the last members read for as long as Redis stays away."""
        self.registry = registry
        self.max_age_s = max_age_s  # a snapshot older than this is read again
        self.rebuild_grace_s = rebuild_grace_s  # how long an emptied Redis may take to refill
        self.checks = checks
        self.clock = clock
        self.on_error = on_error  # counts failed reads for the router's metrics
        self._snapshot = Snapshot()
        self._tried_at: float | None = None  # the last read attempt, successful or not
        self._known = Snapshot()  # the newest read that found members
        self._known_at = 0.0  # when those members were last known to be in use: read, or checked in an outage
        self._lock = threading.Lock()

    def member_name(self, address: str) -> tuple[str, str] | None:
        """("target", tenant) or ("endpoint", id) of the member last known at address; None if none is."""
        known = self._known
        for t in known.targets:
            if t.address == address:
                return ("target", t.tenant) if t.tenant else None
        for e in known.endpoints:
            if e.address == address:
                return ("endpoint", e.id)
        return None

    def snapshot(self) -> Snapshot:
        with self._lock:
            now = self.clock()
            if self._tried_at is not None and now - self._tried_at < self.max_age_s:
                return self._snapshot
            self._tried_at = now
            try:
                fresh = Snapshot(self.registry.targets(), self.registry.endpoints(), now)
            except redis.RedisError as e:
                self._snapshot = self._unreachable(e, now)
                return self._snapshot
            if not self._snapshot.reachable:
                log.info("registry reachable again")
                if self.checks is not None:
                    self.checks.stop()
            if fresh.targets or fresh.endpoints:
                self._known, self._known_at = fresh, now
            elif self._known.read_at and now - self._known_at < self.rebuild_grace_s:
                # Everything gone at once: a restarted, empty Redis that heartbeats are refilling.
                fresh = self._answering(self._known, now, reachable=True)
            self._snapshot = fresh
            return fresh

    def _unreachable(self, error: redis.RedisError, now: float) -> Snapshot:
        if self.on_error is not None:
            self.on_error()
        if self._snapshot.reachable:
            log.warning("registry unreachable (%s); placing on the %d targets and %d endpoints read before%s",
                        error, len(self._known.targets), len(self._known.endpoints),
                        ", checking their health directly" if self.checks is not None else "")
            if self.checks is not None:
                self.checks.start(m.address for m in [*self._known.targets, *self._known.endpoints])
        # Still in use: a Redis that comes back empty gets its rebuild grace from now, not from the last read.
        self._known_at = now
        return self._answering(self._known, self._known.read_at, reachable=False)

    def _answering(self, known: Snapshot, read_at: float, reachable: bool) -> Snapshot:
        """known's members less those the direct checks found down."""
        up = self.checks.up if self.checks is not None else (lambda address: True)
        return Snapshot([t for t in known.targets if up(t.address)], [e for e in known.endpoints if up(e.address)],
                        read_at, reachable)
