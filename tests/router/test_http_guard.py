"""The HTTP front's guard (router/http_guard.py) at its edges, on a real uvicorn front in this process
(plaintext; tests/router/test_openai_http.py drives the router process over TLS):

- at its total, a connection already open is still served, and the next one gets 503;
- a request answered before its body arrived (an unknown path) is closed once the body is late,
  without a second answer;
- on a router process over TLS (issue 52.1): a tenant is served while another tenant on the same
  client address holds 150 slow connections;
- with a target behind it (issue 52.2): a tenant is served within 2 s while another holds 8 streams it
  never reads, and those are dropped once stalled.
"""

from __future__ import annotations

import json
import socket
import ssl
import time
from dataclasses import replace

import pytest

from specpool.bench.slow_http_clients import connect, same_address
from specpool.cluster.processes import start_server, wait_for
from specpool.cluster.redis_server import start_redis
from specpool.common.http_limits import HttpLimits
from specpool.common.security import Security
from specpool.engine.runtime.config import tiny_config
from specpool.engine.runtime.gguf_loader import default_model_path, load_gguf, save_gguf
from specpool.engine.runtime.model import random_weights
from specpool.router.http_guard import TenantLimits
from specpool.router.openai_http import HttpFront
from tests.cluster.test_disaggregation import routed_target
from tests.pki import CA

LIMITS = HttpLimits(header_timeout_s=5.0, body_timeout_s=0.5, idle_timeout_s=5.0, max_connections=4,
                    max_connections_per_client=4)
WITHIN_S = 10.0  # a bounded wait for what the limits must bring about


