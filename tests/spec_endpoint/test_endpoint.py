# Over 400 lines: the endpoint domain API end to end, each test on the same tiny real models.
"""The pooled speculation endpoint on tiny real models: batching across tenants, q transports,
acceptance counting, leases, capacity, and validation through a real gRPC server."""

from __future__ import annotations

import argparse
import queue
import time
from pathlib import Path

import grpc
import pytest
import torch

from specpool.common import serving
from specpool.common.tensor_channel import LoopbackChannel
from specpool.engine.drafters.model import ModelDrafter
from specpool.engine.method import Method
from specpool.engine.plan import TreeShape
from specpool.engine.runtime.config import tiny_config
from specpool.engine.runtime.gguf_loader import load_gguf, save_gguf
from specpool.engine.runtime.model import Llama, random_weights
from specpool.engine.verification import token_tree
from specpool.engine.verification.sampling import SamplingParams
from specpool.spec_endpoint.batcher import NO_CHANNEL, SESSION_NOT_FOUND
from specpool.spec_endpoint.drafters import TREE_SHAPE, DrafterSpec, HostedDrafters, LoadOptions
from specpool.spec_endpoint.endpoint import Endpoint, EndpointConfig
from specpool.spec_endpoint.messages import (
    OpenRequest,
    Round,
    RoundResult,
    SequenceRound,
    SessionSpec,
    Transport,
)
from specpool.spec_endpoint.server import add_arguments, add_to_server, capacity_route
from specpool.training.distill import DraftLM, export
from specpool_client.v1 import speculation_pb2 as pb
from specpool_client.v1 import speculation_pb2_grpc as pb_grpc
from specpool_client.v1 import target_pb2

V = 64
MODEL = "tiny"
GREEDY = SamplingParams()
CONTEXTS = [[5, 9, 11, 3, 7], [8, 8, 2, 40, 41, 42, 17]]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path, Path]:
    """-> (target GGUF, draft checkpoint dir, step-cost cache dir)."""
    root = tmp_path_factory.mktemp("spec_endpoint")
    cfg = tiny_config(vocab_size=V)
    weights = random_weights(cfg, seed=3)
    gguf = save_gguf(root / "tiny.gguf", cfg, weights)
    export(DraftLM.from_target(cfg, weights, [0], output_ids=torch.arange(V)), root / "draft", "tiny.gguf")
    return gguf, root / "draft", root / "step-costs"


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_endpoint(files, max_sessions: int = 4, clock=time.monotonic, **options) -> Endpoint:
    gguf, draft, costs = files
    drafters = HostedDrafters.load(
        [DrafterSpec(MODEL, gguf, draft)],
        LoadOptions(max_sessions=max_sessions, max_len=128, device=torch.device("cpu"), step_cost_dir=costs, **options),
    )
    return Endpoint(drafters, EndpointConfig(max_sessions=max_sessions, lease_s=30.0, endpoint_id="test"), clock=clock)


def open_one(endpoint, tenant, request_id, context, params=GREEDY, **kw):
    spec = SessionSpec(request_id, tuple(context), params, **kw)
    [result] = endpoint.open_sessions(OpenRequest(tenant, MODEL, 0.0, (spec,)))
    return result


def round_trip(endpoint, stream, tenant, *seqs, round_id=1) -> RoundResult:
    """Submit one round and run one engine step (no engine thread)."""
    endpoint.submit(stream, Round(tenant, round_id, tuple(SequenceRound(r, tuple(t), n) for r, t, n in seqs)))
    assert endpoint.batcher.run_once()
    return stream.outbound.get_nowait()


