"""The cluster registry in Redis: who serves what (TTL heartbeats) and who holds which draft slot (leases).

Schema (prefix "specpool" by default; every value is a string; ID is a member id, EP an endpoint id):

    specpool:target:TENANT:ID        hash of TargetRegistration fields; expires ttl_s after the last beat
                                     (TENANT URL-quoted: no ':' and no glob character in it)
    specpool:endpoint:ID             hash of EndpointRegistration fields; expires ttl_s after the last beat
    specpool:leases:{EP}             sorted set: lease id -> expiry (Redis server time, ms)
    specpool:lease-tenants:{EP}      hash: lease id -> tenant

Readers find records by SCAN, not through a shared index, so each member writes nothing but its own
key, and Redis ACLs can hold it to that (`member_acl`): a target's user may write only keys of its
tenant, an endpoint's only its own key. A record whose id or tenant is not its key's is dropped.

The two lease keys share a hash tag ({endpoint_id}), so one Lua script may touch both on a Redis
Cluster too. Both expire once their newest lease could have run out.

Publishers (target services, speculation endpoints) run a `Heartbeat`; readers (router replicas)
use `Registry`. Nothing lives only in a process: a Redis that restarts empty is refilled by the next
beats, and a lease whose holder died expires on its own.

The parts: registry_schema.py (the records, their keys and parsers, the members' ACL rules) and
registry_leases.py (the lease scripts); here, the Redis client, the publishers' Heartbeat and the
readers' Registry.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from specpool.common.errors import FieldError
from specpool.common.registry_leases import ACQUIRE_LUA, HELD_LUA, RELEASE_LUA, RENEW_LUA, lease_keys
from specpool.common.registry_schema import (
    KINDS,
    MAX_NAME_CHARS,
    PREFIX,
    RECORDS,
    EndpointRegistration,
    Kind,
    TargetRegistration,
    _glob_escaped,
    decode_record,
    encode_fields,
    member_key,
)

log = logging.getLogger(__name__)


def redacted(url: str) -> str:
    """The URL with its password replaced by ***: what logs, pages and status lines may show."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def connect(redis_url: str, timeout_s: float = 1.0) -> redis.Redis:
    """A client that fails fast while Redis is down and reconnects once it is back (one quick retry,
    which absorbs the stale pooled connection a restart leaves behind)."""
    return redis.Redis.from_url(
        redis_url, decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1),
    )


# -- publishers ---------------------------------------------------------------------------------------


