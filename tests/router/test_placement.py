"""Placement (filters -> scorers -> picker) and the speculation decision, as pure functions of a snapshot."""

from __future__ import annotations

from collections import Counter

import pytest

from specpool.common.registry_schema import EndpointRegistration, TargetRegistration
from specpool.engine.method import Method
from specpool.router.decisions import (
    ENDPOINT_BUSY,
    NO_ENDPOINT,
    NO_SLOT,
    NO_SPEEDUP,
    PREDICTED_SPEEDUP,
    PROBE,
    PROBE_EVERY,
    REGISTRY_UNAVAILABLE,
    REQUESTED,
    Decision,
    LeaseUnavailable,
    Placed,
    Probes,
    decide,
    draft_endpoint,
)
from specpool.router.placement import (
    SCORE_FLOOR,
    PlacementRequest,
    free_capacity,
    place,
    rendezvous,
    session_home,
)


def target(id: str, model: str = "m", running: int = 0, queued: int = 0, max_batch: int = 8, **kw):
    return TargetRegistration(id=id, address=id, model=model, max_batch=max_batch, running=running, queued=queued,
                              **kw)


# -- placement --------------------------------------------------------------------------------------


def test_filters_by_model_and_exclusions():
    targets = [target("a", "m"), target("b", "other"), target("c", "m")]
    assert place(PlacementRequest("other", "k"), targets).id == "b"
    assert place(PlacementRequest("m", "k", exclude=frozenset({"a", "c"})), targets) is None
    assert place(PlacementRequest("missing", "k"), targets) is None


def draws(targets, n: int = 2000) -> Counter:
    return Counter(place(PlacementRequest("m", f"req-{i}"), targets).id for i in range(n))


def test_equal_loads_spread_evenly():
    counts = draws([target("a"), target("b"), target("c")], 3000)
    assert set(counts) == {"a", "b", "c"} and min(counts.values()) > 850, counts


@pytest.mark.parametrize(("running", "queued"), [({"a": 6, "b": 1}, {}), ({"a": 1, "b": 2}, {"b": 3})])
def test_replicas_are_drawn_in_proportion_to_their_free_capacity(running, queued):
    targets = [target(i, running=r, queued=queued.get(i, 0)) for i, r in running.items()]
    weight = {t.id: free_capacity(PlacementRequest("m", ""), t, targets) + SCORE_FLOOR for t in targets}
    counts = draws(targets)
    for t in targets:
        assert counts[t.id] / 2000 == pytest.approx(weight[t.id] / sum(weight.values()), abs=0.04), counts


def test_a_full_replica_gets_almost_nothing_while_another_has_room():
    counts = draws([target("a", running=8), target("b", running=4, queued=3)])
    assert counts["a"] < 0.1 * counts["b"], counts
    assert free_capacity(PlacementRequest("m", ""), target("x", running=8, queued=5), []) == 0.0


def test_a_session_sticks_to_its_replica_while_it_has_room():
    targets = [target("a", running=5), target("b", running=0), target("c", running=2)]
    home = max(targets, key=lambda t: rendezvous("session-7", t.id)).id
    req = PlacementRequest("m", "session-7", session_id="session-7")
    assert place(req, targets).id == home, "affinity, whatever the load"
    assert session_home(req, targets) == [t for t in targets if t.id == home]
    full = [target(t.id, running=8 if t.id == home else t.running) for t in targets]
    moved = place(req, full).id
    assert moved != home, "a full home sends the session to its next choice"
    assert place(req, full).id == moved
    assert place(req, [target(t.id, running=8) for t in targets]).id == home, "all full: home again"


def test_placement_depends_only_on_the_snapshot():
    targets = [target("a", running=1), target("b", running=1), target("c", running=3)]
    for i in range(50):
        req = PlacementRequest("m", f"r{i}", session_id=f"s{i}" if i % 2 else "")
        assert place(req, targets).id == place(req, list(reversed(targets))).id


# -- the speculation decision ------------------------------------------------------------------------

