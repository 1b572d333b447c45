"""How a placed request speculates: draft model, SSD, n-gram, or not at all.

The target's own hardware-aware policy predicts the speedup of each method at its current batch size
plus this request (its heartbeat carries the figures): SSD's against plain decoding on all the cores
of its layout, since SSD pins the target to some of them and its drafter to the rest. AUTO plans the
fastest method predicted past the margin the target's policy speculates at (MIN_GAIN): inside it the
policy would draft nothing, and the plan's sessions would cost upkeep for no gain. The endpoint's
registration says whether it has room. A draft-model or SSD decision holds a slot leased atomically in
Redis for the request's tenant; when none is free the request still runs, with n-gram drafting or none,
and the reason is counted.

A target's predictions learn only from the methods it runs: a draft model its prior prices under the margin, or
under n-gram's prior, is never planned, so the target never learns that it pays (the Qwen2.5-Coder pair: its prior
predicted 1.07-1.11x, n-gram's 1.4-1.7x; the pair ran 1.3-1.45x through the servers, n-gram ~1.0x). So an AUTO
request whose plan would not draft with a model goes to the draft model anyway, as a probe, on the first of every
PROBE_EVERY such requests per target (Probes), where its endpoint drafts the model and a slot is free.

The converse: a method the target has not measured yet (its heartbeat lists it unmeasured) is priced from the same
prior, which is optimistic for drafting that costs nothing: n-gram's predicted 1.43-1.69x on the Qwen pair, above the
probed draft model's learned 1.3-1.45x, so AUTO planned n-gram (1.11x as it ran) for the later prompts of `make run`
(issue 51). So AUTO plans among the measured methods while one of them pays; an unmeasured one is planned only
where none measured pays, which is how a new target first tries it, and for one request of a burst (_fastest).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from specpool.common.registry_schema import EndpointRegistration, TargetRegistration
from specpool.engine.method import LOCAL_METHOD, METHODS, MIN_GAIN, NO_ESTIMATE, Method

# Reasons, as labelled in metrics and the capacity API.
REQUESTED = "requested"  # the request named the method and got it
PREDICTED_SPEEDUP = "predicted_speedup"  # the best predicted method (AUTO)
NO_SPEEDUP = "no_speedup"  # nothing predicted to beat plain decoding: declined to speculate
NO_SLOT = "no_slot"  # a draft model was wanted; the tenant's share of the endpoint is used up
NO_ENDPOINT = "no_endpoint"  # a draft model was wanted; the target has no live endpoint drafting its model
ENDPOINT_BUSY = "endpoint_busy"  # AUTO: the endpoint is saturated, a draft model would wait on it
REGISTRY_UNAVAILABLE = "registry_unavailable"  # a draft model was wanted; Redis could not lease a slot
PROBE = "probe"  # AUTO, a plan without the draft model: the draft model anyway, so the target measures it (Probes)

# The first of every 8 probe-eligible AUTO requests of a target is a probe: a new target learns from its first,
# and one whose estimate fell re-checks within 8. A probe of a pair that does not pay costs about what any plan
# under break-even does (its upkeep: such plans ran 0.90-0.94x AR), and the target's policy still drafts only
# where it predicts a gain (or probes itself), so 1 in 8 costs ~1% of the speed where the pair never pays, and
# at most an eighth of the difference where n-gram pays more.
PROBE_EVERY = 8
PROBE_METHOD = Method.DRAFT_MODEL


class LeaseUnavailable(Exception):
    """The slot could not be asked for (Redis down); the request runs without one."""


@dataclass(frozen=True, slots=True)
class Decision:
    method: Method
    reason: str
    leased: bool = False  # a draft slot is held for the request and must be released


class Probes:
    """Per target (by member id), which of its probe-eligible AUTO requests probe: the first of every `every`."""

    def __init__(self, every: int = PROBE_EVERY, max_targets: int = 4096):
        self.every = every
        self.max_targets = max_targets  # targets come and go: past this many, the counts start over
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()  # requests are routed on many threads

    def due(self, target_id: str) -> bool:
        with self._lock:
            if target_id not in self._counts and len(self._counts) >= self.max_targets:
                self._counts.clear()
            n = self._counts.get(target_id, 0)
            self._counts[target_id] = n + 1
        return n % self.every == 0


class Placed:
    """Per target (by member id), the requests this router placed there that are still running, each with the
    time it was placed: those placed after the target's last heartbeat are in no count it reported, and a burst
    of requests placed within one heartbeat all join one batch. So each is planned by the prediction at the batch
    it joins (TargetRegistration.speedup_at), not at the batch the heartbeat saw: the Qwen pair's routed AUTO at
    batch 4 planned four requests a burst from the figure for one, and ran 0.86x routed AR."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock  # unix seconds, as heartbeats are stamped
        self._placed: dict[str, dict[str, float]] = {}
        self._lock = threading.Lock()

    def since(self, target: TargetRegistration) -> int:
        """Requests placed on the target after its heartbeat and still running. Those placed before it are in its
        counts: forgotten here (a route never removed is forgotten too)."""
        with self._lock:
            requests = self._placed.get(target.id, {})
            for request_id in [r for r, at in requests.items() if at <= target.updated]:
                del requests[request_id]
            if not requests:
                self._placed.pop(target.id, None)
            return len(requests)

    def add(self, target_id: str, request_id: str) -> None:
        with self._lock:
            self._placed.setdefault(target_id, {})[request_id] = self.clock()

    def remove(self, target_id: str, request_id: str) -> None:
        with self._lock:
            requests = self._placed.get(target_id, {})
            requests.pop(request_id, None)
            if not requests:
                self._placed.pop(target_id, None)


