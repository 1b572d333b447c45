"""Issue 52.2 on the gRPC fronts: a client that stops reading its stream is cut off, real processes (Redis,
a tiny serve-target and a serve-router with --grpc-stall-timeout-s STALL_S).

gRPC sends a stream's messages one at a time; a client that never reads, on a channel with a small HTTP/2
window (its own choice: no BDP probing, 1 KB of lookahead), holds the server's send of the next message.
Before the write deadline such a call kept its server thread, which admission counts, until the client's
own deadline: mallory filled a target's admission (--max-batch + --max-queue calls) and every other tenant
got RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import time

import grpc
import pytest

from specpool.cluster.processes import wait_for
from specpool_client.v1 import target_pb2 as pb
from specpool_client.v1 import target_pb2_grpc
from tests.cluster.test_disaggregation import routed_target, tiny_files
from tests.pki import channel, token_metadata

STALL_S = 1.0  # the target's --grpc-stall-timeout-s
ROUTER_STALL_S = 0.5  # the router's: it cuts a stream while the replica still decodes it
MAX_BATCH = 3  # with --max-queue 1: admission holds 4 calls
# A window that takes ~20 of the stream's messages: the target's writes stall at once, long before its
# decoding ends (a default channel grows its window and takes every message, unread).
NEVER_READS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
# Tokens of each of mallory's requests: seconds of decoding (~3000 tokens/s a row on a quiet machine), far
# longer than the stall timeouts, so every stream is cut while its request still decodes.
LONG = 16000


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    gguf, _ = tiny_files(tmp_path_factory.mktemp("stall"), vocab=64, seed=5, max_context=16384)
    with routed_target(gguf, ["--max-batch", str(MAX_BATCH), "--max-queue", "1", "--max-context", "16384",
                              "--grpc-stall-timeout-s", str(STALL_S)],
                       ["--grpc-stall-timeout-s", str(ROUTER_STALL_S)]) as started:
        yield started


def request(model: str, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(model=model, prompt_ids=pb.TokenIds(ids=[3, 7, 9, 11]), max_tokens=max_tokens,
                              ignore_eos=True)


def test_a_target_cancels_streams_nobody_reads_and_serves_the_next_tenant(servers):
    """Mallory opens as many never-read streams as the target admits, and alpha is refused. Each of mallory's
    calls is cancelled STALL_S (plus the watcher's tick) after its stall, with one log line naming her, and
    counted cancelled, its slot freed; then alpha is served (before: refused until
    mallory's own deadline, 60 s). Mallory's client never learns: it reads nothing, not even the status."""
    target, model = servers["target"], servers["model"]
    cancelled = target.metric_total("specpool_target_requests_total", outcome="cancelled")
    with channel(target.address, "target", tenant="mallory", options=NEVER_READS) as unread, \
            channel(target.address, "target", tenant="alpha") as read:
        mallory = [target_pb2_grpc.TargetServiceStub(unread).Generate(request(model, LONG), timeout=60)
                   for _ in range(MAX_BATCH + 1)]
        opened = time.monotonic()
        alpha = target_pb2_grpc.TargetServiceStub(read)
        wait_for(lambda: target.metric_total("specpool_target_running_sequences") == MAX_BATCH, timeout_s=30)
        refusals = 0
        while True:  # refused while mallory's stalled calls hold every admitted thread, then served
            try:
                served = list(alpha.Generate(request(model, 8), timeout=10))
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                refusals += 1
                assert time.monotonic() - opened < 2 * STALL_S + 10, "alpha still refused beside never-read streams"
                time.sleep(0.25)
        served_s = time.monotonic() - opened
        wait_for(lambda: target.logs().count("tenant mallory stopped reading its stream") == len(mallory),
                 timeout_s=STALL_S + 10)  # the queued one too, once it ran and stalled
        for call in mallory:
            call.cancel()
    print(f"alpha refused {refusals} times, served {served_s:.1f} s after mallory's streams opened")
    assert refusals > 0  # the target was full: what the deadline must undo
    assert len(served[-1].final.completions[0].token_ids) == 8
    held = target.metric_total("specpool_target_requests_total", outcome="cancelled") - cancelled
    assert held == len(mallory), held  # each cut while decoding, the queued one once it ran


def test_a_router_cancels_a_stream_nobody_reads_and_the_replica_stops_decoding_it(servers):
    """The router's gRPC front has the same deadline: mallory's never-read stream through it is cut after
    ROUTER_STALL_S, and so is the call it forwarded, which the target counts cancelled (before its LONG
    tokens: the router's own channel takes the whole stream, so only the router sees the stall)."""
    router, target, model = servers["router"], servers["target"], servers["model"]
    wait_for(lambda: target.metric_total("specpool_target_running_sequences") == 0, timeout_s=30)
    cancelled = target.metric_total("specpool_target_requests_total", outcome="cancelled")
    with channel(router.address, "router", tenant="mallory", options=NEVER_READS) as unread:
        call = target_pb2_grpc.TargetServiceStub(unread).Generate(request(model, LONG), timeout=60,
                                                                  metadata=token_metadata("mallory"))
        opened = time.monotonic()
        wait_for(lambda: target.metric_total("specpool_target_requests_total", outcome="cancelled") > cancelled,
                 timeout_s=ROUTER_STALL_S + 10)
        ended_s = time.monotonic() - opened
        call.cancel()
    print(f"the stalled stream's forwarded call was cancelled {ended_s:.1f} s after opening")
    assert router.logs().count("tenant mallory stopped reading its stream") == 1
