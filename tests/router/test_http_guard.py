"""The HTTP front's guard (router/http_guard.py) at its edges, on a real uvicorn front in this process
(plaintext; tests/router/test_openai_http.py drives the router process over TLS):

- at its total, a connection already open is still served, and the next one gets 503;
- a request answered before its body arrived (an unknown path) is closed once the body is late,
  without a second answer.
"""

from __future__ import annotations

import socket

import pytest

from specpool.bench.slow_http_clients import connect
from specpool.common.http_limits import HttpLimits
from specpool.common.security import Security
from specpool.router.openai_http import HttpFront

LIMITS = HttpLimits(header_timeout_s=5.0, body_timeout_s=0.5, idle_timeout_s=5.0, max_connections=4,
                    max_connections_per_client=4)
WITHIN_S = 10.0  # a bounded wait for what the limits must bring about


@pytest.fixture(scope="module")
def front():
    with socket.socket() as unused:  # the gRPC port it would forward to: these requests never get there
        unused.bind(("127.0.0.1", 0))
        grpc_port = unused.getsockname()[1]
    front = HttpFront(Security.insecure(), grpc_port, "127.0.0.1", 0, grace_s=1.0, limits=LIMITS)
    front.start()
    yield front
    front.stop()


def exchange(sock: socket.socket, request: bytes) -> bytes:
    """Sends `request`, returns all the server sends until it closes the connection."""
    sock.settimeout(WITHIN_S)
    sock.sendall(request)
    received = b""
    while data := sock.recv(65536):
        received += data
    sock.close()
    return received


def test_at_its_total_the_open_connections_are_served_and_the_next_gets_503(front):
    held = [connect(front.port, f"127.0.0.{80 + i}", None) for i in range(LIMITS.max_connections)]
    served = exchange(held[0], b"GET /v1/nothing-here HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert served.startswith(b"HTTP/1.1 404 "), served  # uvicorn's limit_concurrency would say 503 here
    held.pop(0)
    held.append(connect(front.port, "127.0.0.90", None))  # the total again
    refused = exchange(connect(front.port, "127.0.0.91", None), b"")
    assert refused.startswith(b"HTTP/1.1 503 Service Unavailable") and b"--http-max-connections 4" in refused
    for sock in held:
        sock.close()


def test_a_request_answered_before_its_body_is_closed_when_the_body_is_late(front):
    reply = exchange(connect(front.port, "127.0.0.92", None),
                     b"POST /v1/nothing-here HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
    assert reply.startswith(b"HTTP/1.1 404 ") and b"408" not in reply, reply