ENDPOINT = EndpointRegistration(id="ep", address="h:9", models=("m",), max_sessions=8)
AUTO = None
DRAFT_MODEL, NGRAM, NONE, SSD = Method.DRAFT_MODEL, Method.NGRAM, Method.NONE, Method.SSD


def decided(requested: Method | None, draft: float, ngram: float, slot: bool | None = True,
            endpoint: EndpointRegistration | None = ENDPOINT, methods=("draft_model", "ngram"),
            ssd: float = 1.0) -> Decision:
    t = target("a", spec_endpoint="h:9", predicted_speedup_draft=draft, predicted_speedup_ngram=ngram,
               predicted_speedup_ssd=ssd, methods=methods)

    def take_slot(e):
        if slot is None:
            raise LeaseUnavailable
        return slot

    return decide(requested, t, endpoint, take_slot)


GRANTED = {"leased": True}
WITH_SSD = ("ssd", "draft_model", "ngram")


@pytest.mark.parametrize(("requested", "draft", "ngram", "context", "expected"), [
    # AUTO: the best predicted method, if it beats plain decoding
    (AUTO, 1.6, 1.2, {}, Decision(DRAFT_MODEL, PREDICTED_SPEEDUP, **GRANTED)),
    (AUTO, 1.1, 1.3, {}, Decision(NGRAM, PREDICTED_SPEEDUP)),
    (AUTO, 0.8, 0.9, {}, Decision(NONE, NO_SPEEDUP)),
    (AUTO, 0.7, 0.95, {}, Decision(NONE, NO_SPEEDUP)),
    # Inside the margin the target's policy speculates at (MIN_GAIN): it would draft nothing
    (AUTO, 1.05, 1.08, {}, Decision(NONE, NO_SPEEDUP)),
    (AUTO, 1.6, 1.05, {"slot": False}, Decision(NONE, NO_SLOT)),
    # No estimate (a target whose draft length is forced drafts whatever it is planned): planned as from 1.0
    (AUTO, 1.0, 1.0, {}, Decision(NGRAM, PREDICTED_SPEEDUP)),
    # SSD (its figure against plain decoding on all its layout's cores), where the target offers it
    (AUTO, 1.6, 1.2, {"methods": WITH_SSD, "ssd": 1.8}, Decision(SSD, PREDICTED_SPEEDUP, **GRANTED)),
    (AUTO, 1.6, 1.2, {"methods": WITH_SSD, "ssd": 1.4}, Decision(DRAFT_MODEL, PREDICTED_SPEEDUP, **GRANTED)),
    (AUTO, 1.6, 1.2, {"methods": WITH_SSD, "ssd": 1.6}, Decision(DRAFT_MODEL, PREDICTED_SPEEDUP, **GRANTED)),
    (AUTO, 1.1, 1.3, {"methods": WITH_SSD, "ssd": 1.2}, Decision(NGRAM, PREDICTED_SPEEDUP)),
    (AUTO, 0.9, 0.8, {"methods": WITH_SSD, "ssd": 1.15}, Decision(SSD, PREDICTED_SPEEDUP, **GRANTED)),
    (AUTO, 0.9, 0.8, {"methods": WITH_SSD, "ssd": 1.05}, Decision(NONE, NO_SPEEDUP)),  # inside the policy's margin
    (AUTO, 0.9, 0.8, {"methods": WITH_SSD, "ssd": 0.95}, Decision(NONE, NO_SPEEDUP)),  # slower than AR on all cores
    (AUTO, 1.6, 1.2, {"ssd": 2.0}, Decision(DRAFT_MODEL, PREDICTED_SPEEDUP, **GRANTED)),  # not offered
    (AUTO, 1.6, 1.2, {"methods": WITH_SSD, "ssd": 1.8, "slot": False}, Decision(NGRAM, NO_SLOT)),
    # AUTO wanted the draft model and could not have it
    (AUTO, 1.6, 1.2, {"slot": False}, Decision(NGRAM, NO_SLOT)),
    (AUTO, 1.6, 0.9, {"slot": False}, Decision(NONE, NO_SLOT)),
    (AUTO, 1.6, 1.2, {"endpoint": None}, Decision(NGRAM, NO_ENDPOINT)),
    (AUTO, 1.6, 1.2, {"slot": None}, Decision(NGRAM, REGISTRY_UNAVAILABLE)),
    # explicit methods are honoured whatever the prediction, unless no slot is free
    (DRAFT_MODEL, 0.5, 0.5, {}, Decision(DRAFT_MODEL, REQUESTED, **GRANTED)),
    (SSD, 1.5, 1.0, {}, Decision(SSD, REQUESTED, **GRANTED)),
    (SSD, 1.5, 1.0, {"methods": WITH_SSD, "ssd": 0.5}, Decision(SSD, REQUESTED, **GRANTED)),
    (DRAFT_MODEL, 1.5, 1.2, {"slot": False}, Decision(NGRAM, NO_SLOT)),
    (DRAFT_MODEL, 1.5, 0.9, {"slot": False}, Decision(NONE, NO_SLOT)),
    (NGRAM, 2.0, 0.5, {}, Decision(NGRAM, REQUESTED)),
    (NONE, 2.0, 2.0, {}, Decision(NONE, REQUESTED)),
])
def test_decisions(requested, draft, ngram, context, expected):
    assert decided(requested, draft, ngram, **context) == expected