def test_two_tenants_rounds_share_one_draft_batch(files):
    endpoint = make_endpoint(files)
    assert open_one(endpoint, "a", "r1", CONTEXTS[0]).ok
    assert open_one(endpoint, "b", "r1", CONTEXTS[1]).ok  # same request id, other tenant: its own session
    sa, sb = endpoint.open_stream(), endpoint.open_stream()
    endpoint.submit(sa, Round("a", 7, (SequenceRound("r1", (), 3),)))
    endpoint.submit(sb, Round("b", 9, (SequenceRound("r1", (), 3),)))
    assert endpoint.batcher.run_once()
    ra, rb = sa.outbound.get_nowait(), sb.outbound.get_nowait()
    assert (ra.round_id, rb.round_id) == (7, 9)
    assert len(ra.sequences[0].tokens) == 3 and len(rb.sequences[0].tokens) == 3
    m = endpoint.metrics
    assert m.value("specpool_spec_draft_batches_total") == 1
    assert m.value("specpool_spec_shared_batches_total") == 1
    assert m.value("specpool_spec_batch_tenants_sum") == 2
    assert m.value("specpool_spec_rounds_total", {"tenant": "a"}) == 1
    assert m.value("specpool_spec_drafted_tokens_total", {"tenant": "b", "model": MODEL}) == 3


def test_targets_batched_together_share_each_draft_forward_and_their_tokens_are_counted(files):
    """Two tenants' sequences drafted in one step run one forward per draft step between them (alone, each
    would run its own): draft forwards per target token is what pooling saves."""
    endpoint = make_endpoint(files)
    for tenant, context in zip("ab", CONTEXTS):
        assert open_one(endpoint, tenant, "r1", context).ok
    streams = {t: endpoint.open_stream() for t in "ab"}
    drafts = {t: None for t in "ab"}
    for _ in range(2):  # the second round reports the first draft accepted and a bonus token
        for tenant, stream in streams.items():
            tokens = () if drafts[tenant] is None else (drafts[tenant][0], 7)
            endpoint.submit(stream, Round(tenant, 1, (SequenceRound("r1", tokens, 3),)))
        assert endpoint.batcher.run_once()
        for tenant, stream in streams.items():
            drafts[tenant] = stream.outbound.get_nowait().sequences[0].tokens
            assert len(drafts[tenant]) == 3
    m = endpoint.metrics
    assert m.value("specpool_spec_draft_forwards_total", {"model": MODEL}) == 6  # 2 rounds x 3 steps, both tenants
    assert m.value("specpool_spec_target_tokens_total", {"model": MODEL}) == 4  # 2 per tenant in the second round


def test_greedy_drafts_equal_model_drafter_in_process_and_acceptance_is_counted(files):
    gguf, draft_dir, _ = files
    endpoint = make_endpoint(files)
    reference = ModelDrafter(
        Llama.from_draft_checkpoint(draft_dir, load_gguf(gguf, only={"embed"}).weights["embed"], dtype="bf16",
                                    device="cpu"),
        max_sequences=2, max_len=128,
    )
    for tenant, ctx in zip(("a", "b"), CONTEXTS, strict=True):
        open_one(endpoint, tenant, "x", ctx)
        reference.start(tenant, ctx)
    streams = {"a": endpoint.open_stream(), "b": endpoint.open_stream()}

    new = {"a": [], "b": []}
    for round_id in (1, 2):
        for tenant, stream in streams.items():
            endpoint.submit(stream, Round(tenant, round_id, (SequenceRound("x", tuple(new[tenant]), 4),)))
        endpoint.batcher.run_once()
        got = {t: s.outbound.get_nowait().sequences[0].tokens for t, s in streams.items()}
        for t in streams:
            if new[t]:
                reference.observe(t, new[t])
        want = reference.propose(["a", "b"], [4, 4], GREEDY, None).tokens
        assert [got["a"], got["b"]] == want
        # The target accepts two drafts of a, none of b, and emits one token of its own each.
        new = {"a": [*got["a"][:2], (got["a"][2] + 1) % V], "b": [(got["b"][0] + 1) % V]}

    endpoint.submit(streams["a"], Round("a", 3, (SequenceRound("x", tuple(new["a"]), 0),)))
    endpoint.submit(streams["b"], Round("b", 3, (SequenceRound("x", tuple(new["b"]), 0),)))
    endpoint.batcher.run_once()
    stats = {t.tenant: t for t in endpoint.capacity().tenants}
    assert (stats["a"].drafted_tokens, stats["a"].accepted_tokens) == (8, 4)
    assert (stats["b"].drafted_tokens, stats["b"].accepted_tokens) == (8, 0)
    assert endpoint.metrics.value("specpool_spec_accepted_tokens_total", {"tenant": "a", "model": MODEL}) == 4