def draft_endpoint(target: TargetRegistration,
                   endpoints: list[EndpointRegistration]) -> EndpointRegistration | None:
    """The live endpoint the target drafts on, if it drafts the target's model."""
    if not target.spec_endpoint:
        return None
    for e in endpoints:
        if target.spec_endpoint in (e.address, e.id):
            return e if not e.models or target.model in e.models else None
    return None


def decide(
    requested: Method | None,
    target: TargetRegistration,
    endpoint: EndpointRegistration | None,
    take_slot: Callable[[EndpointRegistration], bool],
    busy_limit: float = 0.95,
    probe_due: Callable[[], bool] = lambda: False,
    placed: int = 0,
) -> Decision:
    """How one request speculates; requested None is AUTO. take_slot leases a draft slot (True) or
    finds none (False), and raises LeaseUnavailable when it cannot tell. probe_due (asked only of an AUTO
    request that would not draft with a model, on a target whose endpoint could draft it) says whether this
    one probes (Probes.due). placed: requests placed on the target since its heartbeat, which the request's
    batch holds too (Placed)."""
    speedup_ngram = _speedup(target, LOCAL_METHOD, placed)
    if requested is not None and not requested.row.leases_slot:
        return Decision(requested, REQUESTED)
    if requested is None:  # AUTO: the best predicted, if the target's policy would speculate with it
        wanted, speedup = _fastest(target, placed)
        if (not wanted.row.leases_slot and _can_probe(target, endpoint, busy_limit, placed) and probe_due()
                and _leased(take_slot, endpoint)):
            return Decision(PROBE_METHOD, PROBE, leased=True)
        if not _pays(speedup):
            return Decision(Method.NONE, NO_SPEEDUP)
        if not wanted.row.leases_slot:
            return Decision(wanted, PREDICTED_SPEEDUP)
        if endpoint is not None and _saturated(endpoint, busy_limit):
            return _without_draft(speedup_ngram, ENDPOINT_BUSY)
        granted_reason = PREDICTED_SPEEDUP
    else:
        wanted, granted_reason = requested, REQUESTED
    if endpoint is None:
        return _without_draft(speedup_ngram, NO_ENDPOINT)
    try:
        if not take_slot(endpoint):
            return _without_draft(speedup_ngram, NO_SLOT)
    except LeaseUnavailable:
        return _without_draft(speedup_ngram, REGISTRY_UNAVAILABLE)
    return Decision(wanted, granted_reason, leased=True)


