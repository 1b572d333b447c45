"""What an unfriendly tenant tried on a shared pool (issue 14), as real processes on 127.0.0.1.

Each attack runs against servers started as `specpool up` starts them (TLS, mutual TLS between
services, bearer tokens, Redis with a password) and against the same servers with --insecure,
which is how every server ran before. On --insecure each attack must still work: that is the proof
that the test reaches what it names. Secure, each must fail with the documented status, and the
rightful owner's flow must still work.
"""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis
import torch
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specpool.cluster.processes import ServerProcess, start_server, wait_for
from specpool.cluster.redis_server import start_redis
from specpool.common.registry import Heartbeat, Registry
from specpool.common.security import LocalCA, Security
from specpool.common.serving import build_server
from specpool.common.speculation import backend_from_pb
from specpool.common.tensor_channel import ChannelOffer, DistributedPairChannel
from specpool.engine.runtime.gguf_loader import model_name
from specpool_client import generate_result
from specpool_client.v1 import speculation_pb2 as spb
from specpool_client.v1 import speculation_pb2_grpc, target_pb2_grpc
from specpool_client.v1 import target_pb2 as pb
from tests.cluster.test_disaggregation import ONE_THREAD, tiny_files
from tests.pki import CA

pytestmark = pytest.mark.slow

MODES = ["secure", "insecure"]


def credentials(mode: str, role: str, name: str, tenant: str | None = None) -> Security:
    """A party of the tests: a certificate role/name from the cluster's CA, and a tenant's token."""
    if mode == "insecure":
        return Security.insecure()
    return Security.load(CA.dir, role, name, token=CA.token(tenant) if tenant else None)


def insecure_flag(mode: str) -> list[str]:
    return ["--insecure"] if mode == "insecure" else []


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    return tiny_files(tmp_path_factory.mktemp("isolation"), vocab=64, seed=5)


# -- the endpoint: sessions and their drafts belong to the tenant that opened them ----------------------


@pytest.fixture(scope="module", params=MODES)
def endpoint(request, model_files):
    gguf, draft = model_files
    server = start_server(f"spec-{request.param}", [
        "serve-spec", "--port", "0", "--metrics-port", "0", "--drafter", f"{model_name(gguf)}={gguf},draft={draft}",
        "--max-sessions", "8", "--endpoint-id", "spec", *ONE_THREAD, *insecure_flag(request.param)])
    yield request.param, model_name(gguf), server
    server.stop()


class Tenant:
    """One target service's side of the endpoint protocol: sessions and one Rounds stream."""

    def __init__(self, mode: str, name: str, address: str, model: str):
        self.name, self.model = name, model
        self.channel = credentials(mode, "target", name).channel(address, "endpoint")
        self.stub = speculation_pb2_grpc.SpeculationServiceStub(self.channel)
        self._round = 0

    def open(self, request_id: str, context: list[int], as_tenant: str | None = None,
             dense: bool = False) -> spb.OpenedSession:
        """dense: sampled drafts whose q rows go over the tenant's tensor channel."""
        spec = spb.SessionSpec(request_id=request_id, context=context, drafter=spb.DRAFTER_KIND_DRAFT_MODEL)
        if dense:
            spec.sampling.temperature = 1.0
            spec.transport = spb.DISTRIBUTION_TRANSPORT_DENSE
        reply = self.stub.OpenSessions(spb.OpenSessionsRequest(
            tenant=as_tenant or self.name, target_model=self.model, sessions=[spec]), timeout=30)
        return reply.sessions[0]

    def round(self, request_id: str, as_tenant: str | None = None, k: int = 3,
              new_tokens: tuple[int, ...] = ()) -> spb.RoundsResponse:
        """new_tokens: what the target emitted since the session's previous round (none before the first)."""
        self._round += 1
        request = spb.RoundsRequest(tenant=as_tenant or self.name, round_id=self._round, sequences=[
            spb.SequenceRound(request_id=request_id, num_draft_tokens=k, new_tokens=new_tokens)])
        [reply] = list(self.stub.Rounds(iter([request]), timeout=30))
        return reply

    def draft(self, request_id: str, **kwargs) -> spb.SequenceDrafts:
        return self.round(request_id, **kwargs).sequences[0]

    def close(self, request_ids: list[str], as_tenant: str | None = None) -> int:
        return self.stub.CloseSessions(spb.CloseSessionsRequest(tenant=as_tenant or self.name,
                                                                request_ids=request_ids), timeout=10).closed


