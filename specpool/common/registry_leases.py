"""Draft-slot leases, atomic in Redis: the Lua scripts Registry (specpool/common/registry.py) runs to
acquire, renew, release and count them, their two keys, and the guarantee each tenant's weight buys."""

from __future__ import annotations

from collections.abc import Mapping


def lease_keys(prefix: str, endpoint_id: str) -> list[str]:
    return [f"{prefix}:leases:{{{endpoint_id}}}", f"{prefix}:lease-tenants:{{{endpoint_id}}}"]


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

