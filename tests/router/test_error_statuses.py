"""The Target API's error paths at a router with no target up (a real router process, a real Redis):
each ends with the status README "Errors" documents, with its google.rpc details, read back by the
client package (specpool_client.ErrorDetails) and its TargetClient.

- a malformed request is INVALID_ARGUMENT (BadRequest naming the field), not UNAVAILABLE, though no
  target could serve it; bytes that are not a request are too;
- a well-formed one is UNAVAILABLE with RetryInfo (NO_LIVE_REPLICA), which TargetClient retries with
  backoff until its deadline, then raises;
- a call without a token is UNAUTHENTICATED; Cancel of an unknown id is NOT_FOUND;
- grpc.health.v1 answers for the served services by name.
"""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specpool.cluster.processes import start_server
from specpool.cluster.redis_server import start_redis
from specpool_client import ErrorDetails, TargetClient, generate_request, generate_result
from specpool_client.v1 import target_pb2 as pb
from specpool_client.v1 import target_pb2_grpc
from tests.pki import CA, channel


@pytest.fixture(scope="module")
def router():
    redis = start_redis()
    server = start_server("router-errors", ["serve-router", "--port", "0", "--metrics-port", "0",
                                            "--redis", redis.url, "--name", "router-errors"])
    yield server
    server.stop()
    redis.close()


def failure(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def test_a_malformed_request_is_invalid_argument_naming_its_field_with_no_target_up(router):
    stub = target_pb2_grpc.TargetServiceStub(channel(router.address, "router"))
    bad = generate_request("def f():", temperature=-1.0)
    error = failure(lambda: generate_result(stub, bad, timeout=10))
    details = ErrorDetails.of(error)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert error.details().startswith("sampling.temperature:"), error.details()
    assert details.reason == "INVALID_FIELD" and list(details.field_violations) == ["sampling.temperature"]
    for broken, field in ((pb.GenerateRequest(max_tokens=4), "prompt"),
                          (generate_request("x", max_tokens=0), "max_tokens"),
                          (generate_request(messages=[("robot", "hi")]), "messages"),
                          (generate_request(prompt_ids=[1, -2]), "prompt_ids")):
        error = failure(lambda b=broken: generate_result(stub, b, timeout=10))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, error)
        assert list(ErrorDetails.of(error).field_violations) == [field], error.details()
    raw = channel(router.address, "router").unary_stream("/specpool.v1.TargetService/Generate")
    error = failure(lambda: list(raw(b"\xff\xff\xff\xff", timeout=10)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert list(ErrorDetails.of(error).field_violations) == ["request"]


def test_no_live_replica_is_unavailable_with_a_retry_hint_and_the_client_retries_until_its_deadline(router):
    stub = target_pb2_grpc.TargetServiceStub(channel(router.address, "router"))
    error = failure(lambda: generate_result(stub, generate_request("def f():"), timeout=10))
    details = ErrorDetails.of(error)
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert (details.reason, details.retry_delay_s) == ("NO_LIVE_REPLICA", 1.0), details
    client = TargetClient(router.address, token=CA.token("tester"), ca_cert=CA.dir / "ca.crt",
                          backoff_s=0.05, retries=10)
    with client:
        start = time.monotonic()
        error = failure(lambda: client.generate(prompt="def f():", timeout_s=3.5))
        elapsed = time.monotonic() - start
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        # It waited the server's 1 s hint between tries (not its own 0.05 s backoff), and stopped in time.
        assert 2.0 <= elapsed < 3.5 + 1.0, elapsed
        assert client.cancel("no-such-request") is False
        assert client.info().service_id == "router"


def test_no_token_is_unauthenticated_and_cancel_of_an_unknown_id_is_not_found(router):
    anonymous = grpc.secure_channel(router.address, grpc.ssl_channel_credentials((CA.dir / "ca.crt").read_bytes()),
                                    options=[("grpc.ssl_target_name_override", "router.specpool")])
    error = failure(lambda: generate_result(target_pb2_grpc.TargetServiceStub(anonymous),
                                            generate_request("x"), timeout=10))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED and ErrorDetails.of(error).reason == "UNAUTHENTICATED"
    stub = target_pb2_grpc.TargetServiceStub(channel(router.address, "router"))
    error = failure(lambda: stub.Cancel(pb.CancelRequest(request_id="nobody"), timeout=10))
    assert error.code() == grpc.StatusCode.NOT_FOUND and ErrorDetails.of(error).reason == "NOT_FOUND"
    error = failure(lambda: stub.Cancel(pb.CancelRequest(), timeout=10))
    assert list(ErrorDetails.of(error).field_violations) == ["request_id"]


def test_health_answers_for_each_served_service_by_name(router):
    health = health_pb2_grpc.HealthStub(channel(router.address, "router"))
    for service in ("", "readiness", "specpool.v1.TargetService", "specpool.v1.ClusterStateService"):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
