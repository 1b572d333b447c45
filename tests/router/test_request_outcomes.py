"""The router counts every request once by how it ended, refused ones included, and its in-flight gauge
follows the requests it forwards. A router servicer in this process, with the admission and credentials
serve-router gives it, in front of test_router.py's fake targets, on a real Redis:

- refused before placement: malformed (invalid), a model nobody serves (not_found), no target at all
  (unavailable), each under model "unknown";
- refused by admission (rejected), which the servicer never sees;
- placed again after a replica was unavailable: counted once, under its final outcome;
- forwarded: ok, cancelled by the client (or by Cancel, at its replica), expired at the client's deadline;
  in flight meanwhile, 0 after.

And serve-router itself: a refusal counted on its /metrics, its log in JSON lines with a "ready" line.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import grpc
import pytest

from specpool.cluster.processes import start_server, wait_for
from specpool.cluster.redis_server import start_redis
from specpool.common import outcomes
from specpool.common.logs import LOG_FORMAT_ENV
from specpool.common.registry import Registry
from specpool.common.security import Security
from specpool.common.serving import Admission, build_server, method_names
from specpool.router.leases import LeaseKeeper
from specpool.router.member_channels import TargetChannels
from specpool.router.metrics import RouterMetrics
from specpool.router.routing import Router, RouterConfig
from specpool.router.servicer import RouterServicer
from specpool.router.view import ClusterView
from specpool_client import generate_result
from specpool_client.v1 import target_pb2 as pb
from specpool_client.v1 import target_pb2_grpc
from tests.pki import CA, channel
from tests.router.test_router import FakeTarget, request

ADMITTED = 2  # Generate calls the router takes at once


@pytest.fixture
def redis_server():
    server = start_redis()
    yield server
    server.close()


@pytest.fixture
def router(redis_server):
    """As serve-router wires it (router/server.py), admission counting its refusals."""
    registry = Registry(redis_server.url)
    metrics = RouterMetrics()
    view = ClusterView(registry, max_age_s=0.05)
    credentials = Security.load(CA.dir, "router", "outcomes-router")
    channels = TargetChannels(credentials, view.member_name)
    keeper = LeaseKeeper(registry, {}, ttl_s=60)
    service = pb.DESCRIPTOR.services_by_name["TargetService"]
    admission = Admission(ADMITTED, method_names(service, "Generate"),
                          on_refused=lambda _method: metrics.count(outcomes.REJECTED))
    server, port = build_server(0, admission=admission, credentials=credentials, client_certificates=False)
    servicer = RouterServicer(Router(view, keeper, metrics, RouterConfig()), channels, credentials)
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
    server.start()
    client = channel(f"127.0.0.1:{port}", "router")
    try:
        yield SimpleNamespace(stub=target_pb2_grpc.TargetServiceStub(client), metrics=metrics, view=view,
                              url=redis_server.url)
    finally:
        client.close()
        server.stop(0).wait()
        channels.close()
        registry.close()


def counted(router, model: str, outcome: str) -> float:
    return router.metrics.registry.get_sample_value(
        "specpool_router_requests_total", {"model": model, "outcome": outcome}) or 0.0


def in_flight(router, model: str) -> float:
    return router.metrics.registry.get_sample_value("specpool_router_in_flight_requests", {"model": model}) or 0.0


def refused(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


@pytest.fixture
def fake(router):
    target = FakeTarget("fake-outcomes", "fake-model", router.url, draft=1.5, ngram=1.2)
    wait_for(lambda: router.view.snapshot().models() == ["fake-model"])
    yield target
    target.close()


def test_requests_refused_before_placement_are_counted_under_an_unknown_model(router):
    s = router.stub
    assert refused(lambda: generate_result(s, pb.GenerateRequest(max_tokens=4), timeout=10)) == (
        grpc.StatusCode.INVALID_ARGUMENT)
    assert refused(lambda: generate_result(s, request(""), timeout=10)) == grpc.StatusCode.UNAVAILABLE
    assert refused(lambda: generate_result(s, request("nobody-serves-it"), timeout=10)) == grpc.StatusCode.NOT_FOUND
    unknown = outcomes.UNKNOWN_MODEL
    assert [counted(router, unknown, o) for o in ("invalid", "unavailable", "not_found", "ok")] == [1, 1, 1, 0]


def test_admission_refusals_are_counted_and_in_flight_follows_the_forwarded_requests(router, fake):
    fake.gate.clear()
    held = [router.stub.Generate(request("fake-model", f"held-{i}"), timeout=30) for i in range(ADMITTED)]
    try:
        assert all(next(call).HasField("delta") for call in held)
        assert in_flight(router, "fake-model") == ADMITTED
        assert refused(lambda: generate_result(router.stub, request("fake-model"), timeout=10)) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert counted(router, outcomes.UNKNOWN_MODEL, "rejected") == 1
    finally:
        fake.gate.set()
    assert all(sum(m.HasField("final") for m in call) == 1 for call in held)
    wait_for(lambda: counted(router, "fake-model", "ok") == ADMITTED, timeout_s=5)
    assert in_flight(router, "fake-model") == 0


def test_cancelled_and_expired_requests_are_counted_apart(router, fake):
    fake.gate.clear()
    try:
        call = router.stub.Generate(request("fake-model", "cancelled"), timeout=30)
        assert next(call).HasField("delta")
        call.cancel()
        wait_for(lambda: counted(router, "fake-model", "cancelled") == 1, timeout_s=5)

        assert refused(lambda: list(router.stub.Generate(request("fake-model", "expired"), timeout=0.5))) == (
            grpc.StatusCode.DEADLINE_EXCEEDED)
        wait_for(lambda: counted(router, "fake-model", "expired") == 1, timeout_s=5)
        wait_for(lambda: in_flight(router, "fake-model") == 0, timeout_s=5)
    finally:
        fake.gate.set()
    generate_result(router.stub, request("fake-model", "done"), timeout=10)
    assert [counted(router, "fake-model", o) for o in ("ok", "cancelled", "expired", "error")] == [1, 1, 1, 0]


class DownFake(FakeTarget):
    """A replica that answers every Generate UNAVAILABLE, as a draining one does."""

    def Generate(self, request, context):
        self._enter(request)
        self._leave()
        context.abort(grpc.StatusCode.UNAVAILABLE, "request: draining")
        yield  # a response stream, like the real one


def test_a_request_placed_again_counts_once_under_its_final_outcome(router, fake):
    down = DownFake("fake-down", "fake-model", router.url, draft=1.5, ngram=1.2)
    try:
        wait_for(lambda: len(router.view.snapshot().targets) == 2)
        for i in range(20):  # each first placed on either: P(none on the draining one) ~ 1e-6
            generate_result(router.stub, request("fake-model", f"again-{i}"), timeout=10)
        retries = router.metrics.registry.get_sample_value("specpool_router_retries_total", {"model": "fake-model"})
        assert retries == len(down.received) > 0, "some went to the draining replica first"
        assert [counted(router, "fake-model", o) for o in ("ok", "unavailable")] == [20, 0]
        fake.close()  # left: the draining replica alone
        wait_for(lambda: len(router.view.snapshot().targets) == 1, timeout_s=5)
        assert refused(lambda: generate_result(router.stub, request("fake-model"), timeout=10)) == (
            grpc.StatusCode.UNAVAILABLE)
        assert counted(router, "fake-model", "unavailable") == 1
        assert in_flight(router, "fake-model") == 0
    finally:
        down.close()


class CancelledFake(FakeTarget):
    """Ends every request as a target ends one that Cancel reached: a final of cancelled completions."""

    def _result(self, request) -> pb.GenerateResult:
        result = super()._result(request)
        result.completions[0].finish_reason = pb.FINISH_REASON_CANCELLED
        return result


def test_a_request_that_cancel_ended_at_its_replica_counts_as_cancelled(router):
    fake = CancelledFake("fake-cancel", "fake-model", router.url, draft=1.5, ngram=1.2)
    try:
        wait_for(lambda: router.view.snapshot().models() == ["fake-model"])
        generate_result(router.stub, request("fake-model", "cancelled-by-id"), timeout=10)
        assert [counted(router, "fake-model", o) for o in ("cancelled", "ok")] == [1, 0]
    finally:
        fake.close()


def test_serve_router_logs_json_lines_its_ready_line_naming_its_ports(redis_server):
    """SPECPOOL_LOG_FORMAT as `specpool up --log-format json` sets it for every server it starts."""
    server = start_server("router-json", ["serve-router", "--port", "0", "--metrics-port", "0",
                                          "--redis", redis_server.url, "--name", "router-json"],
                          env={LOG_FORMAT_ENV: "json"})
    try:
        with channel(server.address, "router") as ch:
            assert refused(lambda: generate_result(target_pb2_grpc.TargetServiceStub(ch), request(""), timeout=10)) == (
                grpc.StatusCode.UNAVAILABLE)
        assert server.metric_total("specpool_router_requests_total", model="unknown", outcome="unavailable") == 1
    finally:
        server.stop()
    records = [json.loads(line) for line in server.log_tail]
    [ready] = [r for r in records if r["message"] == "ready"]
    assert (ready["service"], ready["port"], ready["metrics_port"]) == ("Router", server.port, server.metrics_port)
    assert all({"ts", "level", "logger", "message"} <= r.keys() for r in records)