def test_a_session_named_twice_in_one_step_waits_for_the_next_step(files):
    endpoint = make_endpoint(files)
    open_one(endpoint, "a", "x", CONTEXTS[0])
    open_one(endpoint, "a", "y", CONTEXTS[1])
    stream, other = endpoint.open_stream(), endpoint.open_stream()
    endpoint.submit(stream, Round("a", 1, (SequenceRound("x", (), 2),)))
    endpoint.submit(stream, Round("a", 2, (SequenceRound("x", (3,), 2),)))
    endpoint.submit(other, Round("a", 3, (SequenceRound("y", (), 2),)))
    endpoint.end_stream(stream)
    assert endpoint.batcher.run_once()  # rounds 1 and 3; round 2 and the stream's end wait
    assert stream.outbound.get_nowait().round_id == 1 and other.outbound.get_nowait().round_id == 3
    assert stream.outbound.empty()
    assert endpoint.batcher.run_once()
    second = stream.outbound.get_nowait()
    assert second.round_id == 2 and len(second.sequences[0].tokens) == 2
    assert stream.outbound.get_nowait() is None  # the stream ends after its last round


def test_sparse_q_pairs_describe_the_sampled_drafts(files):
    endpoint = make_endpoint(files)
    open_one(endpoint, "a", "s", CONTEXTS[0], SamplingParams(temperature=0.9, top_k=5))
    result = round_trip(endpoint, endpoint.open_stream(), "a", ("s", [], 4))
    seq = result.sequences[0]
    assert not seq.error and not seq.dense and result.dense_rows == 0
    assert seq.sparse_k == 5 and len(seq.sparse_ids) == len(seq.sparse_probs) == 4 * 5
    for j, token in enumerate(seq.tokens):
        ids, probs = seq.sparse_ids[5 * j : 5 * j + 5], seq.sparse_probs[5 * j : 5 * j + 5]
        assert token in ids and all(0 <= i < V for i in ids)
        assert sum(probs) == pytest.approx(1.0, abs=1e-5)


def test_dense_q_arrives_on_the_tenant_channel(files):
    endpoint = make_endpoint(files)
    open_one(endpoint, "a", "d1", CONTEXTS[0], SamplingParams(temperature=0.8))  # no top-k: dense
    open_one(endpoint, "a", "d2", CONTEXTS[1], SamplingParams(temperature=0.8, top_k=4), transport=Transport.DENSE)
    stream = endpoint.open_stream()

    refused = round_trip(endpoint, stream, "a", ("d1", [], 3))
    assert refused.sequences[0].error == NO_CHANNEL

    ours, theirs = LoopbackChannel.pair()
    endpoint.channels.attach("a", ours)
    result = round_trip(endpoint, stream, "a", ("d1", [], 3), ("d2", [], 2), round_id=2)
    assert [s.dense for s in result.sequences] == [True, True]
    assert (result.dense_rows, result.vocab_size) == (5, V)
    rows = theirs.recv((5, V), torch.float32)
    assert torch.allclose(rows.sum(-1), torch.ones(5))  # (torch.testing.assert_close imports for 2 s)
    drafted = result.sequences[0].tokens + result.sequences[1].tokens
    assert all(rows[i, t] > 0 for i, t in enumerate(drafted))
    assert endpoint.metrics.value("specpool_spec_dense_bytes_total") == 5 * V * 4