def tenants(endpoint) -> tuple[str, Tenant, Tenant]:
    mode, model, server = endpoint
    return mode, Tenant(mode, "alice", server.address, model), Tenant(mode, "mallory", server.address, model)


def test_a_tenant_cannot_read_drafts_of_anothers_context(endpoint):
    mode, alice, mallory = tenants(endpoint)
    assert alice.open("private-1", [3, 9, 27, 17, 51]).ok
    stolen = mallory.draft("private-1", as_tenant="alice")
    if mode == "insecure":  # the attack as it worked before: drafts that continue alice's context
        assert list(stolen.tokens) and not stolen.error
        return
    assert not stolen.tokens and "not found" in stolen.error  # mallory's own (absent) session: nothing leaks
    own = alice.draft("private-1")
    assert len(own.tokens) == 3 and not own.error


def test_a_tenant_cannot_close_or_replace_anothers_session(endpoint):
    mode, alice, mallory = tenants(endpoint)
    context = [4, 8, 15, 16, 23, 42]
    assert alice.open("doc-1", context).ok
    before = list(alice.draft("doc-1").tokens)
    alice.close(["doc-1"])
    assert alice.open("doc-1", context).ok
    # Replace alice's context with one of mallory's choosing, then close the session.
    assert mallory.open("doc-1", [60, 61, 62, 63], as_tenant="alice").ok
    after_replace = list(alice.draft("doc-1").tokens)
    mallory.close(["doc-1"], as_tenant="alice")
    after_close = alice.draft("doc-1", new_tokens=after_replace[:1])
    if mode == "insecure":
        assert after_replace != before and "not found" in after_close.error
        return
    # Secure, mallory opened and closed a doc-1 of her own; alice's is untouched: the same greedy drafts.
    assert after_replace == before
    assert list(after_close.tokens) and not after_close.error and alice.close(["doc-1"]) == 1


def test_a_tenant_cannot_take_over_anothers_tensor_channel(endpoint):
    """Mallory asks for a tensor channel in alice's name and joins it; alice then drafts with dense q."""
    mode, alice, mallory = tenants(endpoint)
    offer = mallory.stub.OpenTensorChannel(spb.OpenTensorChannelRequest(tenant="alice"), timeout=10)
    taken = DistributedPairChannel.connect(ChannelOffer(
        host=offer.store_host, port=offer.store_port, prefix=offer.prefix, backend=backend_from_pb(offer.backend),
        target_rank=offer.target_rank, timeout_s=offer.timeout_s, secret=offer.secret), offer.target_rank)
    try:
        time.sleep(0.5)  # the endpoint's side of the pair is filed just after the handshake
        assert alice.open("dense-1", [5, 6, 7, 8], dense=True).ok
        reply = alice.round("dense-1")
        [drafts] = reply.sequences
        if mode == "insecure":  # alice's draft distributions arrive at mallory's end
            assert drafts.dense_on_channel
            q = taken.recv((reply.dense_rows, reply.vocab_size), torch.float32)
            assert torch.allclose(q.sum(-1), torch.ones(reply.dense_rows), atol=1e-4)
            return
        # Secure, mallory's pair is her own: alice has none yet, and is told so (her target opens one).
        assert not drafts.dense_on_channel and not reply.dense_rows and "channel" in drafts.error
    finally:
        taken.close()
        alice.close(["dense-1"])


