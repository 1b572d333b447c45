"""The router's OpenAI front past its total of connections (--http-max-connections; issue 52): through a
real serve-router process with TLS, each held connection from a loopback address of its own (so the
per-address cap is not what refuses), the one past the total is answered 503 with a JSON body naming
the flag, `retry-after: 1`, and closed as it is made; once one is let go, a new connection is served."""

from __future__ import annotations

import json

import pytest

from specpool.bench.slow_http_clients import connect
from specpool.cluster.processes import start_server
from specpool.cluster.redis_server import start_redis
from tests.router.test_openai_http import reply_until_closed, tls

TOTAL = 6


@pytest.mark.slow  # Redis and a router process
def test_the_front_past_its_total_answers_503_with_retry_after_and_closes():
    redis = start_redis()
    router = None
    try:
        router = start_server("router-total", [
            "serve-router", "--port", "0", "--metrics-port", "0", "--redis", redis.url,
            "--http-max-connections", str(TOTAL), "--http-max-connections-per-client", "100",
            "--http-header-timeout-s", "30", "--http-idle-timeout-s", "30"])
        port = router.http_port
        assert port, "the router reports its HTTP port"
        held = [connect(port, f"127.0.0.{80 + i}", tls()) for i in range(TOTAL)]  # TLS done: each counted
        refused = reply_until_closed(connect(port, "127.0.0.99", tls()), within_s=10.0)
        head, _, body = refused.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 Service Unavailable"), refused
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(b":") for line in head.split(b"\r\n")[1:])}
        assert headers[b"retry-after"] == b"1" and headers[b"connection"] == b"close", headers
        assert headers[b"content-type"] == b"application/json"
        error = json.loads(body)["error"]
        assert f"--http-max-connections {TOTAL}" in error["message"], error
        assert error["type"] == "server_error" or error["type"].endswith("error"), error  # OpenAI's shape

        held.pop().close()  # one let go: the next connection is admitted (and answered for itself)
        for _ in range(50):
            sock = connect(port, "127.0.0.98", tls())
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: router.specpool\r\nconnection: close\r\n\r\n")
            reply = reply_until_closed(sock, within_s=10.0)
            if not reply.startswith(b"HTTP/1.1 503"):
                break
        assert reply.startswith(b"HTTP/1.1 401 "), reply  # admitted: refused only for want of a token
        for sock in held:
            sock.close()
    finally:
        if router is not None:
            router.stop()
            assert "Traceback" not in router.logs(), router.logs()
        redis.close()