def test_lease_expiry_frees_the_slot_and_capacity_answers_not_ok(files):
    clock = FakeClock()
    endpoint = make_endpoint(files, max_sessions=2, clock=clock)
    specs = tuple(SessionSpec(r, tuple(CONTEXTS[0]), GREEDY) for r in ("p", "q", "r"))
    results = endpoint.open_sessions(OpenRequest("a", MODEL, 5.0, specs))
    assert [r.ok for r in results] == [True, True, False]
    assert results[2].error.startswith("capacity: ")
    assert results[0].drafter is Method.DRAFT_MODEL

    stream = endpoint.open_stream()
    clock.now += 4
    round_trip(endpoint, stream, "a", ("p", [], 0))  # renews p's lease only
    clock.now += 2
    assert endpoint.expire_idle() == 1  # q
    assert endpoint.metrics.value("specpool_spec_active_sessions", {"tenant": "a"}) == 1
    assert open_one(endpoint, "a", "r", CONTEXTS[1]).ok  # q's KV slot is free again
    gone = round_trip(endpoint, stream, "a", ("q", [], 2), ("p", [], 2))
    assert gone.sequences[0].error == SESSION_NOT_FOUND
    assert not gone.sequences[1].error and len(gone.sequences[1].tokens) == 2
    assert endpoint.metrics.value("specpool_spec_sessions_expired_total") == 1
    assert endpoint.close_sessions("a", ["p", "r", "nope"]) == 2
    assert endpoint.capacity().active_sessions == 0


def test_ngram_sessions_draft_from_their_own_context(files):
    endpoint = make_endpoint(files)
    assert open_one(endpoint, "a", "n", [1, 2, 3, 4, 1, 2], drafter=Method.NGRAM).drafter is Method.NGRAM
    result = round_trip(endpoint, endpoint.open_stream(), "a", ("n", [], 2))
    assert result.sequences[0].tokens == [3, 4]


def test_tree_sessions_get_the_model_drafters_trees_and_count_a_sibling_path(files):
    gguf, draft_dir, _ = files
    endpoint = make_endpoint(files)
    assert open_one(endpoint, "a", "t", CONTEXTS[0], tree=True).ok
    assert open_one(endpoint, "a", "c", CONTEXTS[1]).ok  # a chain session beside it: its own propose call
    shape = endpoint.drafters.get(MODEL).tree_shape
    reference = ModelDrafter(
        Llama.from_draft_checkpoint(draft_dir, load_gguf(gguf, only={"embed"}).weights["embed"], dtype="bf16",
                                    device="cpu"),
        max_sequences=1, max_len=128, tree=shape,
    )
    reference.start("t", CONTEXTS[0])
    stream = endpoint.open_stream()
    # More nodes than the shape's depth: the tree must branch even where the draft is sure.
    first = round_trip(endpoint, stream, "a", ("t", [], 12), ("c", [], 3))
    tree, chain = first.sequences
    want = reference.propose(["t"], [12], GREEDY, None)
    assert (tree.tokens, tree.parents) == (want.tokens[0], want.parents[0])
    token_tree.check_tree(tree.tokens, tree.parents)
    assert not token_tree.is_chain(tree.parents), "the tree never branched"
    assert len(chain.tokens) == 3 and chain.parents == []
    assert endpoint.metrics.value("specpool_spec_draft_batches_total") == 2

    # The target accepts the second child of the root and that node's first child, then a token of its own.
    second = next(i for i, p in enumerate(tree.parents) if p == -1 and i > 0)
    child = next((i for i, p in enumerate(tree.parents) if p == second), None)
    path = [second] if child is None else [second, child]
    emitted = [tree.tokens[i] for i in path]
    leaf = path[-1]
    taken = {tree.tokens[i] for i, p in enumerate(tree.parents) if p == leaf}
    emitted.append(next(t for t in range(V) if t not in taken))
    reference.observe("t", emitted)
    again = round_trip(endpoint, stream, "a", ("t", emitted, 12), round_id=2).sequences[0]
    want = reference.propose(["t"], [12], GREEDY, None)
    assert (again.tokens, again.parents) == (want.tokens[0], want.parents[0])
    stats = {t.tenant: t for t in endpoint.capacity().tenants}
    assert stats["a"].accepted_tokens == len(path)