def test_a_target_sees_only_its_own_tenant_in_the_endpoint_capacity(endpoint):
    mode, alice, mallory = tenants(endpoint)
    assert alice.open("cap-1", [1, 2, 3]).ok and mallory.open("cap-2", [1, 2, 3]).ok
    seen = {t.tenant for t in mallory.stub.GetCapacity(spb.GetCapacityRequest(), timeout=10).tenants}
    if mode == "insecure":
        assert "alice" in seen
    else:
        assert seen == {"mallory"}
    alice.close(["cap-1"])
    mallory.close(["cap-2"])


# -- every port: no TLS, a foreign CA, no credential -----------------------------------------------------


def refusal(channel: grpc.Channel, call) -> grpc.StatusCode | None:
    try:
        call(channel)
        return None
    except grpc.RpcError as e:
        return e.code()
    finally:
        channel.close()


@pytest.mark.parametrize(("endpoint", "pool"), [("secure", "secure")], indirect=True)  # what they refuse
def test_every_port_refuses_plaintext_foreign_certificates_and_callers_without_credentials(
        endpoint, pool, tmp_path):
    _, _, spec = endpoint
    _, p = pool
    stranger = LocalCA.create(tmp_path / "other-ca")
    ports = {
        ("router", None): (p["router"].address, lambda ch: target_pb2_grpc.TargetServiceStub(ch).GetInfo(
            pb.GetInfoRequest(), timeout=5)),
        ("target", "alpha"): (p["target"].address, lambda ch: target_pb2_grpc.TargetServiceStub(ch).GetInfo(
            pb.GetInfoRequest(), timeout=5)),
        ("endpoint", "spec"): (spec.address, lambda ch: speculation_pb2_grpc.SpeculationServiceStub(ch).GetCapacity(
            spb.GetCapacityRequest(), timeout=5)),
    }
    for (role, name), (address, call) in ports.items():
        server_name = [("grpc.ssl_target_name_override", f"{name}.{role}.specpool" if name else f"{role}.specpool")]
        tls_only = grpc.ssl_channel_credentials(root_certificates=CA.cert_pem)
        foreign = stranger.client("intruder", "alpha")  # a certificate and a token, from another CA
        cases = {
            "plaintext": grpc.insecure_channel(address),
            "foreign CA": foreign.channel(address, role, name),
            "no credential": grpc.secure_channel(address, tls_only, options=server_name),
            "unknown token": grpc.secure_channel(address, grpc.composite_channel_credentials(
                tls_only, grpc.access_token_call_credentials("not-a-token-anyone-issued")), options=server_name),
        }
        for case, channel in cases.items():
            code = refusal(channel, call)
            # Without a certificate the mTLS ports end the handshake (UNAVAILABLE); the router, which asks
            # for no certificate, answers UNAUTHENTICATED.
            expected = {grpc.StatusCode.UNAVAILABLE} if case in ("plaintext", "foreign CA") or role != "router" \
                else {grpc.StatusCode.UNAUTHENTICATED}
            assert code in expected, f"{role} port, {case}: {code}"
        # Reflection describes the API to nobody unauthenticated either.
        assert refusal(grpc.secure_channel(address, tls_only, options=server_name),
                       lambda ch: list(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                           iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))) is not None
        # The rightful callers get through: a tenant at the router, a router at a target, an operator's
        # tool at the endpoint.
        rightful = {"router": credentials("secure", "client", "alpha", tenant="alpha"),
                    "target": credentials("secure", "router", "router"),
                    "endpoint": credentials("secure", "operator", "ops")}[role]
        assert refusal(rightful.channel(address, role, name), call) is None, f"{role} port, rightful caller"


# -- the router and its pool: requests and placements -----------------------------------------------------


