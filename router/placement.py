"""Which target replica serves a request: filters, then weighted scorers in [0, 1], then one picker.

Everything here is a pure function of the request and the registry snapshot, so two router replicas
reading the same Redis place a request the same way: the picker draws by a weighted rendezvous hash
of the request's key and the replica id (never by process state or Python's salted hash()). Drawing
in proportion to the score, rather than taking the best, keeps routers from herding onto the replica
that looked least loaded in a heartbeat that is up to a second old.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specpool.common.registry_schema import TargetRegistration


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    model: str
    key: str  # seeds the draw: the session id, else the request id
    session_id: str = ""
    exclude: frozenset[str] = frozenset()  # replica ids that just failed this request


Filter = Callable[[PlacementRequest, list[TargetRegistration]], list[TargetRegistration]]
Scorer = Callable[[PlacementRequest, TargetRegistration, list[TargetRegistration]], float]


def rendezvous(key: str, member_id: str) -> int:
    """Highest-random-weight hash: stable across processes and machines."""
    return int.from_bytes(hashlib.blake2b(f"{key}\0{member_id}".encode(), digest_size=8).digest(), "big")


# -- filters ------------------------------------------------------------------------------------------


def serves_model(req: PlacementRequest, targets: list[TargetRegistration]) -> list[TargetRegistration]:
    return [t for t in targets if t.model == req.model]


def not_excluded(req: PlacementRequest, targets: list[TargetRegistration]) -> list[TargetRegistration]:
    return [t for t in targets if t.id not in req.exclude]


def session_home(req: PlacementRequest, targets: list[TargetRegistration]) -> list[TargetRegistration]:
    """With a session id: only the session's rendezvous replica among those with room (among all when
    none has room). A session keeps its replica (and its prefix cache) while that has room, and moves
    to its next rendezvous choice, the same on every router, when it does not."""
    if not req.session_id or not targets:
        return targets
    pool = [t for t in targets if t.free > 0] or targets
    return [max(pool, key=lambda t: (rendezvous(req.session_id, t.id), t.id))]


# -- scorers ------------------------------------------------------------------------------------------


def free_capacity(req: PlacementRequest, target: TargetRegistration,
                  candidates: list[TargetRegistration]) -> float:
    """Share of its batch that is free: (max_batch - running - queued) / max_batch, floored at 0."""
    return target.free / target.max_batch if target.max_batch > 0 else 0.0


# -- picker ---------------------------------------------------------------------------------------------

SCORE_FLOOR = 0.01  # a replica that looks full still gets a few requests: its heartbeat may be stale


def weighted_rendezvous(req: PlacementRequest,
                        scored: list[tuple[TargetRegistration, float]]) -> TargetRegistration:
    """Draws a replica with probability proportional to its score, deterministically per request key:
    the largest score / -ln(u), u uniform in (0, 1) from the rendezvous hash."""
    def draw(item: tuple[TargetRegistration, float]) -> tuple[float, str]:
        target, score = item
        u = ((rendezvous(req.key, target.id) >> 11) + 0.5) / 2**53  # exactly in (0, 1)
        return (score + SCORE_FLOOR) / -math.log(u), target.id

    return max(scored, key=draw)[0]


Picker = Callable[[PlacementRequest, list[tuple[TargetRegistration, float]]], TargetRegistration]


@dataclass(frozen=True, slots=True)
class Profile:
    filters: Sequence[Filter]
    scorers: Sequence[tuple[float, Scorer]]  # (weight, scorer); weights sum to 1
    picker: Picker


DEFAULT_PROFILE = Profile(
    filters=(serves_model, not_excluded, session_home),
    scorers=((1.0, free_capacity),),
    picker=weighted_rendezvous,
)


def place(req: PlacementRequest, targets: list[TargetRegistration],
          profile: Profile = DEFAULT_PROFILE) -> TargetRegistration | None:
    """The replica for the request, or None when no live one passes the filters."""
    candidates = list(targets)
    for keep in profile.filters:
        candidates = keep(req, candidates)
    if not candidates:
        return None
    scored = [(t, sum(weight * scorer(req, t, candidates) for weight, scorer in profile.scorers))
              for t in candidates]
    return profile.picker(req, scored)
