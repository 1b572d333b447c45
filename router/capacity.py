"""The capacity API: pools per model, endpoints with their leased slots, and this router's decisions.

One GetClusterCapacityResponse serves both ClusterStateService.GetClusterCapacity and GET /capacity (as JSON).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from google.protobuf.json_format import MessageToDict

from specpool.common.registry_leases import guarantees
from specpool.common.registry_schema import EndpointRegistration, TargetRegistration
from specpool.common.speculation import method_to_pb
from specpool.engine.method import Method
from specpool.router.view import Snapshot
from specpool_client.v1 import cluster_pb2 as pb


def cluster_capacity(
    snapshot: Snapshot,
    held: Callable[[str], dict[str, int] | None],  # endpoint id -> leases per tenant (None: unknown)
    shares: Mapping[str, float],
    decisions: list[tuple[str, str, str, int]],
    now_s: float | None = None,
    monotonic_now: float | None = None,
) -> pb.GetClusterCapacityResponse:
    now_s = time.time() if now_s is None else now_s
    monotonic_now = time.monotonic() if monotonic_now is None else monotonic_now
    pools = []
    for model in snapshot.models():
        targets = [t for t in snapshot.targets if t.model == model]
        pools.append(_pool(model, targets, now_s))
    return pb.GetClusterCapacityResponse(
        pools=pools,
        endpoints=[_endpoint(e, held(e.id), shares, now_s) for e in snapshot.endpoints],
        decisions=[pb.DecisionCount(model=model, plan=_method(method), reason=reason, count=count)
                   for model, method, reason, count in decisions],
        registry_reachable=snapshot.reachable,
        snapshot_age_s=round(monotonic_now - snapshot.read_at, 3) if snapshot.read_at else 0.0,
    )


def visible_to(message: pb.GetClusterCapacityResponse, tenant: str | None) -> pb.GetClusterCapacityResponse:
    """The capacity a tenant may read: every endpoint's per-tenant leases but its own left out, so tenants
    learn neither who else shares the pool nor how much they use. None keeps them all (an operator's
    view), "" none (as wire.capacity_to's `only`)."""
    if tenant is None:
        return message
    out = pb.GetClusterCapacityResponse()
    out.CopyFrom(message)
    for endpoint in out.endpoints:
        own = [t for t in endpoint.tenants if t.tenant == tenant]
        del endpoint.tenants[:]
        endpoint.tenants.extend(own)
    return out


def capacity_json(message: pb.GetClusterCapacityResponse) -> dict:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _method(name: str) -> int:
    return method_to_pb(Method(name))


def _pool(model: str, targets: list[TargetRegistration], now_s: float) -> pb.ModelPool:
    capacity = sum(t.max_batch for t in targets)
    running = sum(t.running for t in targets)
    queued = sum(t.queued for t in targets)
    measured = [t.mean_accept_len for t in targets if t.mean_accept_len > 0]
    return pb.ModelPool(
        model=model,
        targets=[_target(t, now_s) for t in targets],
        capacity=capacity, running=running, queued=queued,
        utilization=(running + queued) / capacity if capacity else 0.0,
        mean_accept_len=sum(measured) / len(measured) if measured else 0.0,
        predicted_speedup_draft=sum(t.predicted_speedup_draft for t in targets) / len(targets),
        predicted_speedup_ngram=sum(t.predicted_speedup_ngram for t in targets) / len(targets),
        predicted_speedup_ssd=sum(t.predicted_speedup_ssd for t in targets) / len(targets),
    )


def _target(t: TargetRegistration, now_s: float) -> pb.TargetReplica:
    return pb.TargetReplica(
        id=t.id, address=t.address, model=t.model, tenant=t.tenant, max_batch=t.max_batch,
        running=t.running, queued=t.queued, spec_endpoint=t.spec_endpoint, mean_accept_len=t.mean_accept_len,
        predicted_speedup_draft=t.predicted_speedup_draft, predicted_speedup_ngram=t.predicted_speedup_ngram,
        predicted_speedup_ssd=t.predicted_speedup_ssd, format=t.format,
        methods=[_method(m) for m in t.methods], heartbeat_age_s=round(max(0.0, now_s - t.updated), 3),
    )


def _endpoint(e: EndpointRegistration, held: dict[str, int] | None, shares: Mapping[str, float],
              now_s: float) -> pb.SpeculationEndpoint:
    held = held or {}
    guaranteed = guarantees(e.max_sessions, shares)
    tenants = sorted(set(held) | set(guaranteed))
    return pb.SpeculationEndpoint(
        id=e.id, address=e.address, models=list(e.models), max_sessions=e.max_sessions,
        active_sessions=e.active_sessions, draft_busy_ratio=e.draft_busy_ratio, acceptance=e.acceptance,
        hit_ratio=e.hit_ratio, leased=sum(held.values()),
        tenants=[pb.TenantLeases(tenant=t, leased=held.get(t, 0), guaranteed=guaranteed.get(t, 0))
                 for t in tenants],
        heartbeat_age_s=round(max(0.0, now_s - e.updated), 3),
    )
