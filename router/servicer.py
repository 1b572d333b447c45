"""The router's gRPC services: the Target API in front of a pool of target replicas, and ClusterStateService.

The servicer only translates and forwards: `Router` chooses the replica, the speculation method and
the draft slot; the request goes to the replica with its method set, responses stream back, and the
slot is released when the call ends however it ends (completion, error, Cancel, client gone).

A replica that fails (UNAVAILABLE: down, unreachable, draining; CANCELLED while its client waits: its
process died mid-call) is left for the next best one until none is left. Before anything was streamed
the request is simply placed again. Mid-stream it migrates:
the next replica continues from the prompt plus the tokens the client already has (resume_token_ids),
and the client sees one unbroken stream. That is lossless: greedy, the same tokens; sampling, the
continuation of a prefix the target model produced is drawn from the same distribution.
"""

from __future__ import annotations

import logging
import time

import grpc

from specpool.common import logs, outcomes
from specpool.common.security import TENANT_HEADER, Security
from specpool.common.serving import abort_invalid
from specpool.common.write_deadline import WriteDeadline
from specpool.router.capacity import visible_to
from specpool.router.forwarding import Forwarding, Stream
from specpool.router.member_channels import TargetChannels
from specpool.router.routing import Router, RoutingError, tenant_of
from specpool_client.v1 import cluster_pb2_grpc, target_pb2_grpc
from specpool_client.v1 import target_pb2 as pb

log = logging.getLogger("specpool.router")