class Heartbeat:
    """Publishes one member's fields every interval_s under a TTL of ttl_s, from a daemon thread.

    fields_fn() is read on every beat (live load); `id` and `updated` are added. Redis being down
    only delays the next beat: the thread keeps trying, and a restarted Redis is refilled. A
    fields_fn that raises skips the beat, so a broken member drops out when its TTL runs out.
    """

    def __init__(self, redis_url: str, kind: Kind, member_id: str, fields_fn: Callable[[], dict],
                 ttl_s: float = 5.0, interval_s: float = 1.0, prefix: str = PREFIX):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if not member_id:
            raise ValueError("member_id must not be empty")
        if not 0 < interval_s < ttl_s:
            raise ValueError(f"need 0 < interval_s < ttl_s, got {interval_s} and {ttl_s}")
        self.kind = kind
        self.member_id = member_id
        self.fields_fn = fields_fn
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self.prefix = prefix
        self.key = member_key(prefix, kind, member_id)  # a target's follows the tenant its fields name
        self._client = connect(redis_url, timeout_s=min(1.0, interval_s))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._healthy = True
        self.beats = 0  # successful writes

    def start(self) -> Heartbeat:
        if self._thread is not None:
            raise RuntimeError("Heartbeat already started")
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.kind}", daemon=True)
        self._thread.start()
        return self

    def beat(self) -> bool:
        """One write; True when Redis took it."""
        try:
            fields = encode_fields({**self.fields_fn(), "id": self.member_id, "updated": f"{time.time():.3f}"})
        except Exception:
            log.exception("heartbeat %s: reading fields failed; beat skipped", self.key)
            return False
        self.key = member_key(self.prefix, self.kind, self.member_id, fields.get("tenant", ""))
        try:
            with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(self.key)  # fields a member stops sending do not linger
                pipe.hset(self.key, mapping=fields)
                pipe.pexpire(self.key, int(self.ttl_s * 1000))
                pipe.execute()
        except redis.RedisError as e:
            if self._healthy:
                # A refusal (ResponseError: e.g. this member's Redis user may not write that key) is no outage.
                why = "refused the write" if isinstance(e, redis.ResponseError) else "unavailable"
                log.warning("heartbeat %s: Redis %s (%s); retrying every %.1fs", self.key, why, e, self.interval_s)
            self._healthy = False
            return False
        if not self._healthy:
            log.info("heartbeat %s: Redis is back; registered again", self.key)
        self._healthy = True
        self.beats += 1
        return True

    def stop(self, deregister: bool = True) -> None:
        """Stops beating; deregister=False leaves the entry to expire (as a crashed member's would)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if deregister:
            try:
                self._client.delete(self.key)
            except redis.RedisError as e:
                log.warning("heartbeat %s: could not deregister (%s); it expires in %.1fs", self.key, e, self.ttl_s)
        self._client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.beat()
            self._stop.wait(self.interval_s)


# -- the reader --------------------------------------------------------------------------------------


class Registry:
    """Live targets and endpoints, and draft-slot leases; every call is one or two Redis round trips.

    Calls raise redis.RedisError while Redis is unreachable: callers decide what an outage means.
    """

    def __init__(self, redis_url: str, prefix: str = PREFIX, timeout_s: float = 1.0,
                 on_dropped: Callable[[str], None] | None = None):
        """on_dropped(kind) is called for every record a read leaves out because it is malformed."""
        self.prefix = prefix
        self.client = connect(redis_url, timeout_s)
        self.on_dropped = on_dropped
        self._bad: dict[str, dict[str, str]] = {kind: {} for kind in KINDS}  # kind -> key -> why dropped
        self._acquire = self.client.register_script(ACQUIRE_LUA)
        self._renew = self.client.register_script(RENEW_LUA)
        self._release = self.client.register_script(RELEASE_LUA)
        self._held = self.client.register_script(HELD_LUA)

    def close(self) -> None:
        self.client.close()

    # -- members

    def targets(self) -> list[TargetRegistration]:
        return self._members("target")

    def endpoints(self) -> list[EndpointRegistration]:
        return self._members("endpoint")

    def _members(self, kind: str) -> list:
        """The kind's live, well-formed records. Only the fields a record has are read (HMGET), so junk
        fields cost nothing; a record that is malformed, not its key's, or not a hash at all is left out
        and counted."""
        keys = sorted(self.client.scan_iter(match=_glob_escaped(f"{self.prefix}:{kind}:") + "*", count=1000))
        if not keys:
            return []
        names = [f.name for f in dataclasses.fields(RECORDS[kind])]
        with self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hmget(key, names)
            replies = pipe.execute(raise_on_error=False)
        records, bad = [], {}
        for key, reply in zip(keys, replies):
            if isinstance(reply, list) and all(value is None for value in reply):
                continue  # expired since the scan, or a hash with none of the fields (nothing to place on)
            try:
                if isinstance(reply, Exception):  # e.g. WRONGTYPE: the key was overwritten with a non-hash
                    raise FieldError("record", f"unreadable ({reply})")
                record = decode_record(RECORDS[kind], dict(zip(names, reply)))
                if member_key(self.prefix, kind, record.id, getattr(record, "tenant", "")) != key:
                    raise FieldError("id", "the record's id or tenant is not its key's")
                records.append(record)
            except FieldError as e:
                bad[key.removeprefix(f"{self.prefix}:")] = str(e)
        self._dropped(kind, bad)
        return records

    def _dropped(self, kind: str, bad: dict[str, str]) -> None:
        """Counts each dropped record; logs a member once when its record turns bad (or bad another way)."""
        for member_id, why in bad.items():
            if self.on_dropped is not None:
                self.on_dropped(kind)
            if self._bad[kind].get(member_id) != why:
                log.warning("registry: dropped the record %r: %s", member_id[:MAX_NAME_CHARS], why)
        for member_id in self._bad[kind].keys() - bad.keys():
            log.info("registry: the record %r is readable again, or gone", member_id[:MAX_NAME_CHARS])
        self._bad[kind] = bad

    # -- leases

    def acquire(self, endpoint_id: str, tenant: str, lease_id: str, capacity: int,
                shares: Mapping[str, float], ttl_s: float) -> bool:
        """Takes one draft slot on endpoint_id for tenant, or returns False (see ACQUIRE_LUA)."""
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        bad = {t: w for t, w in shares.items() if not w > 0}
        if bad:
            raise ValueError(f"share weights must be > 0, got {bad}")
        args: list[object] = [tenant, lease_id, capacity, _ms(ttl_s)]
        for t, w in sorted(shares.items()):
            args += [t, repr(float(w))]
        return bool(self._acquire(keys=lease_keys(self.prefix, endpoint_id), args=args))

    def renew(self, endpoint_id: str, lease_id: str, ttl_s: float) -> bool:
        """Extends a held lease to ttl_s from now; False when it is gone (expired or released)."""
        return bool(self._renew(keys=lease_keys(self.prefix, endpoint_id), args=[lease_id, _ms(ttl_s)]))

    def release(self, endpoint_id: str, lease_id: str) -> bool:
        """Frees the slot; False when the lease was not held (already released or expired)."""
        return bool(self._release(keys=lease_keys(self.prefix, endpoint_id), args=[lease_id]))

    def held(self, endpoint_id: str) -> dict[str, int]:
        """Live leases on endpoint_id per tenant."""
        counts: dict[str, int] = {}
        for tenant in self._held(keys=lease_keys(self.prefix, endpoint_id)):
            counts[tenant] = counts.get(tenant, 0) + 1
        return counts


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))
