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

from specpool.serving import MetricsHttpServer, abort_invalid, add_health_and_reflection, build_server
from specpool.v1 import target_pb2  # noqa: F401  (puts specpool.v1.TargetService in the default pool)

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _invalid_prompt(request: bytes, context: grpc.ServicerContext) -> bytes:
    abort_invalid(context, "prompt", "must not be empty")


@pytest.fixture
def server():
    server, port = build_server(0, max_workers=4, host="127.0.0.1")
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


def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


def test_metrics_http_server_routes():
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Counter("specpool_test_requests", "test counter", registry=registry).inc(3)

    def broken() -> dict:
        raise ValueError("no capacity data yet")

    routes = {"/capacity": lambda: {"slots": 4}, "/broken": broken}
    http = MetricsHttpServer(registry, 0, host="127.0.0.1", json_routes=routes)
    http.start()
    try:
        base = f"http://127.0.0.1:{http.port}"
        code, ctype, body = _get(base + "/metrics")
        assert code == 200 and ctype.startswith("text/plain")
        assert "specpool_test_requests_total 3.0" in body.decode()
        assert _get(base + "/healthz")[::2] == (200, b"ok")
        code, ctype, body = _get(base + "/capacity?tenant=a")
        assert (code, ctype, json.loads(body)) == (200, "application/json", {"slots": 4})
        code, _, body = _get(base + "/broken")
        assert code == 500 and "no capacity data yet" in json.loads(body)["error"]
        assert _get(base + "/nope")[0] == 404
    finally:
        http.stop()


DRAIN_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import grpc, prometheus_client
    from specpool.serving import *

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
