import argparse
import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import prometheus_client
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from specpool.cluster.processes import wait_for
from specpool.common import http_limits
from specpool.common.metrics_http import METRICS_TOKEN_ENV, MetricsHttpServer
from specpool.common.serving import Admission, abort_invalid, add_health_and_reflection, build_server
from specpool_client import ErrorDetails
from specpool_client.v1 import target_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _invalid_prompt(request: bytes, context: grpc.ServicerContext) -> bytes:
    abort_invalid(context, "prompt", "must not be empty")


@pytest.fixture
def server():
    server, port = build_server(0, host="127.0.0.1")
    health = add_health_and_reflection(server, ["specpool.v1.TargetService"])
    handler = grpc.unary_unary_rpc_method_handler(_invalid_prompt)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Check", {"Prompt": handler})])
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel, health
    channel.close()
    server.stop(0).wait()


def test_health_readiness_follows_set_ready(server):
    channel, health = server
    check = health_pb2_grpc.HealthStub(channel).Check

    def status(service: str) -> int:
        return check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    assert status("liveness") == SERVING
    assert status("readiness") == NOT_SERVING
    assert status("") == NOT_SERVING
    health.set_ready(True)
    assert status("readiness") == SERVING
    assert status("") == SERVING
    health.set_live(False)
    assert status("liveness") == NOT_SERVING
    with pytest.raises(grpc.RpcError) as err:
        status("no-such-service")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_services_and_serves_their_descriptors(server):
    channel, _ = server
    db = ProtoReflectionDescriptorDatabase(channel)
    assert set(db.get_services()) == {
        "specpool.v1.TargetService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    assert db.FindFileContainingSymbol("specpool.v1.TargetService").package == "specpool.v1"


def test_abort_invalid_names_the_field(server):
    channel, _ = server
    with pytest.raises(grpc.RpcError) as err:
        channel.unary_unary("/test.Check/Prompt")(b"", timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "prompt: must not be empty"


def test_build_server_refuses_a_taken_port():
    first, port = build_server(0, host="127.0.0.1")
    try:
        with pytest.raises(RuntimeError, match=str(port)):
            build_server(port, host="127.0.0.1")
    finally:
        first.stop(0)


def test_admission_refuses_past_its_limit_with_a_retry_hint_and_control_calls_still_answer():
    """Two held streams fill an admission of 2: the third is refused at once with RESOURCE_EXHAUSTED and
    RetryInfo, health answers meanwhile, and a slot frees when a stream ends."""
    release = threading.Event()

    def hold(request: bytes, context):
        yield b"started"
        while not release.wait(0.05) and context.is_active():  # as Generate does: ends when its client goes
            pass

    admission = Admission(2, ["/test.Hold/Stream"], retry_after_s=1.5)
    server, port = build_server(0, host="127.0.0.1", admission=admission)
    add_health_and_reflection(server, [])
    handler = grpc.unary_stream_rpc_method_handler(hold)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Hold", {"Stream": handler})])
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    open_stream = channel.unary_stream("/test.Hold/Stream")
    try:
        held = [open_stream(b"", timeout=30) for _ in range(2)]
        assert [next(s) for s in held] == [b"started"] * 2
        with pytest.raises(grpc.RpcError) as err:
            next(open_stream(b"", timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = ErrorDetails.of(err.value)
        assert (details.retry_delay_s, details.reason) == (1.5, "OVERLOADED"), details
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=1)
        assert check.status == SERVING
        held[0].cancel()

        def admitted() -> bool:  # the cancelled stream's slot frees once its handler has returned
            try:
                return next(open_stream(b"", timeout=30)) == b"started"
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                return False

        assert wait_for(admitted, timeout_s=5)
    finally:
        release.set()
        channel.close()
        server.stop(0).wait()


def test_bytes_that_are_not_the_request_message_are_invalid_argument():
    seen = []

    def generate(request: target_pb2.GenerateRequest, context):
        seen.append(request)
        return target_pb2.GenerateResult()

    server, port = build_server(0, host="127.0.0.1")
    handler = grpc.unary_unary_rpc_method_handler(generate, request_deserializer=target_pb2.GenerateRequest.FromString,
                                                  response_serializer=target_pb2.GenerateResult.SerializeToString)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Gen", {"Call": handler})])
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/test.Gen/Call")(b"\xff\xff\xff\xff", timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("request: not a valid /test.Gen/Call request message")
        assert not seen
        channel.unary_unary("/test.Gen/Call")(target_pb2.GenerateRequest(max_tokens=3).SerializeToString(), timeout=5)
        assert seen[0].max_tokens == 3
    finally:
        channel.close()
        server.stop(0).wait()


def _get(url: str, authorization: str | None = None) -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": authorization} if authorization else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


def test_metrics_http_server_routes(monkeypatch):
    """A JSON route hears whether its caller is an operator (presented the metrics token); without
    a token configured nobody is, every JSON route is open, and /metrics only with open_metrics."""
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Counter("specpool_test_requests", "test counter", registry=registry).inc(3)

    def broken(operator: bool) -> dict:
        raise ValueError("no capacity data yet")

    routes = {"/capacity": lambda operator: {"slots": 4, "operator": operator}, "/broken": broken}
    monkeypatch.delenv(METRICS_TOKEN_ENV, raising=False)
    closed = MetricsHttpServer(registry, 0, host="127.0.0.1", json_routes=routes)
    closed.start()
    try:  # no token and not opened: /metrics (every tenant's figures) answers nobody, saying what to set
        code, _, body = _get(f"http://127.0.0.1:{closed.port}/metrics")
        assert code == 401 and METRICS_TOKEN_ENV in body.decode() and "--metrics-open" in body.decode()
    finally:
        closed.stop()
    http = MetricsHttpServer(registry, 0, host="127.0.0.1", json_routes=routes, open_metrics=True)
    http.start()
    try:
        base = f"http://127.0.0.1:{http.port}"
        code, ctype, body = _get(base + "/metrics")
        assert code == 200 and ctype.startswith("text/plain")
        assert "specpool_test_requests_total 3.0" in body.decode()
        for probe in ("/healthz", "/livez", "/readyz"):
            assert _get(base + probe)[::2] == (200, b"ok"), probe
        code, ctype, body = _get(base + "/capacity?tenant=a")
        assert (code, ctype, json.loads(body)) == (200, "application/json", {"slots": 4, "operator": False})
        code, _, body = _get(base + "/broken")
        assert code == 500 and "no capacity data yet" in json.loads(body)["error"]
        assert _get(base + "/nope")[0] == 404
    finally:
        http.stop()


@pytest.mark.parametrize("flags, message", [
    ([], None),
    (["--http-header-timeout-s", "0"], "--http-header-timeout-s must be > 0, got 0.0"),
    (["--http-body-timeout-s", "inf"], "--http-body-timeout-s must be > 0, got inf"),
    (["--http-idle-timeout-s", "nan"], "--http-idle-timeout-s must be > 0, got nan"),
    (["--http-max-connections", "0"], "--http-max-connections must be >= 1, got 0"),
    (["--http-max-connections-per-client", "-1"], "--http-max-connections-per-client must be >= 1, got -1"),
])
def test_http_limit_flags_are_checked_naming_the_flag(flags, message):
    parser = argparse.ArgumentParser()
    http_limits.add_arguments(parser)
    args = parser.parse_args(flags)
    if message is None:
        assert http_limits.from_args(args) == http_limits.DEFAULT_LIMITS
        return
    with pytest.raises(ValueError) as err:
        http_limits.from_args(args)
    assert str(err.value) == message


def test_metrics_token_guards_metrics_and_json_routes_but_not_the_probes():
    """With a metrics token, /metrics and the JSON routes want "Authorization: Bearer <token>" (and
    a route then knows its caller is an operator); /livez and /readyz stay open and follow health."""
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Counter("specpool_test_requests", "test counter", registry=registry).inc(3)
    server, _ = build_server(0, host="127.0.0.1")
    health = add_health_and_reflection(server, [])
    routes = {"/capacity": lambda operator: {"operator": operator}}
    http = MetricsHttpServer(registry, 0, host="127.0.0.1", json_routes=routes, health=health, token="op-secret")
    http.start()
    try:
        base = f"http://127.0.0.1:{http.port}"
        for path in ("/metrics", "/capacity"):
            assert _get(base + path)[0] == 401, path
            assert _get(base + path, "Bearer wrong")[0] == 401, path
        code, _, body = _get(base + "/metrics", "Bearer op-secret")
        assert code == 200 and "specpool_test_requests_total 3.0" in body.decode()
        code, _, body = _get(base + "/capacity", "Bearer op-secret")
        assert (code, json.loads(body)) == (200, {"operator": True})
        assert _get(base + "/livez")[0] == 200
        assert _get(base + "/readyz")[0] == 503, "not ready until set_ready"
        health.set_ready(True)
        assert _get(base + "/readyz")[::2] == (200, b"ok")
        health.set_live(False)
        assert _get(base + "/livez")[0] == 503
        assert _get(base + "/nope")[0] == 404
    finally:
        http.stop()
        server.stop(0)


DRAIN_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import grpc, prometheus_client
    from specpool.common.metrics_http import MetricsHttpServer
    from specpool.common.serving import *

    def slow(request, context):
        print("in-flight", flush=True)
        time.sleep(1.0)
        return b"done"

    setup_logging()
    setup_logging()  # idempotent: one handler, one line per record
    server, port = build_server(0, host="127.0.0.1")
    health = add_health_and_reflection(server, [])
    handler = grpc.unary_unary_rpc_method_handler(slow)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Slow", {"Call": handler})])
    metrics = MetricsHttpServer(prometheus_client.CollectorRegistry(), 0, host="127.0.0.1")
    metrics.start()
    server.start()
    health.set_ready(True)
    print(port, flush=True)
    on_drain = lambda: print("on_drain", flush=True)
    serve_until_signal(server, health, grace_s=5.0, on_drain=on_drain, metrics=metrics)
    """
)


@pytest.mark.slow  # a server process
def test_serve_until_signal_drains_in_flight_rpcs_on_sigterm():
    proc = subprocess.Popen(
        [sys.executable, "-c", DRAIN_SCRIPT],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(proc.stdout.readline())
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        result = {}

        def call() -> None:
            result["reply"] = channel.unary_unary("/test.Slow/Call")(b"", timeout=10)

        caller = threading.Thread(target=call)
        caller.start()
        assert proc.stdout.readline().strip() == "in-flight"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        caller.join(timeout=5)
        assert result.get("reply") == b"done"  # the in-flight RPC finished inside the grace period
        assert proc.wait(timeout=5) == 0
        assert time.monotonic() - t0 < 4
        assert proc.stdout.read().split() == ["on_drain"]
        stderr = proc.stderr.read()
        assert stderr.count("draining") == 1 and "stopped" in stderr
        channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
