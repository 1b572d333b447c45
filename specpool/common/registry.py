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
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from specpool.common.errors import FieldError
from specpool.common.speculation import Method

log = logging.getLogger(__name__)

PREFIX = "specpool"
Kind = Literal["target", "endpoint"]
KINDS: tuple[str, ...] = ("target", "endpoint")


# -- what a record's fields may hold ------------------------------------------------------------------
# Every value is read as untrusted text: a record any of whose fields fails its parser is dropped
# whole (Registry._members), never half-used. Bounds are far above any real member's figures.

MAX_NAME_CHARS = 256  # ids, models, tenants
MAX_LIST_ITEMS = 64  # models an endpoint drafts for, methods a target offers
MAX_COUNT = 1 << 20  # batch sizes, queue lengths, sessions
MAX_ACCEPT_LEN = 1024.0  # tokens per target step, bonus included
MAX_SPEEDUP = 1000.0
_ADDRESS = re.compile(r"(?:[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]):([0-9]{1,5})")


def _optional_name(text: str) -> str:
    if len(text) > MAX_NAME_CHARS or not text.isprintable():
        raise ValueError(f"not at most {MAX_NAME_CHARS} printable characters")
    return text


def _name(text: str) -> str:
    if not text:
        raise ValueError("empty")
    return _optional_name(text)


def _address(text: str) -> str:
    match = _ADDRESS.fullmatch(text) if len(text) <= MAX_NAME_CHARS else None
    if match is None or not 0 < int(match[1]) < 65536:
        raise ValueError("not host:port")
    return text


def _optional_address(text: str) -> str:
    return _address(text) if text else ""


def _number(text: str, most: float) -> float:
    try:
        value = float(text) if len(text) <= 64 else math.nan  # float() takes 'nan', 'inf', '1e999'
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= most:  # False for nan too
        raise ValueError(f"not a number in [0, {most:g}]")
    return value


def _count(text: str) -> int:
    value = _number(text, MAX_COUNT)
    if not value.is_integer():
        raise ValueError("not a whole number")
    return int(value)


def _fraction(text: str) -> float:
    return _number(text, 1.0)


def _accept_len(text: str) -> float:
    return _number(text, MAX_ACCEPT_LEN)


def _speedup(text: str) -> float:
    return _number(text, MAX_SPEEDUP)


def _unix_time(text: str) -> float:
    return _number(text, 1e11)


def _list(text: str) -> tuple[str, ...]:
    items = tuple(x for x in text.split(",", MAX_LIST_ITEMS) if x)
    if len(items) > MAX_LIST_ITEMS:
        raise ValueError(f"more than {MAX_LIST_ITEMS} items")
    return tuple(_name(x) for x in items)


def _methods(text: str) -> tuple[str, ...]:
    # A newer target may offer a method this router does not know: it is left out, not the target.
    return tuple(m for m in _list(text) if m in _METHOD_NAMES)


_METHOD_NAMES = frozenset(m.value for m in Method)


def _parsed(parse: Callable[[str], object], default: object = dataclasses.MISSING):
    """A record field read from its hash by parse(text); without a default it is required."""
    return field(default=default, metadata={"parse": parse})


@dataclass(frozen=True, slots=True)
class TargetRegistration:
    id: str = _parsed(_name)  # its member id: the address a router reaches it on, host:port
    address: str = _parsed(_address)
    model: str = _parsed(_name)
    tenant: str = _parsed(_optional_name, "")  # its service id towards speculation endpoints
    max_batch: int = _parsed(_count, 0)
    running: int = _parsed(_count, 0)  # sequences in the batch
    queued: int = _parsed(_count, 0)  # requests waiting for a slot
    spec_endpoint: str = _parsed(_optional_address, "")  # address of its speculation endpoint ("" none)
    mean_accept_len: float = _parsed(_accept_len, 0.0)  # tokens per target step, bonus included (0: no data yet)
    # What its own hardware-aware policy predicts at batch size running + 1 (1.0: not known).
    predicted_speedup_draft: float = _parsed(_speedup, 1.0)
    predicted_speedup_ngram: float = _parsed(_speedup, 1.0)
    methods: tuple[str, ...] = _parsed(_methods, ())  # speculation it can do: draft_model, ngram, ssd
    updated: float = _parsed(_unix_time, 0.0)  # unix seconds of the beat

    @property
    def load(self) -> int:
        return self.running + self.queued

    @property
    def free(self) -> int:
        return max(0, self.max_batch - self.load)


@dataclass(frozen=True, slots=True)
class EndpointRegistration:
    id: str = _parsed(_name)
    address: str = _parsed(_address)
    models: tuple[str, ...] = _parsed(_list, ())  # target models it drafts for
    max_sessions: int = _parsed(_count, 0)
    active_sessions: int = _parsed(_count, 0)
    draft_busy_ratio: float = _parsed(_fraction, 0.0)  # 0-1
    acceptance: float = _parsed(_fraction, 0.0)  # accepted / drafted tokens, all tenants (0-1)
    hit_ratio: float = _parsed(_fraction, 0.0)  # SSD speculation-cache hits / lookups (0-1)
    updated: float = _parsed(_unix_time, 0.0)


RECORDS: dict[str, type] = {"target": TargetRegistration, "endpoint": EndpointRegistration}


def member_key(prefix: str, kind: str, member_id: str, tenant: str = "") -> str:
    """A member's record; a target's carries its tenant (kind endpoint: tenant unused)."""
    if kind == "target":
        return f"{prefix}:target:{urllib.parse.quote(tenant, safe='')}:{member_id}"
    return f"{prefix}:{kind}:{member_id}"