@pytest.fixture(scope="module", params=MODES)
def pool(request, model_files):
    """Redis (with a password), a router and one tiny target, secure or --insecure."""
    mode = request.param
    gguf, _ = model_files
    redis_server = start_redis()
    env = {"SPECPOOL_REDIS_URL": redis_server.url}
    servers: list[ServerProcess] = []
    try:
        with ThreadPoolExecutor(2) as pool:
            router = pool.submit(start_server, f"router-{mode}", [
                "serve-router", "--port", "0", "--metrics-port", "0", *insecure_flag(mode)], env=env)
            target = pool.submit(start_server, f"alpha-{mode}", [
                "serve-target", "--model", str(gguf), "--port", "0", "--metrics-port", "0", "--tenant", "alpha",
                "--datastore", "", "--max-batch", "4", "--max-context", "200", *ONE_THREAD, *insecure_flag(mode)],
                env=env)
            servers += [router.result(), target.result()]
        registry = Registry(redis_server.url)
        wait_for(lambda: len(registry.targets()) == 1, timeout_s=30)
        registry.close()
        yield mode, {"router": servers[0], "target": servers[1], "redis": redis_server, "model": model_name(gguf)}
    finally:
        for s in servers:
            s.stop()
        redis_server.close()


def router_stub(mode: str, router: ServerProcess, tenant: str,
                claim: str | None = None) -> tuple[target_pb2_grpc.TargetServiceStub, list]:
    """A tenant's stub for the router (with its token), and the metadata it sends: x-specpool-tenant
    naming `claim` (default: itself). Secure, the router goes by the token alone."""
    channel = credentials(mode, "client", tenant, tenant=tenant).channel(router.address, "router")
    return target_pb2_grpc.TargetServiceStub(channel), [("x-specpool-tenant", claim or tenant)]


def long_request(request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, prompt_ids=pb.TokenIds(ids=[1, 2, 3]), max_tokens=150,
                              ignore_eos=True, speculation=pb.SpeculationPreference(method=pb.SPECULATION_METHOD_NONE))


def test_a_tenant_cannot_cancel_anothers_request_and_ids_are_per_tenant(pool):
    mode, p = pool
    alice, alice_md = router_stub(mode, p["router"], "alpha")
    mallory, mallory_md = router_stub(mode, p["router"], "mallory", claim="alpha")
    stream = alice.Generate(long_request("job-7"), metadata=alice_md, timeout=120)
    tokens = [len(next(stream).delta.token_ids)]  # running now
    # Is job-7 running? Before, ALREADY_EXISTS answered that for anyone's ids.
    try:
        same_id = generate_result(mallory, pb.GenerateRequest(request_id="job-7", prompt_ids=pb.TokenIds(ids=[1]),
                                                           max_tokens=2), metadata=mallory_md, timeout=60)
        probe = grpc.StatusCode.OK if same_id.completions else None
    except grpc.RpcError as e:
        probe = e.code()
    try:
        mallory.Cancel(pb.CancelRequest(request_id="job-7"), metadata=mallory_md, timeout=10)
        cancel = grpc.StatusCode.OK
    except grpc.RpcError as e:
        cancel = e.code()
    try:
        tokens += [len(m.delta.token_ids) for m in stream if m.HasField("delta")]
    except grpc.RpcError:
        pass
    finished = sum(tokens) == 150  # a cancelled request ends early
    if mode == "insecure":
        assert probe == grpc.StatusCode.ALREADY_EXISTS and cancel == grpc.StatusCode.OK and not finished
        return
    assert probe == grpc.StatusCode.OK  # mallory's own job-7
    assert cancel == grpc.StatusCode.NOT_FOUND
    assert finished
    # The owner can cancel its own.
    stream = alice.Generate(long_request("job-8"), metadata=alice_md, timeout=120)
    next(stream)
    assert alice.Cancel(pb.CancelRequest(request_id="job-8"), timeout=10).cancelled


