"""Endpoint quotas against an unfriendly client, through a real serve-spec process (n-gram drafter):

- an over-long context is refused per session, unread, and one that grows past --max-len is closed;
- a tenant holds at most --max-sessions-per-tenant sessions; no lease outlives --max-lease-s;
- invented tenant names add no metric series beyond --tenant-labels (the rest count as "_other");
- meanwhile another tenant's round latency p99 stays within 20% of its own, measured side by side.

The endpoint knows a caller's tenant by its client certificate (client/<tenant> from the tests' CA),
not by the requests' `tenant` fields: each tenant here calls on a connection of its own.
"""

from __future__ import annotations

import queue
import random
import re
import threading
import time
import urllib.request

import grpc
import pytest

from specpool.cluster.processes import ServerProcess, start_server
from specpool.engine.runtime.config import tiny_config
from specpool.engine.runtime.gguf_loader import save_gguf
from specpool.engine.runtime.model import random_weights
from specpool_client.v1 import speculation_pb2 as pb
from specpool_client.v1 import speculation_pb2_grpc as pb_grpc
from tests.pki import CA

MODEL = "tiny"
V = 64
MAX_LEN, PER_TENANT, MAX_LEASE_S, TENANT_LABELS = 2048, 8, 2.0, 8
NGRAM = pb.DRAFTER_KIND_NGRAM
HUGE = 400_000  # tokens: the context the issue saw cost 147 MB and a 2 s engine stall


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    cfg = tiny_config(vocab_size=V, d_model=16)
    gguf = save_gguf(tmp_path_factory.mktemp("quotas") / "tiny.gguf", cfg, random_weights(cfg, seed=5))
    server = start_server("spec-quotas", [
        "serve-spec", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--drafter", f"{MODEL}={gguf}",
        "--threads", "1", "--batch-window-ms", "0", "--max-sessions", "64", "--max-len", str(MAX_LEN),
        "--max-sessions-per-tenant", str(PER_TENANT), "--lease-s", str(MAX_LEASE_S), "--max-lease-s",
        str(MAX_LEASE_S), "--tenant-labels", str(TENANT_LABELS)])
    tenants = Tenants(server)
    try:
        yield server, tenants
    finally:
        tenants.close()
        ServerProcess.stop(server)


def connect(server: ServerProcess, tenant: str, options=None) -> grpc.Channel:
    """A channel whose client certificate names client/<tenant>: the tenant of every call on it."""
    return CA.client(tenant).channel(server.address, "endpoint", options=options)


class Tenants:
    """tenant -> its stub, on a channel of its own (kept, and closed at the end)."""

    def __init__(self, server: ServerProcess):
        self.server = server
        self.channels: dict[str, grpc.Channel] = {}

    def __call__(self, tenant: str) -> pb_grpc.SpeculationServiceStub:
        if tenant not in self.channels:
            self.channels[tenant] = connect(self.server, tenant)
        return pb_grpc.SpeculationServiceStub(self.channels[tenant])

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()


def open_request(tenant: str, ids: list[str], context: list[int], lease_s: float = 0.0) -> pb.OpenSessionsRequest:
    return pb.OpenSessionsRequest(tenant=tenant, target_model=MODEL, lease_s=lease_s, sessions=[
        pb.SessionSpec(request_id=r, context=context, drafter=NGRAM) for r in ids])


def context(n: int) -> list[int]:
    return [(i * 7) % V for i in range(n)]


class Rounds:
    """One Rounds stream: ask() sends a round and waits for its reply."""

    def __init__(self, stub):
        self._requests: queue.Queue = queue.Queue()
        self._replies = stub.Rounds(iter(self._requests.get, None), timeout=120)
        self._next_id = 0

    def ask(self, tenant: str, *seqs: tuple[str, list[int], int]) -> pb.RoundsResponse:
        self._next_id += 1
        self._requests.put(pb.RoundsRequest(tenant=tenant, round_id=self._next_id, sequences=[
            pb.SequenceRound(request_id=r, new_tokens=t, num_draft_tokens=n) for r, t, n in seqs]))
        return next(self._replies)

    def close(self) -> None:
        self._requests.put(None)


def active(stub, label: str) -> int:
    capacity = stub.GetCapacity(pb.GetCapacityRequest(), timeout=10)
    return sum(t.active_sessions for t in capacity.tenants if t.tenant == label)


def metrics_text(server: ServerProcess) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        return r.read().decode()