def test_a_saturated_endpoint_is_not_chosen_automatically():
    busy = EndpointRegistration(id="ep", address="h:9", models=("m",), max_sessions=8, draft_busy_ratio=0.99)
    assert decided(AUTO, 1.6, 1.2, endpoint=busy) == Decision(NGRAM, ENDPOINT_BUSY)
    full = EndpointRegistration(id="ep", address="h:9", models=("m",), max_sessions=8, active_sessions=8)
    assert decided(AUTO, 1.6, 0.5, endpoint=full) == Decision(NONE, ENDPOINT_BUSY)
    assert decided(DRAFT_MODEL, 1.6, 1.2, endpoint=busy).method == DRAFT_MODEL, "an explicit request still tries"
    assert decided(AUTO, 1.0, 1.2, endpoint=busy, methods=WITH_SSD, ssd=1.6) == Decision(NGRAM, ENDPOINT_BUSY)


def test_a_target_drafts_on_the_endpoint_it_names_if_that_drafts_its_model():
    endpoints = [EndpointRegistration(id="ep-1", address="h:1", models=("m",)),
                 EndpointRegistration(id="ep-2", address="h:2", models=("other",))]
    assert draft_endpoint(target("a", spec_endpoint="h:1"), endpoints).id == "ep-1"
    assert draft_endpoint(target("a", spec_endpoint="ep-1"), endpoints).id == "ep-1"
    assert draft_endpoint(target("a", spec_endpoint="h:2"), endpoints) is None
    assert draft_endpoint(target("a", spec_endpoint="h:3"), endpoints) is None
    assert draft_endpoint(target("a"), endpoints) is None