def unused_port() -> int:
    """The gRPC port a front would forward to: these requests never get there."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        return unused.getsockname()[1]


@pytest.fixture(scope="module")
def front():
    front = HttpFront(Security.insecure(), unused_port(), "127.0.0.1", 0, grace_s=1.0, limits=LIMITS)
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


def test_when_too_many_wait_for_a_token_the_oldest_gives_way():
    """A connection that has not shown a token waits in a small pool; a new one pushes out the oldest, so a
    client that sends its request at once is served however many silent ones came before it."""
    tight = HttpFront(Security.insecure(), unused_port(), "127.0.0.1", 0, grace_s=1.0, limits=LIMITS,
                      tenant_limits=TenantLimits(max_unauthenticated=2))
    tight.start()
    try:
        oldest = connect(tight.port, "127.0.0.93", None)
        second = connect(tight.port, "127.0.0.94", None)
        served = exchange(connect(tight.port, "127.0.0.95", None),
                          b"GET /v1/nothing-here HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert served.startswith(b"HTTP/1.1 404 "), served
        gave_way = exchange(oldest, b"")
        assert gave_way.startswith(b"HTTP/1.1 503 ") and b"--http-max-unauthenticated-connections 2" in gave_way
        second.close()
    finally:
        tight.stop()


# -- one address, many tenants (issue 52.1), on a router process over TLS -----------------------------------

SAME_ADDRESS_LIMITS = ["--http-header-timeout-s", "4", "--http-body-timeout-s", "8", "--http-idle-timeout-s", "1"]


@pytest.fixture(scope="module")
def router():
    """Redis and a serve-router with its HTTPS front, its per-address and per-tenant caps at their defaults."""
    redis = start_redis()
    router = None
    try:
        router = start_server("router", ["serve-router", "--port", "0", "--metrics-port", "0", "--redis", redis.url,
                                         *SAME_ADDRESS_LIMITS])
        yield router
    finally:
        if router is not None:
            router.stop()
        redis.close()
    assert "Traceback" not in router.logs(), router.logs()


def test_a_tenant_is_served_while_another_on_its_address_trickles_150_connections(router):
    """Issue 52.1: behind one proxy or NAT every tenant has one address. Mallory opens 150 slow connections
    from 127.0.0.1, 75 trickling bodies under its valid token and 75 trickling heads without one; alpha,
    from 127.0.0.1 too, is served 8 requests of 8 meanwhile. (Before, the per-address cap of 64 held
    mallory's connections and alpha's together: alpha got 429.)"""
    tls = ssl.create_default_context(cafile=str(CA.dir / "ca.crt"))
    figures = same_address(router.http_port, tls, CA.token("mallory"), CA.token("alpha"), within_s=30.0)
    print(figures)
    assert figures["alpha"]["served"] == 8, (figures["alpha"], figures["mallory_answers"])
    assert figures["still_open_after_s"]["connections"] == 0, figures
    # mallory's own share held: past 64 requests in flight (--http-max-requests-per-tenant) its bodies got 429
    assert "HTTP/1.1 429 Too Many Requests" in figures["mallory_answers"], figures


# -- issue 52.2: streams their client never reads ----------------------------------------------------------

STALL_S = 3.0  # the router's --http-stall-timeout-s here
NEVER_READ = 8  # mallory's streams: as many as the target's batch (the default cluster's 8)


@pytest.fixture(scope="module")
def served_router(tmp_path_factory):
    """Redis, a tiny target that tokenizes like SmolLM2 (--max-batch 8, of which a tenant holds three quarters:
    a target several tenants share) and a router whose HTTP front drops a response stalled STALL_S."""
    real = load_gguf(default_model_path(), only=set())  # its tokenizer, no weights
    config = replace(tiny_config(vocab_size=real.config.vocab_size, d_model=16),
                     bos_id=real.config.bos_id, eos_id=real.config.eos_id, max_context=4096)
    weights = random_weights(config, seed=4)
    # Its end token scores 0 where the other 49151 score at random: greedy never ends a stream early (the OpenAI
    # front has no ignore_eos, and where a random model's greedy text met it varied with the batch).
    weights["lm_head" if "lm_head" in weights else "embed"][config.eos_id] = 0.0
    gguf = save_gguf(tmp_path_factory.mktemp("stall") / "tiny-chat.gguf", config, weights, tokenizer_of=real)
    with routed_target(gguf, ["--max-batch", str(NEVER_READ), "--max-context", "4096",
                              "--max-requests-per-tenant", str(3 * NEVER_READ // 4)],
                       ["--http-stall-timeout-s", str(STALL_S)]) as servers:
        wait_for(lambda: servers["target"].metric_total("specpool_target_max_batch") == NEVER_READ)
        yield servers


def completion(model: str, token: str, max_tokens: int, stream: bool, close: bool = False,
               speculation: str = "auto") -> bytes:
    """A POST /v1/completions as it goes on the wire: greedy, its whole max_tokens, speculating by `speculation`
    (the specpool extension's method)."""
    body = json.dumps({"model": model, "prompt": "def fibonacci(n):", "max_tokens": max_tokens,
                       "temperature": 0, "stream": stream, "speculation": {"method": speculation}}).encode()
    head = ["POST /v1/completions HTTP/1.1", "host: router.specpool", f"authorization: Bearer {token}",
            "content-type: application/json", f"content-length: {len(body)}", *(["connection: close"] if close else [])]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


@pytest.mark.serial  # paced by its streams' stalls: beside other tests' servers all 8 finished before stalling
def test_a_tenant_is_served_while_another_never_reads_its_streams(served_router):
    """Issue 52.2, attack 2: mallory opens 8 streamed completions of 3000 tokens and never reads them. Alpha
    is served within 2 s meanwhile: mallory holds at most three quarters of the target's batch (with no cap
    her streams filled it and alpha waited 9 s; in the issue, ~33 s). Mallory's streams are dropped once
    their send buffers stayed full STALL_S, and their calls cancelled at once: their batch slots free,
    each counted cancelled (before, each ran on to its 3000 tokens)."""
    router, target, model = served_router["router"], served_router["target"], served_router["model"]
    tls = ssl.create_default_context(cafile=str(CA.dir / "ca.crt"))
    cancelled = target.metric_total("specpool_target_requests_total", outcome="cancelled")
    mallory = []
    for _ in range(NEVER_READ):
        # A small receive buffer: what a client that never reads holds of the stream before the router's
        # send buffer fills (a default one holds the first few hundred kilobytes, the tiny model's whole answer).
        sock = connect(router.http_port, "127.0.0.1", tls, receive_buffer=4096)
        # Decoded plainly: their pace is the target's plain steps, not how fast its n-gram plans learn the tiny
        # model's loops (drafting them, the target finished all 8 streams before any stalled, 1 run in 3).
        sock.sendall(completion(model, CA.token("mallory"), 3000, stream=True, speculation="none"))
        mallory.append(sock)  # never read
    opened = time.monotonic()
    wait_for(lambda: target.metric_total("specpool_target_running_sequences") >= 3 * NEVER_READ // 4, timeout_s=30)
    began = time.monotonic()
    reply = exchange(connect(router.http_port, "127.0.0.1", tls), completion(model, CA.token("alpha"), 8,
                                                                              stream=False, close=True))
    served_s = time.monotonic() - began
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    assert served_s < 2.0, f"alpha waited {served_s:.1f} s beside mallory's never-read streams"
    # Each of mallory's accepted streams is dropped STALL_S after its send buffer filled (a few seconds of
    # decoding in): each is cancelled at the target, long before its 3000 tokens, and the batch empties.
    wait_for(lambda: target.metric_total("specpool_target_running_sequences") == 0, timeout_s=STALL_S + 30)
    dropped_s = time.monotonic() - opened
    held = target.metric_total("specpool_target_requests_total", outcome="cancelled") - cancelled
    for sock in mallory:
        sock.close()
    print(f"alpha served in {served_s:.2f} s; mallory's {held:.0f} streams dropped {dropped_s:.1f} s after opening")
    assert held == 3 * NEVER_READ // 4, router.logs()[-4000:]  # the rest were refused at her share
    stalled = router.logs().count(f"tenant mallory: the client of /v1/completions read nothing for {STALL_S:g} s")
    assert stalled == held, router.logs()[-4000:]