def test_sampled_tree_sessions_need_no_tensor_channel(files):
    endpoint = make_endpoint(files)
    dense_sampler = SamplingParams(temperature=1.0)  # a chain session would send dense q on the channel
    assert open_one(endpoint, "a", "t", CONTEXTS[0], dense_sampler, tree=True).ok
    out = round_trip(endpoint, endpoint.open_stream(), "a", ("t", [], 4)).sequences[0]
    assert out.error == "" and not out.dense and len(out.tokens) == 4 and len(out.parents) == 4


def test_a_tree_session_is_refused_for_a_chain_only_drafter(files):
    endpoint = make_endpoint(files)
    result = open_one(endpoint, "a", "s", CONTEXTS[0], drafter=Method.SSD, tree=True)
    assert not result.ok and result.error.startswith("sessions[0].tree: the ssd drafter proposes chains only")
    assert endpoint.capacity().active_sessions == 0


def test_ngram_tree_sessions_merge_every_continuation(files):
    endpoint = make_endpoint(files)
    context = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 7, 1, 2]  # after "1 2": "3 4", "5 6", "3 7"
    assert open_one(endpoint, "a", "n", context, drafter=Method.NGRAM, tree=True).ok
    result = round_trip(endpoint, endpoint.open_stream(), "a", ("n", [], 4)).sequences[0]
    # "3" follows twice, so it is the first child, with both of its continuations; then "5".
    assert (result.tokens, result.parents) == ([3, 5, 7, 4], [-1, -1, 0, 0])


SECRET = [50, 51, 52, 53, 54, 55, 56, 57]  # a tenant's text: after "50 51" comes "52 53 ..."


def test_ngram_sessions_draft_from_their_tenants_earlier_requests_and_never_anothers(files):
    endpoint = make_endpoint(files, max_sessions=8, suffix_shared=frozenset({"c", "d"}))
    stream = endpoint.open_stream()
    for tenant in ("a", "c"):  # each writes SECRET into its store, through a request that ends
        assert open_one(endpoint, tenant, "first", [9, 9, *SECRET[:4]], drafter=Method.NGRAM).ok
        round_trip(endpoint, stream, tenant, ("first", SECRET[4:], 0))
        assert endpoint.close_sessions(tenant, ["first"]) == 1

    def drafts(tenant: str, tree: bool = False) -> list[int]:
        assert open_one(endpoint, tenant, "later", [7, 50, 51], drafter=Method.NGRAM, tree=tree).ok
        return round_trip(endpoint, stream, tenant, ("later", [], 4)).sequences[0].tokens

    assert drafts("a") == [52, 53, 54, 55]  # its own earlier request: nothing of it is in this context
    assert drafts("a", tree=True) == [52, 53, 54, 55]
    assert drafts("b") == []  # another tenant's text never shapes its drafts
    assert drafts("d") == [52, 53, 54, 55]  # c and d opted in to share: d drafts from c's text
    assert drafts("e") == []
    # Stores: a, b, e and the shared one; their tokens: the two first requests' 10, five later ones' 3.
    assert endpoint.metrics.value("specpool_spec_suffix_stores") == 4
    assert endpoint.metrics.value("specpool_spec_suffix_store_tokens") == 2 * 10 + 5 * 3


