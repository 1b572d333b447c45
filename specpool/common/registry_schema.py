"""The registry's records (specpool/common/registry.py has the schema): the fields a target's and an
endpoint's record hold, each read back through a parser that treats it as untrusted text; the keys
records live under, and the Redis ACL rules that hold each member to its own key."""

from __future__ import annotations

import dataclasses
import math
import re
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from specpool.common.errors import FieldError
from specpool.engine.method import NO_ESTIMATE, Method

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


def _speedups(text: str) -> tuple[float, ...]:
    items = [x for x in text.split(",", MAX_LIST_ITEMS) if x]
    if len(items) > MAX_LIST_ITEMS:
        raise ValueError(f"more than {MAX_LIST_ITEMS} items")
    return tuple(_speedup(x) for x in items)


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
    predicted_speedup_draft: float = _parsed(_speedup, NO_ESTIMATE)
    predicted_speedup_ngram: float = _parsed(_speedup, NO_ESTIMATE)
    # SSD's, over plain decoding on all the cores of its layout (serve-target --layout-cores).
    predicted_speedup_ssd: float = _parsed(_speedup, NO_ESTIMATE)
    # The same at batch sizes 1, 2, ... up to max_batch (at most MAX_LIST_ITEMS; none from an older target): a
    # router that placed more requests since this beat plans each by the batch it joins (speedup_at).
    predicted_speedup_draft_by_batch: tuple[float, ...] = _parsed(_speedups, ())
    predicted_speedup_ngram_by_batch: tuple[float, ...] = _parsed(_speedups, ())
    predicted_speedup_ssd_by_batch: tuple[float, ...] = _parsed(_speedups, ())
    methods: tuple[str, ...] = _parsed(_methods, ())  # speculation it can do: draft_model, ngram, ssd
    # Methods whose rounds it has not measured yet: their predicted speedup is its prior's (none listed before it).
    unmeasured: tuple[str, ...] = _parsed(_methods, ())
    format: str = _parsed(_optional_name, "")  # its weight format and the start-up check it passed (Llama.format_check)
    updated: float = _parsed(_unix_time, 0.0)  # unix seconds of the beat

    @property
    def load(self) -> int:
        return self.running + self.queued

    def speedup_at(self, speedup_field: str, placed: int = 0) -> float:
        """A method's predicted speedup (its field's name) for a request joining the batch after `placed` more
        requests than this beat counts: at batch load + placed + 1, as far as the by-batch list reaches."""
        by_batch = getattr(self, f"{speedup_field}_by_batch")
        if not by_batch:
            return getattr(self, speedup_field)
        return by_batch[min(self.load + placed, len(by_batch) - 1)]

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

