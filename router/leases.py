"""Draft slots this router replica holds for its in-flight requests.

The authoritative lease is in Redis (specpool.common.registry); this only remembers which to renew and
release. The TTL is short and the keeper thread renews every lease it holds every renew_s (a third
of the TTL), so a request may run as long as it likes, while a router that dies (SIGKILL, a lost
node) stops renewing and its slots free within one TTL: with 600 s a surviving router answered
no_slot on an empty endpoint for ten minutes. A lease that a restarted (empty) Redis lost is taken
again on the next renewal. A release that fails (Redis down) is logged; the lease then expires by
its TTL.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import redis

from specpool.common.registry import Registry

log = logging.getLogger(__name__)

LEASE_TTL_S = 10.0  # a dead router's slots free within this; renewed every third of it while held


@dataclass(frozen=True, slots=True)
class Lease:
    endpoint_id: str
    lease_id: str
    tenant: str
    capacity: int


class LeaseKeeper:
    def __init__(self, registry: Registry, shares: Mapping[str, float], ttl_s: float, renew_s: float | None = None,
                 on_error: Callable[[str], None] | None = None):
        self.registry = registry
        self.shares = dict(shares)
        self.ttl_s = ttl_s
        self.renew_s = renew_s if renew_s is not None else min(ttl_s / 3, 5.0)
        self.on_error = on_error or (lambda op: None)
        self._held: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_forever, name="lease-renewal", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def held(self) -> int:
        return len(self._held)

    def acquire(self, endpoint_id: str, tenant: str, capacity: int, request_id: str) -> Lease | None:
        """A slot for tenant, or None when its share is used up; raises redis.RedisError when Redis is down."""
        lease = Lease(endpoint_id, f"{request_id}:{uuid.uuid4().hex[:8]}", tenant, capacity)
        if not self.registry.acquire(endpoint_id, tenant, lease.lease_id, capacity, self.shares, self.ttl_s):
            return None
        with self._lock:
            self._held[lease.lease_id] = lease
        return lease

    def release(self, lease: Lease) -> None:
        with self._lock:
            if self._held.pop(lease.lease_id, None) is None:
                return  # released already
        try:
            self.registry.release(lease.endpoint_id, lease.lease_id)
        except redis.RedisError as e:
            self.on_error("release")
            log.warning("could not release draft slot %s on %s (%s); it expires in %.0fs",
                        lease.lease_id, lease.endpoint_id, e, self.ttl_s)

    def renew_all(self) -> None:
        with self._lock:
            leases = list(self._held.values())
        for lease in leases:
            try:
                if not self.registry.renew(lease.endpoint_id, lease.lease_id, self.ttl_s):
                    # Lost (Redis restarted empty, or it expired): take it again if the share allows.
                    self.registry.acquire(lease.endpoint_id, lease.tenant, lease.lease_id, lease.capacity,
                                          self.shares, self.ttl_s)
                    if lease.lease_id not in self._held:  # its request finished meanwhile
                        self.registry.release(lease.endpoint_id, lease.lease_id)
            except redis.RedisError as e:
                self.on_error("renew")
                log.warning("could not renew draft slots (%s); retrying in %.1fs", e, self.renew_s)
                return

    def _renew_forever(self) -> None:
        while not self._stop.wait(self.renew_s):
            self.renew_all()