def test_ssd_rounds_that_failed_every_sessions_prespeculation_are_answered_per_sequence(files):
    """Each of these made SSD pre-speculation raise (found fuzzing the endpoint, tests/cluster/test_fuzz.py),
    which lost the step's pre-speculation for every SSD session, other tenants' too. (Outcomes the SSD
    drafter itself mishandled are in tests/engine/drafters/test_ssd.py.)"""
    endpoint = make_endpoint(files)  # max_len 128
    stream = endpoint.open_stream()

    def step(*seqs: SequenceRound) -> list:
        endpoint.submit(stream, Round("a", 1, seqs))
        assert endpoint.batcher.run_once()
        replies = []
        while not stream.outbound.empty():
            replies += stream.outbound.get_nowait().sequences  # pushed tables carry none
        return replies

    assert open_one(endpoint, "a", "s", [1, 2, 3] * 3, drafter=Method.SSD, push=True).ok
    assert open_one(endpoint, "a", "long", [1, 2, 3, 4] * 30, drafter=Method.SSD, push=True).ok
    step(SequenceRound("s", (), 3), SequenceRound("long", (), 8))
    # "long" holds 121 tokens and 8 drafts: its forks run past max_len (the SSD cache had no room for them).
    step(SequenceRound("s", (4,), 3, "local_drafts", (5,) * 4), SequenceRound("long", (9,), 8))
    [empty] = step(SequenceRound("s", (), 3, "local_drafts", (5,) * 4))
    assert empty.error.startswith("sequences[0].new_tokens: empty, but local drafts follow"), empty.error
    [bad] = step(SequenceRound("long", (6,), 3, "local_drafts", (V,)))
    assert bad.error.startswith(f"sequences[0].drafts_in_use: token id {V} outside the vocabulary"), bad.error
    assert endpoint.metrics.value("specpool_spec_drafted_tokens_total", {"tenant": "a", "model": MODEL}) > 0


# -- through gRPC ------------------------------------------------------------------------------


@pytest.fixture
def served(files):
    endpoint = make_endpoint(files)
    server, port = serving.build_server(0, host="127.0.0.1")
    add_to_server(server, endpoint)
    server.start()
    endpoint.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield endpoint, pb_grpc.SpeculationServiceStub(channel)
    channel.close()
    endpoint.stop()
    server.stop(None)


class RoundsClient:
    """One Rounds stream: send() queues a request, recv() waits for the next reply."""

    def __init__(self, stub):
        self._requests: queue.Queue = queue.Queue()
        self._replies = stub.Rounds(iter(self._requests.get, None), timeout=20)

    def send(self, tenant, round_id, *seqs, resolution=pb.ROUND_RESOLUTION_UNSPECIFIED):
        self._requests.put(pb.RoundsRequest(tenant=tenant, round_id=round_id, sequences=[
            pb.SequenceRound(request_id=r, new_tokens=t, num_draft_tokens=n, resolution=resolution) for r, t, n in seqs
        ]))

    def recv(self) -> pb.RoundsResponse:
        return next(self._replies)

    def close(self):
        self._requests.put(None)


def grpc_open(stub, tenant, request_id, context, model=MODEL, **sampling):
    return stub.OpenSessions(pb.OpenSessionsRequest(tenant=tenant, target_model=model, sessions=[
        pb.SessionSpec(request_id=request_id, context=context, sampling=target_pb2.SamplingParams(**sampling))
    ]), timeout=10)


def test_grpc_two_concurrent_streams_share_a_batch(served):
    endpoint, stub = served
    for tenant in ("a", "b"):
        assert grpc_open(stub, tenant, "x", CONTEXTS[0]).sessions[0].ok
    clients = {t: RoundsClient(stub) for t in ("a", "b")}
    with endpoint.lock:  # hold the engine between steps until both rounds are queued
        for tenant, client in clients.items():
            client.send(tenant, 1, ("x", [], 3))
        deadline = time.monotonic() + 5
        while endpoint.batcher.submitted < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
    replies = {t: c.recv() for t, c in clients.items()}
    for reply in replies.values():
        assert reply.round_id == 1 and len(reply.sequences[0].tokens) == 3 and not reply.sequences[0].error
    assert replies["a"].sequences[0].tokens == replies["b"].sequences[0].tokens  # same context, greedy
    assert endpoint.metrics.value("specpool_spec_shared_batches_total") == 1

    capacity = stub.GetCapacity(pb.GetCapacityRequest(), timeout=10)
    assert capacity.active_sessions == 2 and capacity.endpoint_id == "test"
    [model] = capacity.models
    assert model.target_model == MODEL
    assert list(model.drafters) == [pb.DRAFTER_KIND_DRAFT_MODEL, pb.DRAFTER_KIND_SSD, pb.DRAFTER_KIND_NGRAM]
    table = model.draft_step_costs
    assert len(table.seconds) == len(table.batch_sizes) * len(table.draft_lens) > 0
    assert {t.tenant: t.drafted_tokens for t in capacity.tenants} == {"a": 3, "b": 3}
    # Over HTTP, /capacity lists them to operators (the metrics token) alone.
    route = capacity_route(endpoint)
    assert [t["tenant"] for t in route(True)["tenants"]] == ["a", "b"] and route(False)["tenants"] == []
    assert route(False)["activeSessions"] == 2
    for client in clients.values():
        client.close()


INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "request_kw, spec_kw, sampling_kw, code, prefix",
    [
        ({"tenant": ""}, {}, {}, INVALID, "tenant: "),
        ({"target_model": "nope"}, {}, {}, grpc.StatusCode.NOT_FOUND,
         "target_model: no drafters for 'nope'; this endpoint serves ['tiny']"),
        ({}, {"request_id": ""}, {}, INVALID, "sessions[0].request_id: "),
        ({}, {"context": []}, {}, INVALID, "sessions[0].context: "),
        ({}, {}, {"temperature": -0.5}, INVALID, "sessions[0].sampling.temperature: "),
        ({}, {}, {"top_p": 1.5}, INVALID, "sessions[0].sampling.top_p: "),
        ({}, {}, {"top_k": -1}, INVALID, "sessions[0].sampling.top_k: "),
        ({}, {}, {"min_p": 1.5}, INVALID, "sessions[0].sampling.min_p: "),
        ({"lease_s": -1}, {}, {}, INVALID, "lease_s: "),
    ],
)
def test_grpc_open_sessions_validation(served, request_kw, spec_kw, sampling_kw, code, prefix):
    _, stub = served
    request = pb.OpenSessionsRequest(**({"tenant": "a", "target_model": MODEL} | request_kw), sessions=[
        pb.SessionSpec(**({"request_id": "r", "context": [1, 2, 3]} | spec_kw),
                       sampling=target_pb2.SamplingParams(**sampling_kw))
    ])
    with pytest.raises(grpc.RpcError) as err:
        stub.OpenSessions(request, timeout=10)
    assert err.value.code() == code
    assert err.value.details().startswith(prefix), err.value.details()
    assert grpc_open(stub, "a", "ok", [1, 2, 3]).sessions[0].ok  # still serving


@pytest.mark.parametrize(("spec_kw", "sampling_kw", "error"), [
    ({"context": [1, 99999]}, {}, "sessions[0].context: token id 99999 outside the vocabulary [0, 64)"),
    ({}, {"top_k": 65}, "sessions[0].sampling.top_k: 65 exceeds the vocabulary size 64"),
])
def test_a_sessions_own_bad_input_refuses_that_session_only(served, spec_kw, sampling_kw, error):
    """Before, one session's top_k past the vocabulary refused the whole OpenSessions, every step, and the
    co-opened sequences of other requests lost speculation with it."""
    _, stub = served
    request = pb.OpenSessionsRequest(tenant="a", target_model=MODEL, sessions=[
        pb.SessionSpec(**({"request_id": "bad", "context": [1, 2, 3]} | spec_kw),
                       sampling=target_pb2.SamplingParams(**sampling_kw)),
        pb.SessionSpec(request_id="good", context=[1, 2, 3]),
    ])
    bad, good = stub.OpenSessions(request, timeout=10).sessions
    assert (bad.ok, bad.error) == (False, error)
    assert good.ok