def test_an_over_long_context_is_refused_per_session_and_a_session_that_outgrows_it_is_closed(endpoint):
    _, tenants = endpoint
    stub = tenants("long")
    start = time.perf_counter()
    reply = stub.OpenSessions(pb.OpenSessionsRequest(tenant="long", target_model=MODEL, sessions=[
        pb.SessionSpec(request_id="huge", context=context(HUGE), drafter=NGRAM),
        pb.SessionSpec(request_id="fine", context=context(MAX_LEN), drafter=NGRAM)]), timeout=10)
    seconds = time.perf_counter() - start
    huge, fine = reply.sessions
    assert not huge.ok and huge.error == (f"sessions[0].context: {HUGE} tokens exceed this endpoint's max length "
                                          f"{MAX_LEN} (--max-len); draft this sequence locally")
    assert fine.ok, "the request's other session opens"
    assert seconds < 1.0, f"refused unread, yet took {seconds:.2f}s"

    rounds = Rounds(stub)
    try:
        [outgrown] = rounds.ask("long", ("fine", [1], 2)).sequences
        assert outgrown.error.startswith(f"sequences[0].new_tokens: the session would hold {MAX_LEN + 1} tokens, "
                                         f"over this endpoint's max length {MAX_LEN} (--max-len); session closed")
        assert active(stub, "long") == 0
    finally:
        rounds.close()


def test_a_tenant_holds_at_most_its_cap_of_sessions(endpoint):
    _, tenants = endpoint
    greedy, victim = tenants("greedy"), tenants("victim")
    reply = greedy.OpenSessions(open_request("greedy", [f"g{i}" for i in range(12)], context(32)), timeout=10)
    assert [s.ok for s in reply.sessions] == [True] * PER_TENANT + [False] * 4
    assert reply.sessions[-1].error == (
        f"capacity: tenant 'greedy' holds its maximum of {PER_TENANT} sessions on this endpoint "
        "(--max-sessions-per-tenant); close finished ones or draft locally")
    # Naming another tenant in the request changes nothing: the cap is the caller's.
    renamed = greedy.OpenSessions(open_request("victim", ["g-renamed"], context(32)), timeout=10)
    assert not renamed.sessions[0].ok and renamed.sessions[0].error.startswith("capacity: tenant 'greedy'")
    opened = victim.OpenSessions(open_request("victim", ["v0", "v1"], context(32)), timeout=10)
    assert all(s.ok for s in opened.sessions), "the other tenant still opens sessions"
    # Nor can a caller close another tenant's sessions by naming it.
    assert greedy.CloseSessions(pb.CloseSessionsRequest(tenant="victim", request_ids=["v0", "v1"]),
                                timeout=10).closed == 0
    assert active(victim, "victim") == 2
    assert greedy.CloseSessions(pb.CloseSessionsRequest(tenant="greedy", request_ids=[f"g{i}" for i in range(12)]),
                                timeout=10).closed == PER_TENANT
    assert victim.CloseSessions(pb.CloseSessionsRequest(tenant="victim", request_ids=["v0", "v1"]),
                                timeout=10).closed == 2


def test_no_lease_outlives_the_maximum(endpoint):
    """The issue's victim got 27 of 28 rounds as fallback while lease_s=1e9 sessions held the slots."""
    _, tenants = endpoint
    stub = tenants("greedy")
    reply = stub.OpenSessions(open_request("greedy", ["forever"], context(32), lease_s=1e9), timeout=10)
    opened = time.monotonic()
    assert reply.sessions[0].ok, "longer leases are clamped, not refused"
    deadline = opened + MAX_LEASE_S + 2.0  # the lease sweep runs every MAX_LEASE_S / 4
    while active(stub, "greedy") and time.monotonic() < deadline:
        time.sleep(0.1)
    held = time.monotonic() - opened
    assert active(stub, "greedy") == 0, f"a lease_s=1e9 session still held after {held:.1f}s"
    assert held >= MAX_LEASE_S - 0.2, "it expired by the clamped lease, not before"


def tenant_labels(text: str) -> set[str]:
    return set(re.findall(r'tenant="([^"]*)"', text))


def test_invented_tenant_names_add_no_metric_series_beyond_the_named_ones(endpoint):
    """500 tenants, each with a certificate of its own (one the CA issued: a tenant name is no longer
    something a caller makes up, but an operator may still hand out many)."""
    server, _ = endpoint
    before = len(metrics_text(server))
    for i in range(500):
        name = f"sybil-{i}"
        with connect(server, name) as channel:
            stub = pb_grpc.SpeculationServiceStub(channel)
            assert stub.OpenSessions(open_request(name, ["s"], context(16)), timeout=10).sessions[0].ok
            rounds = Rounds(stub)
            try:
                [drafted] = rounds.ask(name, ("s", [], 2)).sequences
                assert not drafted.error, drafted.error
            finally:
                rounds.close()
            assert stub.CloseSessions(pb.CloseSessionsRequest(tenant=name, request_ids=["s"]), timeout=10).closed == 1
    text = metrics_text(server)
    labels = tenant_labels(text)
    assert len(labels) <= TENANT_LABELS + 1 and "_other" in labels, sorted(labels)
    print(f"/metrics: {before} bytes before, {len(text)} after 500 invented tenants; labels {sorted(labels)}")
    assert len(text) < before + 4000, f"/metrics grew from {before} to {len(text)} bytes"