def _glob_escaped(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


# What a member's Redis user may run: its heartbeat (MULTI, DEL, HSET, PEXPIRE, EXEC) and nothing else.
MEMBER_COMMANDS = ("multi", "exec", "discard", "del", "hset", "pexpire", "ping")
# A router's: reading records (SCAN, HMGET) and the lease scripts (EVALSHA, with what the scripts call).
ROUTER_COMMANDS = ("ping", "scan", "hmget", "evalsha", "script|load", "time", "zrangebyscore",
                   "zremrangebyscore", "zscore", "zadd", "zrem", "hdel", "hset", "hvals", "pttl", "pexpire")


def member_acl(prefix: str, role: str, name: str = "") -> list[str]:
    """ACL rules (for ACL SETUSER, or a `user` line) of a role's Redis user: "target" (name: its tenant)
    writes only its tenant's target records, "endpoint" (name: its endpoint id) only its own record,
    "router" reads every record and writes leases."""
    if role == "target":
        keys = f"{prefix}:target:{urllib.parse.quote(name, safe='')}:*"
    elif role == "endpoint":
        keys = _glob_escaped(f"{prefix}:endpoint:{name}")
    elif role == "router":
        keys = f"{prefix}:*"
    else:
        raise ValueError(f"role must be target, endpoint or router, got {role!r}")
    commands = ROUTER_COMMANDS if role == "router" else MEMBER_COMMANDS
    return ["resetkeys", f"~{keys}", "nocommands", *(f"+{c}" for c in commands)]


def lease_keys(prefix: str, endpoint_id: str) -> list[str]:
    return [f"{prefix}:leases:{{{endpoint_id}}}", f"{prefix}:lease-tenants:{{{endpoint_id}}}"]


def encode_fields(fields: Mapping[str, object]) -> dict[str, str]:
    """Hash values: lists joined by commas, booleans 1/0, the rest str()."""
    out = {}
    for name, value in fields.items():
        if isinstance(value, (list, tuple, set, frozenset)):
            out[name] = ",".join(str(v) for v in value)
        elif isinstance(value, bool):
            out[name] = "1" if value else "0"
        else:
            out[name] = str(value)
    return out


def decode_record(cls: type, raw: Mapping[str, str | None]):
    """A registration from its hash, every field checked (see _parsed); unknown fields are ignored, missing
    optional ones keep their defaults. Raises FieldError naming the first field that is missing or bad."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        text = raw.get(f.name)
        if text is None:
            if f.default is dataclasses.MISSING:
                raise FieldError(f.name, "required")
            continue
        try:
            kwargs[f.name] = f.metadata["parse"](text)
        except ValueError as e:
            raise FieldError(f.name, f"{e}, got {text[:40]!r}{'...' if len(text) > 40 else ''}") from None
    return cls(**kwargs)


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


# -- draft-slot leases (atomic, in Lua) ----------------------------------------------------------------

# A lease is granted when, after granting it, every other tenant's unused guarantee still fits in the
# free slots: tenant t is guaranteed floor(capacity * w_t / sum w) slots, may borrow beyond that only
# slots nobody reserves, and tenants without a weight hold no guarantee. Expired leases are dropped
# first; acquiring a lease id already held renews it (a retried call is idempotent).
_PRUNE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  redis.call('HDEL', KEYS[2], unpack(expired))
end
"""

_KEEP_KEYS = """
if redis.call('PTTL', KEYS[1]) < ttl then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
"""

ACQUIRE_LUA = _PRUNE + """
local me, lease, capacity, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
if redis.call('ZSCORE', KEYS[1], lease) then
  redis.call('ZADD', KEYS[1], now + ttl, lease)
""" + _KEEP_KEYS + """
  return 1
end
local used, total = {}, 0
for _, tenant in ipairs(redis.call('HVALS', KEYS[2])) do
  used[tenant] = (used[tenant] or 0) + 1
  total = total + 1
end
local weights, wsum = {}, 0
for i = 5, #ARGV, 2 do
  local w = tonumber(ARGV[i + 1])
  weights[ARGV[i]] = w
  wsum = wsum + w
end
local reserved = 0
if wsum > 0 then
  for tenant, w in pairs(weights) do
    if tenant ~= me then
      local guaranteed = math.floor(capacity * w / wsum + 1e-9)
      reserved = reserved + math.max(0, guaranteed - (used[tenant] or 0))
    end
  end
end
if capacity - total - reserved < 1 then
  return 0
end
redis.call('ZADD', KEYS[1], now + ttl, lease)
redis.call('HSET', KEYS[2], lease, me)
""" + _KEEP_KEYS + """
return 1
"""

RENEW_LUA = _PRUNE + """
local lease, ttl = ARGV[1], tonumber(ARGV[2])
if not redis.call('ZSCORE', KEYS[1], lease) then
  return 0
end
redis.call('ZADD', KEYS[1], now + ttl, lease)
""" + _KEEP_KEYS + """
return 1
"""

RELEASE_LUA = """
redis.call('HDEL', KEYS[2], ARGV[1])
return redis.call('ZREM', KEYS[1], ARGV[1])
"""

HELD_LUA = _PRUNE + """
return redis.call('HVALS', KEYS[2])
"""


def guarantees(capacity: int, shares: Mapping[str, float]) -> dict[str, int]:
    """Slots reserved for each tenant: floor(capacity * w / sum w) (what ACQUIRE_LUA computes)."""
    total = sum(shares.values())
    if total <= 0:
        return {t: 0 for t in shares}
    return {t: int(capacity * w / total + 1e-9) for t, w in shares.items()}


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