def test_auto_requests_that_would_not_draft_with_the_model_probe_it_every_nth():
    """A prior under break-even (or under n-gram's) never plans the draft model, so the target would never learn
    that it pays: the first of every PROBE_EVERY AUTO requests per target that would not draft with it goes to
    it anyway, with a leased slot."""
    probes, leases = Probes(), []
    below = {"predicted_speedup_draft": 0.9, "predicted_speedup_ngram": 0.95}  # 1.0 exactly is NO_ESTIMATE

    def plan(t, endpoint=ENDPOINT, slot=True):
        def take_slot(e):
            leases.append(e.id)
            return slot
        return decide(AUTO, t, endpoint, take_slot, probe_due=lambda: probes.due(t.id))

    a, b = (target(i, spec_endpoint="h:9", methods=("draft_model", "ngram"), **below) for i in ("a", "b"))
    plans = [plan(a) for _ in range(2 * PROBE_EVERY)]
    probe = Decision(DRAFT_MODEL, PROBE, leased=True)
    assert [i for i, d in enumerate(plans) if d == probe] == [0, PROBE_EVERY]
    assert all(d == Decision(NONE, NO_SPEEDUP) for d in plans if d != probe)
    assert leases == ["ep", "ep"], "a slot is leased for the probes only"
    assert plan(b) == probe, "counted per target"
    # Also where n-gram is predicted faster, paying or not; not where the draft model is planned anyway, nor where
    # it has no estimate to learn (a forced draft length); those requests do not count towards the next probe.
    for draft in (0.9, 1.2):
        ngram_pays = target(f"f{draft}", spec_endpoint="h:9", predicted_speedup_draft=draft, predicted_speedup_ngram=1.3)
        assert [plan(ngram_pays) for _ in range(2)] == [probe, Decision(NGRAM, PREDICTED_SPEEDUP)]
    assert plan(target("a", spec_endpoint="h:9", predicted_speedup_ngram=1.3)) == Decision(NGRAM, PREDICTED_SPEEDUP)
    assert plan(target("a", spec_endpoint="h:9", predicted_speedup_draft=1.5)) == Decision(
        DRAFT_MODEL, PREDICTED_SPEEDUP, leased=True)
    assert plan(a) == probe, "a's 2N+1-th eligible request: the two above did not count"
    # No probe without an endpoint drafting the model, a free slot, room on the endpoint, or the draft model
    # among what the target can do now (its endpoint's breaker open).
    c = target("c", spec_endpoint="h:9", methods=("draft_model", "ngram"), **below)
    assert plan(c, endpoint=None) == Decision(NONE, NO_SPEEDUP)
    assert plan(c, slot=False) == Decision(NONE, NO_SPEEDUP)
    full = EndpointRegistration(id="ep", address="h:9", models=("m",), max_sessions=8, active_sessions=8)
    assert plan(target("d", spec_endpoint="h:9", **below), endpoint=full) == Decision(NONE, NO_SPEEDUP)
    assert plan(target("e", spec_endpoint="h:9", methods=("ngram",), **below)) == Decision(NONE, NO_SPEEDUP)
    assert decided(AUTO, 0.9, 0.95) == Decision(NONE, NO_SPEEDUP), "decide's default: no probes"


def test_an_unmeasured_methods_prior_never_outbids_a_measured_gain():
    """Issue 51, `make run` on the Qwen pair: after the router's probe of the draft model (learned 1.35x), n-gram,
    never run, was still priced from the acceptance prior with free drafts (1.45x) and planned for the later
    prompts, where it ran 1.11x. A method the target lists unmeasured is planned only where no measured one pays."""
    def plan(draft: float, ngram: float, unmeasured=(), ssd: float = 1.0) -> Decision:
        t = target("a", spec_endpoint="h:9", predicted_speedup_draft=draft, predicted_speedup_ngram=ngram,
                   predicted_speedup_ssd=ssd, methods=WITH_SSD, unmeasured=unmeasured)
        return decide(AUTO, t, ENDPOINT, lambda e: True)

    assert plan(1.35, 1.45, unmeasured=("ngram", "ssd")) == Decision(DRAFT_MODEL, PREDICTED_SPEEDUP, leased=True)
    assert plan(1.35, 1.0, unmeasured=("ngram", "ssd"), ssd=1.8) == Decision(
        DRAFT_MODEL, PREDICTED_SPEEDUP, leased=True)
    assert plan(1.35, 1.45) == Decision(NGRAM, PREDICTED_SPEEDUP), "measured, n-gram pays more"
    # No measured method pays (or none is measured yet): an unmeasured one is planned, and so measured.
    assert plan(1.05, 1.45, unmeasured=("ngram", "ssd")) == Decision(NGRAM, PREDICTED_SPEEDUP)
    assert plan(1.1, 1.45, unmeasured=("draft_model", "ngram", "ssd")) == Decision(NGRAM, PREDICTED_SPEEDUP)