WINDOWS, WINDOW_S, PERIOD_S, ATTEMPTS = 16, 1.0, 0.005, 4
LONG = 10_000  # tokens: over the cap, in every abused window (parsing it costs about 0.1 ms)


def p99(xs: list[float]) -> float:
    return sorted(xs)[int(0.99 * (len(xs) - 1))]


@pytest.mark.serial
def test_abuse_leaves_another_tenants_round_latency_p99_unchanged(endpoint):
    """A steady tenant sends a round every 10 ms, as a target does each step; its latency counts from
    when the round was due, so a stall counts every round it delays. Windows with and without abuse
    alternate, so both samples see the same machine. Each abused window has one burst from a client
    of its own, at a random moment: an over-long context of 10k tokens; in the first, the issue's
    400k tokens instead, 12 sessions with lease_s=1e9 from one tenant and a session under a new
    tenant name. (Parsing the 400 KB message holds the server's GIL for a few ms, as a large
    legitimate open does; the engine stall the issue saw lasted 2 s.)

    Other work on this machine shifts a p99 by more than 20% now and then, so a measurement that
    misses is repeated, up to ATTEMPTS in all; a stall like the issue's fails every one."""
    server, tenants = endpoint
    stub = tenants("steady")
    # Its own connection: sharing the steady tenant's would queue its rounds behind 400 KB of frames.
    local_pool = [("grpc.use_local_subchannel_pool", 1)]
    channel = connect(server, "abuser", options=local_pool)
    abuser = pb_grpc.SpeculationServiceStub(channel)
    # A new tenant name in each attempt's first abused window (n: refusals so far), its certificate
    # issued and its connection made here: neither may cost this process's GIL while it measures.
    invented = {n: connect(server, f"invented-{n}", options=local_pool)
                for n in range(0, ATTEMPTS * WINDOWS // 2, WINDOWS // 2)}
    for ready in [channel, *invented.values()]:
        grpc.channel_ready_future(ready).result(timeout=30)
    open_raw = channel.unary_unary("/specpool.v1.SpeculationService/OpenSessions",
                                   response_deserializer=pb.OpenSessionsResponse.FromString)
    # Serialized once here: building them must not cost this process's GIL while it measures.
    over_long = {n: open_request("abuser", ["long"], context(n)).SerializeToString() for n in (HUGE, LONG)}
    rng = random.Random(13)
    refused: list[str] = []

    def burst(first: bool, n: int) -> None:
        time.sleep(rng.uniform(0.1, 0.7) * WINDOW_S)
        [s] = open_raw(over_long[HUGE if first else LONG], timeout=30).sessions
        refused.append(s.error)
        if first:
            abuser.OpenSessions(open_request("abuser", [f"a{i}" for i in range(12)], context(32), lease_s=1e9),
                                timeout=30)
            pb_grpc.SpeculationServiceStub(invented[n]).OpenSessions(
                open_request(f"invented-{n}", ["x"], context(16), lease_s=1e9), timeout=30)

    ids = [f"r{i}" for i in range(4)]
    assert all(s.ok for s in stub.OpenSessions(open_request("steady", ids, context(200)), timeout=10).sessions)
    rounds = Rounds(stub)

    def measure() -> tuple[float, float]:
        """-> round latency p99 (calm, abused)."""
        latencies: dict[bool, list[float]] = {False: [], True: []}
        for window in range(WINDOWS):
            abused = window % 2 == 1
            thread = threading.Thread(target=burst, args=(window == 1, len(refused)), daemon=True)
            if abused:
                thread.start()
            due = time.perf_counter()
            end = due + WINDOW_S
            while due < end:
                time.sleep(max(0.0, due - time.perf_counter()))
                reply = rounds.ask("steady", *((r, [], 4) for r in ids))
                latencies[abused].append(time.perf_counter() - due)
                assert not any(s.error for s in reply.sequences), [s.error for s in reply.sequences]
                due += PERIOD_S
            if abused:
                thread.join(60)  # a calm window starts once the burst has ended
        return p99(latencies[False]), p99(latencies[True])

    try:
        for _ in range(3):
            rounds.ask("steady", *((r, [], 4) for r in ids))  # warm-up
        figures = []
        for _ in range(ATTEMPTS):
            calm, abused = measure()
            figures.append(f"{calm * 1e3:.2f} ms calm, {abused * 1e3:.2f} ms abused")
            if abused <= 1.2 * calm:
                break
    finally:
        rounds.close()
        channel.close()
        for other in invented.values():
            other.close()
    print("round latency p99 per attempt:", "; ".join(figures))
    assert len(refused) == len(figures) * WINDOWS // 2
    assert all(re.match(rf"sessions\[0\]\.context: ({HUGE}|{LONG}) tokens exceed", e) for e in refused), refused
    assert abused <= 1.2 * calm, f"p99 under abuse over 1.2x calm in {ATTEMPTS} attempts: {figures}"