class RouterServicer(target_pb2_grpc.TargetServiceServicer):
    """The tenant of a call is the one its bearer token names; requests are forwarded with it in
    x-specpool-tenant, which targets believe only from a router's certificate. So a request id is the
    tenant's own: another tenant's Cancel of it finds nothing."""

    def __init__(self, router: Router, channels: TargetChannels, credentials: Security,
                 write_deadline: WriteDeadline | None = None):
        self.router = router
        self.write_deadline = write_deadline or WriteDeadline()
        self.channels = channels
        self.credentials = credentials

    @logs.request_scoped
    def Generate(self, request, context):
        """Counts the request once however it ends (refused, failed, cancelled, expired or done): on its
        latest route when it has one (Router.finish, labelled with the route's model), else here."""
        stream = Stream(request)  # gives it the id every replica it visits knows it by
        logs.tag(request_id=stream.request.request_id)
        current: list[Forwarding] = []  # its latest route
        self._on_termination(context, current)
        outcome = None
        try:
            yield from self.write_deadline.stream(self._forward(stream, context, current),
                                                  on_stall=lambda: self._stalled(context))
            outcome = outcomes.CANCELLED if stream.cancelled else outcomes.OK
        finally:  # also on an abort, and when the client went away while we were yielding (GeneratorExit)
            self._count(outcome or outcomes.of_call(context), current)

    def _stalled(self, context) -> None:
        """The client stopped reading: its call is cancelled, and with it the replica's (`_on_termination`)."""
        caller = self.credentials.caller(context)  # (not _tenant: this runs off the call's thread, and aborts nothing)
        tenant = caller.name if caller is not None and not caller.anonymous else \
            dict(context.invocation_metadata() or ()).get(TENANT_HEADER, "")
        log.warning("tenant %s stopped reading its stream for %g s (--grpc-stall-timeout-s): call cancelled",
                    tenant or "(none)", self.write_deadline.timeout_s)
        context.cancel()

    def _forward(self, stream: Stream, context, current: list[Forwarding]):
        tenant = self._tenant(context)
        logs.tag(tenant=tenant)
        exclude: set[str] = set()
        while True:
            forwarded = stream.next_request()
            if forwarded is None:  # the replica died after the last token, before its final message
                yield stream.final(current[0].route.model)
                return
            fwd = self._forwarding(forwarded, tenant, exclude, context, current, stream)
            model = fwd.route.model
            if stream.tokens:
                self.router.metrics.migrations.labels(model=model).inc()
            try:
                call = self.channels.stub(fwd.route.target.address).Generate(
                    fwd.route.request, timeout=_remaining(context), metadata=_on_behalf_of(tenant))
                fwd.attach(call)
                for msg in call:
                    if not stream.sent_any and msg.HasField("delta"):
                        self.router.metrics.ttft.labels(model=model).observe(time.monotonic() - fwd.route.started_at)
                    stream.sent(msg)
                    yield msg
                return
            except grpc.RpcError as e:
                if stream.final_sent:  # only the call's trailers were lost: the client has everything
                    return
                if not self._place_again(e, fwd, exclude, context, stream):
                    _abort_like(context, e)

    def _count(self, outcome: str, current: list[Forwarding]) -> None:
        fwd = current[0] if current else None
        if fwd is None:  # refused before it was placed
            self.router.metrics.count(outcome)
        elif fwd.handed_over:  # its last replica failed and no other could continue it
            self.router.metrics.count(outcome, fwd.route.model)
        else:
            fwd.finish(outcome)  # a no-op when the call's end (_on_termination) counted it first

    @logs.request_scoped
    def Cancel(self, request, context):
        """Routers keep no request table: every live replica is asked, and any that ran it (for this
        tenant) says so. NOT_FOUND when none did, whoever's the id is: ids tell nothing about others."""
        logs.tag(request_id=request.request_id)
        tenant = self._tenant(context)
        logs.tag(tenant=tenant)
        if not request.request_id:
            abort_invalid(context, "request_id", "is required")
        targets = self.router.view.snapshot().targets
        futures = [self.channels.stub(t.address).Cancel.future(request, timeout=5.0, metadata=_on_behalf_of(tenant))
                   for t in targets]
        cancelled = False
        for f in futures:
            try:
                cancelled = f.result().cancelled or cancelled
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    log.debug("Cancel on a replica failed: %s", e.code().name)
        if not cancelled:
            abort_invalid(context, "request_id", f"no running request {request.request_id!r} of yours",
                          grpc.StatusCode.NOT_FOUND)
        return pb.CancelResponse(cancelled=True)

    def GetInfo(self, request, context):
        """The pool as one service: summed capacity and load; the model when the pool serves one."""
        snapshot = self.router.view.snapshot()
        models = snapshot.models()
        info = pb.GetInfoResponse(
            service_id="router", model=models[0] if len(models) == 1 else "",
            max_batch=sum(t.max_batch for t in snapshot.targets),
            active_sequences=sum(t.running for t in snapshot.targets),
            queued_requests=sum(t.queued for t in snapshot.targets),
            spec_endpoint=",".join(e.address for e in snapshot.endpoints),
            spec_endpoint_attached=any(t.spec_endpoint for t in snapshot.targets),
        )
        if len(models) == 1 and snapshot.targets:
            try:  # the vocabulary is not in the registry: ask one replica
                info.vocab_size = self.channels.stub(snapshot.targets[0].address).GetInfo(
                    pb.GetInfoRequest(), timeout=2.0).vocab_size
            except grpc.RpcError:
                pass
        return info

    # -- helpers ------------------------------------------------------------------------------------

    def _tenant(self, context) -> str | None:
        caller = self.credentials.caller(context)
        if caller is not None and not caller.anonymous:
            return caller.name
        try:  # --insecure: the caller says who it is
            return tenant_of(context.invocation_metadata())
        except RoutingError as e:
            abort_invalid(context, e.field, e.message, e.code)

    def _on_termination(self, context, current: list[Forwarding]) -> None:
        def ended() -> None:  # runs however the call ends; a route still open means the client left
            for fwd in list(current):
                fwd.cancel()
                fwd.finish(outcomes.of_call(context))

        context.add_callback(ended)

    def _forwarding(self, request, tenant: str | None, exclude: set[str], context,
                    current: list[Forwarding], stream: Stream) -> Forwarding:
        try:
            route = self.router.route(request, tenant, frozenset(exclude))
        except RoutingError as e:
            if stream.tokens:
                abort_invalid(context, "request", f"{len(stream.tokens)} tokens were delivered, then its replica "
                              f"failed and no other can continue it ({e.field}: {e.message})",
                              grpc.StatusCode.UNAVAILABLE, reason="NOT_RESUMABLE")
            if stream.refused is not None:  # every replica left was full: their refusal, retry hint and all
                _abort_like(context, stream.refused)
            abort_invalid(context, e.field, e.message, e.code,
                          reason="NO_LIVE_REPLICA" if e.code == grpc.StatusCode.UNAVAILABLE else None)
        fwd = Forwarding(self.router, route)
        current[:] = [fwd]
        if not context.is_active():  # the client left while we placed it
            fwd.cancel()
            abort_invalid(context, "request", "cancelled", grpc.StatusCode.CANCELLED)
        return fwd

    def _place_again(self, error: grpc.RpcError, fwd: Forwarding, exclude: set[str], context,
                     stream: Stream) -> bool:
        """Whether to go on to the next best replica: this one is unavailable (or full, before it streamed
        anything), the client still waits, and the stream can be continued. Each failed replica is
        excluded, so this ends."""
        if not context.is_active():
            return False
        full = error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not stream.sent_any
        # A replica never ends a call CANCELLED itself, and this router cancels only for a client that
        # left: CANCELLED while the client waits is a torn-down replica (gRPC reports some deaths so).
        failed = error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        if not (full or failed and stream.movable()):
            return False
        if full:
            stream.refused = error
        exclude.add(fwd.route.target.id)
        if stream.tokens:
            log.warning("replica %s failed after %d tokens of request %s (%s); continuing it on another",
                        fwd.route.target.id, len(stream.tokens), stream.request.request_id, error.details())
        else:
            log.warning("replica %s %s (%s); placing the request again", fwd.route.target.id,
                        "full" if full else "unavailable", error.details())
            self.router.metrics.retries.labels(model=fwd.route.model).inc()
        fwd.hand_over()
        return True


def _on_behalf_of(tenant: str | None) -> tuple[tuple[str, str], ...]:
    return ((TENANT_HEADER, tenant),) if tenant else ()


def _abort_like(context, error: grpc.RpcError) -> None:
    """Ends the call with a replica's status, its google.rpc details (such as RetryInfo) included."""
    details = [(k, v) for k, v in error.trailing_metadata() or () if k == "grpc-status-details-bin"]
    if details:
        context.set_trailing_metadata(details)
    context.abort(error.code(), error.details() or error.code().name)


def _remaining(context) -> float | None:
    """The caller's deadline, passed on; None without one (gRPC reports that as a huge number)."""
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining < 1e7 else None


class ClusterStateServicer(cluster_pb2_grpc.ClusterStateServiceServicer):
    """A tenant (its token or its client certificate) sees the pools and endpoints, and of the per-tenant
    leases only its own; operators' tools and services see every tenant's (Identity.tenant_scope)."""

    def __init__(self, capacity, credentials: Security):
        self.capacity = capacity
        self.credentials = credentials

    def GetClusterCapacity(self, request, context):
        caller = self.credentials.caller(context)
        return visible_to(self.capacity(), caller.tenant_scope if caller is not None else "")

