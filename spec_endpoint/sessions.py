"""Endpoint sessions: one per (tenant, request id), under a lease that every round renews.

The table is pure bookkeeping (which drafter, which sampler, what was drafted and accepted); the
drafters hold the model state and the endpoint keeps the two in step.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specpool.engine.drafters.base import accepted_prefix
from specpool.engine.verification import token_tree

if TYPE_CHECKING:
    from specpool.engine.method import Method
    from specpool.engine.verification.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class SessionKey:
    tenant: str
    request_id: str

    @property
    def drafter_id(self) -> str:
        """The sequence id inside a drafter shared by all tenants (length-prefixed: unambiguous)."""
        return f"{len(self.tenant)}:{self.tenant}/{self.request_id}"


@dataclass(slots=True)
class Session:
    key: SessionKey
    model: str
    kind: Method
    params: SamplingParams
    dense: bool  # its q rows travel on the tensor channel (speculation.q_travels_dense)
    lease_s: float
    expires_at: float
    length: int  # tokens the drafter knows: context plus every reported new token
    tree: bool = False  # its drafts are token trees
    last_drafts: tuple[int, ...] = ()  # sent in the previous round, awaiting their outcome
    last_parents: tuple[int, ...] | None = None  # their tree's parents (None: a chain)
    needs_tokens: bool = False  # drafted since the last new tokens: the next draft needs some
    push: bool = False  # SSD: outcome tables go to the target as soon as they are built
    stream: object = None  # the Rounds stream it last came on: where its push tables go
    drafted: int = 0
    accepted: int = 0
    # A feature-fed drafter's session until its first round brings the context's features: the context.
    unstarted_context: tuple[int, ...] | None = None

    def renew(self, now: float) -> None:
        self.expires_at = now + self.lease_s

    def record_outcome(self, new_tokens: Sequence[int]) -> int:
        """The target's new tokens verify the drafts sent last: -> how many of them it accepted."""
        if self.last_parents is None:
            accepted = accepted_prefix(self.last_drafts, new_tokens)
        else:
            accepted = len(token_tree.matched_path(self.last_drafts, self.last_parents, new_tokens))
        self.last_drafts, self.last_parents = (), None
        self.accepted += accepted
        self.length += len(new_tokens)
        if new_tokens:
            self.needs_tokens = False
        return accepted

    def record_drafts(self, tokens: Sequence[int], parents: Sequence[int] | None = None) -> None:
        self.last_drafts = tuple(tokens)
        self.last_parents = None if parents is None else tuple(parents)
        self.drafted += len(tokens)
        self.needs_tokens = True


@dataclass(slots=True)
class TenantTotals:
    """Cumulative over the endpoint's life, closed and expired sessions included."""

    drafted: int = 0
    accepted: int = 0
    # A feature-fed drafter's session until its first round brings the context's features: the context.
    unstarted_context: tuple[int, ...] | None = None


class SessionTable:
    """Thread-safe map (tenant, request id) -> Session, with open sessions per tenant and totals per
    tenant label (`label`: tenant -> its metric label, so invented tenant names add no entries)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, label: Callable[[str], str] = str):
        self.clock = clock
        self.label = label
        self._lock = threading.Lock()
        self._sessions: dict[SessionKey, Session] = {}
        self._active: Counter[str] = Counter()  # tenant -> open sessions
        self._totals: dict[str, TenantTotals] = {}  # by label

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, key: SessionKey) -> Session | None:
        return self._sessions.get(key)

    def add(self, session: Session) -> None:
        with self._lock:
            self._remove(session.key)
            self._sessions[session.key] = session
            self._active[session.key.tenant] += 1
            self._totals.setdefault(self.label(session.key.tenant), TenantTotals())

    def pop(self, key: SessionKey) -> Session | None:
        with self._lock:
            return self._remove(key)

    def pop_expired(self, now: float) -> list[Session]:
        with self._lock:
            expired = [s for s in self._sessions.values() if s.expires_at <= now]
            for s in expired:
                self._remove(s.key)
            return expired

    def _remove(self, key: SessionKey) -> Session | None:
        session = self._sessions.pop(key, None)
        if session is not None:
            self._active[key.tenant] -= 1
            if not self._active[key.tenant]:
                del self._active[key.tenant]
        return session

    def count(self, tenant: str, drafted: int = 0, accepted: int = 0) -> None:
        with self._lock:
            totals = self._totals.setdefault(self.label(tenant), TenantTotals())
            totals.drafted += drafted
            totals.accepted += accepted

    def active(self, tenant: str) -> int:
        return self._active.get(tenant, 0)

    def active_labelled(self, label: str) -> int:
        """Open sessions of every tenant counted under `label`."""
        with self._lock:
            return sum(n for tenant, n in self._active.items() if self.label(tenant) == label)

    def tenants(self) -> list[tuple[str, int, TenantTotals]]:
        """(label, active sessions, totals) for every label seen, sorted."""
        with self._lock:
            active: Counter[str] = Counter()
            for tenant, n in self._active.items():
                active[self.label(tenant)] += n
            return [
                (label, active[label], TenantTotals(tot.drafted, tot.accepted))
                for label, tot in sorted(self._totals.items())
            ]