def test_a_burst_placed_within_one_heartbeat_is_planned_by_the_batch_each_request_joins():
    """Issue 51, routed AUTO on the Qwen pair at batch 4 (AMD EPYC, 2 cores): each chunk's four requests arrived
    within one heartbeat of an idle target, all were planned n-gram from its figure at batch 1 (1.12x), and the
    chunk ran 0.86x routed AR. Counting its own placements since the beat, the router plans each request by the
    figure at the batch it joins; once the next beat counts them (or they end), they are not counted twice."""
    now = [1000.0]
    placed = Placed(clock=lambda: now[0])
    idle = target("a", spec_endpoint="h:9", methods=("draft_model", "ngram"), updated=999.5,
                  predicted_speedup_draft=1.02, predicted_speedup_ngram=1.12,
                  predicted_speedup_draft_by_batch=(1.02, 0.97, 0.93, 0.9),
                  predicted_speedup_ngram_by_batch=(1.12, 1.04, 0.99, 0.96))

    def plan(t):
        decision = decide(AUTO, t, ENDPOINT, lambda e: True, placed=placed.since(t))
        placed.add(t.id, f"r{now[0]}")
        now[0] += 0.001
        return decision

    burst = [plan(idle) for _ in range(4)]
    assert burst == [Decision(NGRAM, PREDICTED_SPEEDUP)] + [Decision(NONE, NO_SPEEDUP)] * 3
    assert placed.since(idle) == 4
    # The next beat counts the four running; past max_batch the last figure holds.
    busy = target("a", spec_endpoint="h:9", running=4, max_batch=4, updated=now[0] + 0.5,
                  predicted_speedup_ngram_by_batch=(1.12, 1.04, 0.99, 0.96))
    assert placed.since(busy) == 0 and busy.speedup_at("predicted_speedup_ngram", placed=3) == 0.96
    # A request that ended is not counted.
    placed.add("a", "short")
    placed.remove("a", "short")
    assert placed.since(idle) == 0
    # The router probes the draft model only with the first request placed since the target's beat.
    below = target("d", spec_endpoint="h:9", methods=("draft_model", "ngram"), updated=999.5,
                   predicted_speedup_draft_by_batch=(0.9,) * 4, predicted_speedup_ngram_by_batch=(0.95,) * 4)
    probes = Probes(every=1)
    assert [decide(AUTO, below, ENDPOINT, lambda e: True, probe_due=lambda: probes.due("d"), placed=n)
            for n in range(3)] == [Decision(DRAFT_MODEL, PROBE, leased=True)] + [Decision(NONE, NO_SPEEDUP)] * 2
    stale = target("d", spec_endpoint="h:9", running=1, predicted_speedup_draft=0.9, predicted_speedup_ngram=0.95)
    assert decide(AUTO, stale, ENDPOINT, lambda e: True, probe_due=lambda: True) == Decision(
        DRAFT_MODEL, PROBE, leased=True), "a beat's running may be a second old: it does not stop a probe"
    # An untried method's prior is tried by the first request of a burst only.
    fresh = target("c", spec_endpoint="h:9", methods=("draft_model", "ngram"), updated=999.5,
                   unmeasured=("draft_model", "ngram"), predicted_speedup_ngram_by_batch=(1.5, 1.45, 1.4, 1.35),
                   predicted_speedup_draft_by_batch=(1.3, 1.2, 1.1, 1.0))
    assert [plan(fresh) for _ in range(3)] == [Decision(NGRAM, PREDICTED_SPEEDUP)] + [Decision(NONE, NO_SPEEDUP)] * 2
    # Figures of NO_ESTIMATE (a forced draft length: no policy) are no prior: a burst is planned as before, n-gram.
    forced = target("e", spec_endpoint="h:9", methods=WITH_SSD, unmeasured=("ngram",), updated=999.5)
    assert decide(AUTO, forced, ENDPOINT, lambda e: True, placed=2) == Decision(NGRAM, PREDICTED_SPEEDUP)
    # A target that sends no figures by batch (an older one) is planned by its one figure, as before.
    assert decide(AUTO, target("b", spec_endpoint="h:9", predicted_speedup_ngram=1.12), ENDPOINT, lambda e: True,
                  placed=3) == Decision(NGRAM, PREDICTED_SPEEDUP)