def _speedup(target: TargetRegistration, method: Method, placed: int = 0) -> float:
    return target.speedup_at(method.row.speedup_field, placed)


def _fastest(target: TargetRegistration, placed: int = 0) -> tuple[Method, float]:
    """The method the target predicts fastest at the batch the request joins, and its speedup, among those it
    has measured where one of them pays. A tie goes to the one that costs the endpoint less: n-gram drafting
    needs no slot, and SSD drafts for several outcomes a round.

    An untried prior is a trial: one request per heartbeat tries it, the first placed since the beat. The rest of
    a burst is planned by what the target measured (none, where nothing is): the Qwen pair's first burst of four
    at batch 4 all tried n-gram's prior (1.4x and more) and ran 0.77x AR."""
    offers = [(row.method, _speedup(target, row.method, placed)) for row in METHODS if row.speedup_field is not None
              and (not row.listed_only or row.method.value in target.methods)]
    measured = [offer for offer in offers if offer[0].value not in target.unmeasured]
    if any(speedup > MIN_GAIN for _, speedup in measured):  # an untried prior never outbids a measured gain
        offers = measured
    elif placed:  # a burst's later requests try no prior (NO_ESTIMATE, a forced length's, is none: planned as before)
        offers = [offer for offer in offers if offer in measured or offer[1] == NO_ESTIMATE]
    return max(offers, key=lambda offer: (offer[1], -offer[0].row.endpoint_cost), default=(Method.NONE, 0.0))


def _pays(speedup: float) -> bool:
    """Whether the target's policy would speculate at this predicted speedup: only past its margin. A plan
    inside it drafts nothing and still pays its upkeep (routed AUTO, planning n-gram from 1.0x, ran 0.90x and
    0.94x routed AR at batch 16 with 0.02 drafts a step; AMD EPYC, 2 cores, default cluster). A target with no policy
    (NO_ESTIMATE: a forced draft length) drafts whatever it is planned, so it is planned as before."""
    return speedup > MIN_GAIN or speedup == NO_ESTIMATE


def _without_draft(speedup_ngram: float, reason: str) -> Decision:
    return Decision(LOCAL_METHOD if _pays(speedup_ngram) else Method.NONE, reason)


def _saturated(endpoint: EndpointRegistration, busy_limit: float) -> bool:
    full = endpoint.max_sessions > 0 and endpoint.active_sessions >= endpoint.max_sessions
    return full or endpoint.draft_busy_ratio >= busy_limit


def _can_probe(target: TargetRegistration, endpoint: EndpointRegistration | None, busy_limit: float,
               placed: int = 0) -> bool:
    """Whether a probe could teach the target anything now, at little cost: it has a policy to learn (a forced
    draft length reports NO_ESTIMATE), and its endpoint is live, drafts its model, is not saturated and (where the
    target lists what it can do) the draft model is among it; and the request is the first placed since the
    target's beat. A burst's later requests would wait out the probe's session prefill on the endpoint and its
    catch-ups (Qwen pair, 2 cores: a probe in a burst of four at batch 4 cost the burst 13-20%, 0.12 drafts a
    step). Not the beat's load: it may be a second old, and one request at a time (`make run`) still probes."""
    listed = not target.methods or PROBE_METHOD.value in target.methods
    learns = _speedup(target, PROBE_METHOD) != NO_ESTIMATE
    return endpoint is not None and listed and learns and not placed and not _saturated(endpoint, busy_limit)


def _leased(take_slot: Callable[[EndpointRegistration], bool], endpoint: EndpointRegistration) -> bool:
    try:
        return take_slot(endpoint)
    except LeaseUnavailable:
        return False