def test_grpc_round_and_other_rpc_validation(served):
    _, stub = served
    assert grpc_open(stub, "a", "x", CONTEXTS[0]).sessions[0].ok
    client = RoundsClient(stub)
    client.send("a", 1, ("x", [], 40), ("ghost", [], 2))
    reply = client.recv()
    assert reply.sequences[0].error.startswith("sequences[0].num_draft_tokens: 40 outside [0, 32]")
    assert reply.sequences[1].error == SESSION_NOT_FOUND
    client.send("", 2, ("x", [], 2))
    with pytest.raises(grpc.RpcError) as err:
        client.recv()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("tenant: ")
    client.close()

    for call, request in [
        (stub.CloseSessions, pb.CloseSessionsRequest(tenant="")),
        (stub.OpenTensorChannel, pb.OpenTensorChannelRequest(tenant="")),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("tenant: ")

    # The session outlived the aborted stream; a new stream drafts for it.
    again = RoundsClient(stub)
    again.send("a", 3, ("x", [], 2))
    assert len(again.recv().sequences[0].tokens) == 2
    again.close()
    assert stub.CloseSessions(pb.CloseSessionsRequest(tenant="a", request_ids=["x"]), timeout=10).closed == 1


def test_an_unknown_round_resolution_is_refused_for_that_sequence(served):
    """Before, an unknown SequenceRound.resolution was read as ASK: the endpoint guessed at the target's state."""
    _, stub = served
    assert grpc_open(stub, "a", "odd", CONTEXTS[0]).sessions[0].ok
    client = RoundsClient(stub)
    client.send("a", 1, ("odd", [], 2), resolution=7)
    assert client.recv().sequences[0].error == "sequences[0].resolution: unknown value 7; session closed"
    client.send("a", 2, ("odd", [], 2))
    assert client.recv().sequences[0].error == SESSION_NOT_FOUND
    client.close()


def test_grpc_bytes_that_are_no_round_are_invalid_argument_without_a_traceback(files, caplog):
    """The Rounds reader thread met the interceptor's abort as a bare Exception: one traceback per stream."""
    endpoint = make_endpoint(files)
    server, port = serving.build_server(0, host="127.0.0.1")
    add_to_server(server, endpoint)
    server.start()
    endpoint.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            rounds = channel.stream_stream("/specpool.v1.SpeculationService/Rounds")
            with pytest.raises(grpc.RpcError) as err:
                list(rounds(iter([b"\xff\xff\xff\xff"]), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("request: ")
        assert "Traceback" not in caplog.text and "Rounds reader failed" not in caplog.text
    finally:
        endpoint.stop()
        server.stop(None)


def test_flags_and_drafter_specs():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--drafter", "a=/a.gguf", "--drafter", "b=/b.gguf,draft=/d"])
    assert (args.port, args.metrics_port, args.max_sessions, args.max_len, args.lease_s, args.channel_host) == (
        50060, 9460, 64, 2048, 30.0, "127.0.0.1")
    assert (args.max_sessions_per_tenant, args.max_lease_s, args.tenant_labels) == (0, 120.0, 64)
    assert (args.tree_shape, args.suffix_store_tokens, args.share_suffix_store) == (TREE_SHAPE, 50_000, [])
    assert parser.parse_args(["--tree-shape", "2,3,5"]).tree_shape == TreeShape(2, 3, 5)
    with pytest.raises(SystemExit):
        parser.parse_args(["--tree-shape", "2,0,5"])
    assert [DrafterSpec.parse(d).name for d in args.drafter] == ["a", "b"]
    spec = DrafterSpec.parse("m=/x/t.gguf,draft=/d,datastore=/s.npz")
    assert (spec.name, spec.target_gguf, spec.draft_dir, spec.datastore) == ("m", Path("/x/t.gguf"), Path("/d"),
                                                                             Path("/s.npz"))
    assert DrafterSpec.parse("/x/SmolLM2.Q4_1.gguf").name == "SmolLM2.Q4_1"
    assert DrafterSpec.parse("default") == DrafterSpec.default(), "so a list can name it beside others"
    with pytest.raises(ValueError, match="unknown option"):
        DrafterSpec.parse("m=/x.gguf,bogus=1")