class FakeTarget(target_pb2_grpc.TargetServiceServicer):
    """An impostor: registers in Redis as a big replica of the real model and keeps every prompt."""

    def __init__(self, credentials: Security, redis_url: str, model: str, tenant: str):
        self.prompts: list[pb.GenerateRequest] = []
        self.server, port = build_server(0, credentials=credentials)
        target_pb2_grpc.add_TargetServiceServicer_to_server(self, self.server)
        self.server.start()
        self.heartbeat = Heartbeat(redis_url, "target", f"127.0.0.1:{port}", lambda: {
            "address": f"127.0.0.1:{port}", "model": model, "tenant": tenant, "max_batch": 1000,
            "methods": ["ngram"]}, ttl_s=2.0, interval_s=0.2)

    def Generate(self, request, context):
        self.prompts.append(request)
        yield pb.GenerateResponse(request_id=request.request_id, final=pb.GenerateResult(
            request_id=request.request_id, completions=[pb.Completion(token_ids=[7])]))

    def close(self) -> None:
        self.heartbeat.stop()
        self.server.stop(0)


def routed_targets(router: ServerProcess) -> int:
    """How many targets the router's own view of the registry holds (its /capacity route)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/capacity", timeout=5) as reply:
        return sum(len(pool.get("targets", [])) for pool in json.load(reply)["pools"])


def test_a_target_that_only_wrote_a_heartbeat_gets_no_prompts(pool, tmp_path):
    mode, p = pool
    url = p["redis"].url
    anonymous = url.replace(f":{p['redis'].password}@", "")
    # Without the password it cannot even register.
    assert not Heartbeat(anonymous, "target", "x", lambda: {"address": "x", "model": "m"}).beat()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(anonymous).hset("specpool:target:x", "model", "m")
    # With the password stolen: one impostor has a certificate from another CA naming target/alpha,
    # one a certificate from the cluster's CA that names someone else (client/mallory), claiming alpha.
    fakes = [FakeTarget(credentials(mode, "client", "mallory"), url, p["model"], "alpha")]
    if mode == "secure":
        fakes.append(FakeTarget(LocalCA.create(tmp_path / "other").client("alpha"), url, p["model"], "alpha"))
    try:
        for fake in fakes:
            fake.heartbeat.start()
        registry = Registry(url)
        wait_for(lambda: len(registry.targets()) == 1 + len(fakes), timeout_s=10)
        registry.close()
        # And the router's view holds them too: 20 two-token requests can finish within one of its
        # snapshot periods, and a test that routed them all on a stale view would prove nothing.
        wait_for(lambda: routed_targets(p["router"]) == 1 + len(fakes), timeout_s=10)
        stub, metadata = router_stub(mode, p["router"], "alpha")

        def one(i: int) -> pb.GenerateResult:
            request = pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=[1, 2, i]), max_tokens=2, ignore_eos=True)
            return generate_result(stub, request, metadata=metadata, timeout=60)

        with ThreadPoolExecutor(4) as workers:
            results = list(workers.map(one, range(20)))
        stolen = sum(len(f.prompts) for f in fakes)
        if mode == "insecure":
            assert stolen > 0  # the impostor's max_batch 1000 drew the router's traffic
            return
        assert stolen == 0
        assert all(len(r.completions[0].token_ids) == 2 for r in results)  # the real target served all 20
    finally:
        for fake in fakes:
            fake.close()


def test_no_secret_is_in_a_process_arguments(pool):
    """`ps` shows every process's arguments to every local user: no password or token goes there."""
    mode, p = pool
    secrets = [p["redis"].password, *(CA.token(t) for t in ("alpha", "mallory"))]
    for process in (p["router"].proc, p["target"].proc, p["redis"].proc):
        with open(f"/proc/{process.pid}/cmdline", "rb") as f:
            arguments = f.read().decode(errors="replace")
        assert not [s for s in secrets if s in arguments], arguments
    if mode == "insecure":  # chosen, and said so
        assert any("--insecure" in line and "WARNING" in line for line in p["router"].log_tail)
