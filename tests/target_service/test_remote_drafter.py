# Over 400 lines: the remote drafter's rounds, fallbacks and codec, on the same real messages.
"""The target's side of the Speculation API without processes: real messages through the codec, the
session bookkeeping and the fallback, and a real gRPC endpoint in this process serving the stream."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from specpool.common.speculation import sparse_q_from_pb
from specpool.engine.decoding import PACED_ROUNDS, Decoder, generate
from specpool.engine.drafters.ngram import NgramDrafter
from specpool.engine.method import Method
from specpool.engine.plan import SpeculationPlan
from specpool.engine.policy.acceptance import AcceptanceEstimate
from specpool.engine.policy.costs import StepCosts
from specpool.engine.policy.draft_length import Running
from specpool.engine.verification.sampling import SamplingParams
from specpool.target_service.draft_length import TargetDraftLength
from specpool.target_service.remote.codec import DraftRow, assemble, unusable
from specpool.target_service.remote.drafter import RemoteDrafter
from specpool.target_service.remote.fallback import Fallback
from specpool.target_service.remote.wire import resolved_round, rounds_request, sequence_round, session_spec
from specpool_client.v1 import speculation_pb2 as pb
from specpool_client.v1 import speculation_pb2_grpc, target_pb2
from tests.engine.test_decoding import PacedLength

VOCAB = 64
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10], [3, 4, 5, 6, 7, 8, 9, 10, 3, 4]]
NEW = 20
REMOTE = SpeculationPlan(Method.DRAFT_MODEL, remote=True)


class Recorder:
    """A SpeculationObserver that keeps what it was told."""

    def __init__(self):
        self.fallbacks: list[tuple[Fallback, str]] = []
        self.rounds = 0
        self.capacities: list[pb.GetCapacityResponse] = []

    def attached(self, capacity):
        self.capacities.append(capacity)

    def fell_back(self, reason, seq_ids):
        self.fallbacks += [(reason, s) for s in seq_ids]

    def round_trip(self, wait_s, draft_s):
        self.rounds += 1

    def cache_stats(self, seq_id, hits, lookups):
        pass

    @property
    def reasons(self) -> set[Fallback]:
        return {r for r, _ in self.fallbacks}


class Endpoint(speculation_pb2_grpc.SpeculationServiceServicer):
    """The other side of the stream: drafts the target's own greedy continuation (every draft is
    accepted), or what `drafts` makes of it; `fail_after` rounds, the stream breaks."""

    def __init__(self, truth: dict[str, list[int]], drafts=None, fail_after: int | None = None):
        self.truth = truth
        self.drafts = drafts or (lambda seq_id, tokens: pb.SequenceDrafts(request_id=seq_id, tokens=tokens))
        self.fail_after = fail_after
        self.contexts: dict[str, list[int]] = {}
        self.specs: list[pb.SessionSpec] = []
        self.asked: list[int] = []
        self.closed: list[str] = []
        self.rounds = 0

    def GetCapacity(self, request, context):
        return pb.GetCapacityResponse()

    def OpenTensorChannel(self, request, context):
        return pb.OpenTensorChannelResponse()  # no secret: the target drafts dense q locally

    def OpenSessions(self, request, context):
        for spec in request.sessions:
            self.contexts[spec.request_id] = list(spec.context)
            self.specs.append(spec)
        return pb.OpenSessionsResponse(sessions=[pb.OpenedSession(request_id=s.request_id, ok=True)
                                                 for s in request.sessions])

    def CloseSessions(self, request, context):
        self.closed += request.request_ids
        return pb.CloseSessionsResponse(closed=len(request.request_ids))

    def Rounds(self, requests, context):
        for request in requests:
            self.rounds += 1
            if self.fail_after is not None and self.rounds > self.fail_after:
                self.fail_after = None  # the next stream (a re-attach) is healthy
                context.abort(grpc.StatusCode.UNAVAILABLE, "endpoint restarting")
            reply = pb.RoundsResponse(round_id=request.round_id)
            for seq in request.sequences:
                context_ids = self.contexts[seq.request_id]
                context_ids.extend(seq.new_tokens)
                self.asked.append(seq.num_draft_tokens)
                n = seq.num_draft_tokens
                reply.sequences.append(self.drafts(seq.request_id, self.truth[seq.request_id][len(context_ids):][:n]))
            yield reply


@pytest.fixture
def ar(tiny_model) -> dict[str, list[int]]:
    """Each sequence's prompt and greedy continuation, by seq_id."""
    results = generate(tiny_model, PROMPTS, SamplingParams(), NEW, stop_ids=[])
    return {str(i): p + r.token_ids for i, (p, r) in enumerate(zip(PROMPTS, results))}


def serve(endpoint: Endpoint):
    server = grpc.server(ThreadPoolExecutor(8))
    speculation_pb2_grpc.add_SpeculationServiceServicer_to_server(endpoint, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def drafter_for(address: str | None, observer: Recorder) -> RemoteDrafter:
    drafter = RemoteDrafter("t1", "tiny", VOCAB, address, NgramDrafter(), observer, deadline_s=5.0,
                               reattach_s=0.05)
    if address:
        drafter.wait_attached(5.0)
    return drafter


def decode(model, drafter: RemoteDrafter, choice: SpeculationPlan | list[SpeculationPlan],
           draft_tokens: int = 3):
    """choice: every sequence's, or each one's."""
    choices = choice if isinstance(choice, list) else [choice] * len(PROMPTS)
    decoder = Decoder(model, len(PROMPTS), 128, drafter, TargetDraftLength(drafter, None, fixed=draft_tokens))
    results = []
    for i, prompt in enumerate(PROMPTS):
        results.append(decoder.add(str(i), prompt, SamplingParams(), NEW, stop_ids=[], plan=choices[i]))
    while decoder.has_work:
        decoder.step()
    return {str(i): p + r.token_ids for i, (p, r) in enumerate(zip(PROMPTS, results))}, results


# -- codec and vocabulary ------------------------------------------------------------------------


def test_a_choice_is_labelled_as_the_metrics_always_were():
    assert SpeculationPlan.of(None, has_endpoint=True) == REMOTE
    assert SpeculationPlan.of(None, has_endpoint=True).label == "draft_model"
    assert SpeculationPlan.of(Method.SSD, has_endpoint=True).label == "ssd"
    assert SpeculationPlan.of(Method.NGRAM, has_endpoint=True).label == "ngram"
    assert SpeculationPlan.of(Method.SSD, has_endpoint=False) == SpeculationPlan(Method.NGRAM, remote=False)
    assert SpeculationPlan.of(Method.SSD, has_endpoint=False).label == "ngram_local"
    assert SpeculationPlan.of(Method.NONE, has_endpoint=True).label == "none"


def test_a_session_spec_names_its_drafter_and_sends_no_seed():
    spec = session_spec("s", [1, 2], SpeculationPlan(Method.SSD, True),
                        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=42), push=True)
    assert spec.drafter == pb.DRAFTER_KIND_SSD and spec.push and list(spec.context) == [1, 2]
    assert spec.sampling.top_k == 5 and not spec.sampling.HasField("seed") and not spec.tree
    assert session_spec("t", [1], SpeculationPlan(Method.NGRAM, True, tree=True), SamplingParams(), False).tree


def test_an_ssd_round_resolved_on_the_target_says_how():
    hit = resolved_round("s", [3, 4], [7, 8], table_hit=True, num_features=2)
    assert hit.resolution == pb.ROUND_RESOLUTION_TABLE_HIT and hit.num_draft_tokens == 2 and not hit.drafts_in_use
    assert list(hit.new_tokens) == [3, 4] and hit.num_features == 2
    local = resolved_round("s", [3], [7, 8, 9], table_hit=False)
    assert local.resolution == pb.ROUND_RESOLUTION_LOCAL_DRAFTS and local.num_draft_tokens == 0
    assert list(local.drafts_in_use) == [7, 8, 9]
    asked = sequence_round("s", [1], 4)
    assert asked.resolution == pb.ROUND_RESOLUTION_UNSPECIFIED and asked.num_draft_tokens == 4
    request = rounds_request("t1", 5, [asked, hit], feature_dim=16)
    assert request.tenant == "t1" and request.round_id == 5 and request.feature_dim == 16
    assert [r.num_draft_tokens for r in request.sequences] == [4, 2]


def test_a_q_row_mismatched_to_its_tokens_is_refused():
    three_rows = pb.SparseDistribution(k=2, ids=[1, 2] * 3, probs=[0.5, 0.5] * 3)
    assert sparse_q_from_pb(three_rows, rows=2) is None
    assert unusable([4, 5], None, asked=3, q_sent=True, vocab_size=VOCAB) == "its draft distribution is malformed"
    ids, probs = sparse_q_from_pb(three_rows, rows=3)
    assert unusable([4, 5, 6], (ids, probs), asked=3, q_sent=True, vocab_size=VOCAB) == ""
    assert "shape" in unusable([4, 5], torch.zeros(3, VOCAB), 3, True, VOCAB)
    assert "vocabulary" in unusable([4, VOCAB], None, 3, False, VOCAB)
    assert "were asked" in unusable([4, 5, 6, 7], None, 3, False, VOCAB)


def test_trees_are_checked_and_verified_as_trees_unless_a_q_row_shares_their_group():
    assert unusable([4, 5, 6], None, 3, False, VOCAB, parents=[-1, -1, 0]) == ""
    assert "malformed token tree" in unusable([4, 4], None, 3, False, VOCAB, parents=[-1, -1])
    assert "malformed token tree" in unusable([4, 5], None, 3, False, VOCAB, parents=[-1])
    assert "deterministic" in unusable([4], torch.ones(1, VOCAB) / VOCAB, 3, True, VOCAB, parents=[-1])
    tree = DraftRow([4, 5, 6], parents=[-1, -1, 0])
    sampled = SamplingParams(temperature=1.0, top_k=2)
    both = assemble([tree, DraftRow([7, 8])], sampled)
    assert both.tokens == [[4, 5, 6], [7, 8]] and both.parents == [[-1, -1, 0], [-1, 0]]
    # Beside a row with q the tree rule cannot run: the tree sends its first-child chain, a point mass.
    q_row = DraftRow([7], (torch.tensor([[7, 8]]), torch.tensor([[0.6, 0.4]])))
    mixed = assemble([tree, q_row], sampled)
    assert mixed.parents is None and mixed.tokens == [[4, 6], [7]]
    assert mixed.topk_probs[0, :2, 0].tolist() == [1.0, 1.0]


# -- draft length: the policy owns the caps ----------------------------------------------------


def test_the_draft_length_applies_each_requests_cap():
    """Each sequence's plan travels with it (Running.plan): the length reads it there. (A plan of no
    speculation drafts nothing whatever the length says: the decoder's rule, tests/engine/test_decoding.py.)"""
    drafter = drafter_for(None, Recorder())
    plans = {"a": REMOTE, "b": SpeculationPlan(Method.NGRAM, True, max_draft_tokens=2)}
    length = TargetDraftLength(drafter, None, fixed=4)
    batch = [Running(s, 0, 10, plan) for s, plan in plans.items()]
    assert length.max_draft == 4
    assert length.lengths(batch, AcceptanceEstimate()) == [4, 2]


def test_no_batch_size_speculates_where_the_measured_costs_predict_a_loss():
    """A target that turns compute-bound at batch 16, a draft model a third of its step: SSD with no
    hits, or any remote drafter behind a slow wire, must not speculate there; SSD that always hits
    drafts like a free drafter."""
    target = StepCosts((1, 16), (0, 4, 8), ((0.03, 0.031, 0.033), (0.04, 0.15, 0.30)))
    drafter = drafter_for(None, Recorder())
    drafter.capacity = pb.GetCapacityResponse(models=[pb.ModelDrafters(target_model="tiny", draft_step_costs=pb.StepCostTable(
        batch_sizes=[1, 16], draft_lens=[0, 8], seconds=[0.01, 0.012, 0.02, 0.03]))])
    length = TargetDraftLength(drafter, target)
    acceptance = AcceptanceEstimate(prior_alpha=0.6, prior_weight=1e9)  # fixed at alpha 0.6

    def chosen(method: Method, batch: int) -> int:
        plan = SpeculationPlan(method, True)
        return length.lengths([Running(f"{method}{i}", 0, 100, plan) for i in range(batch)], acceptance)[0]

    drafter.ssd_hit_ratio.value = 1.0
    assert chosen(Method.SSD, 1) == length.free.choose(1, 0.6) > 0
    drafter.ssd_hit_ratio.value = 0.0
    assert chosen(Method.SSD, 16) == chosen(Method.DRAFT_MODEL, 16) == 0
    assert chosen(Method.NGRAM, 1) > 0
    drafter.wire_s.value = 0.05  # a round trip longer than a target step
    assert chosen(Method.NGRAM, 1) == chosen(Method.DRAFT_MODEL, 1) == 0
    drafter.ssd_hit_ratio.value = 1.0  # pushed hits never wait for the wire
    assert chosen(Method.SSD, 1) == length.free.choose(1, 0.6) > 0


# -- failing open ---------------------------------------------------------------------------------


def test_a_dead_endpoint_makes_sequences_draft_locally_with_the_ar_tokens(tiny_model, ar):
    observer = Recorder()
    drafter = drafter_for("127.0.0.1:1", observer)  # nothing listens there
    try:
        tokens, results = decode(tiny_model, drafter, REMOTE)
    finally:
        drafter.close()
    assert tokens == ar
    assert observer.reasons == {Fallback.ENDPOINT_UNAVAILABLE} and observer.rounds == 0
    assert {s for _, s in observer.fallbacks} == set(ar)
    assert all(r.drafted_tokens > 0 for r in results)


def test_beside_a_plain_sequence_the_ones_a_dead_endpoint_fails_decode_plainly(tiny_model, ar):
    """Issue 38: their local drafts would be verified in the plain row's forward, wider than its own;
    alone (the test above) they draft locally."""
    drafter = drafter_for("127.0.0.1:1", Recorder())
    try:
        tokens, results = decode(tiny_model, drafter, [REMOTE, REMOTE, SpeculationPlan(Method.NONE, False)])
    finally:
        drafter.close()
    assert tokens == ar
    assert [r.drafted_tokens for r in results] == [0, 0, 0]


def test_beside_a_plain_sequence_no_step_waits_for_a_session_to_open(tiny_model, ar):
    """An open waits up to the configured deadline on the step, so a new sequence's first round can
    draft remotely; beside a plain sequence it waits for nothing (the plain row would wait with it).
    Here the endpoint never answers OpenSessions and the deadline is a minute: the decode still ends."""
    class HungOpens(Endpoint):
        def __init__(self, truth):
            super().__init__(truth)
            self.release = threading.Event()

        def OpenSessions(self, request, context):
            self.release.wait(60)
            return super().OpenSessions(request, context)

    endpoint = HungOpens(ar)
    server, address = serve(endpoint)
    drafter = RemoteDrafter("t1", "tiny", VOCAB, address, NgramDrafter(), Recorder(), deadline_s=60.0)
    try:
        assert drafter.wait_attached(5.0)
        with ThreadPoolExecutor(1) as pool:
            decoding = pool.submit(decode, tiny_model, drafter, [REMOTE, REMOTE, SpeculationPlan(Method.NONE, False)])
            try:
                tokens, results = decoding.result(timeout=20)
            finally:
                endpoint.release.set()
    finally:
        drafter.close()
        server.stop(0)
    assert tokens == ar
    assert [r.drafted_tokens for r in results] == [0, 0, 0]


def test_without_an_endpoint_configured_the_reason_says_so(tiny_model, ar):
    observer = Recorder()
    tokens, _ = decode(tiny_model, drafter_for(None, observer), REMOTE)
    assert tokens == ar and observer.reasons == {Fallback.NO_ENDPOINT}


# -- a real stream to an in-process endpoint ----------------------------------------------------


def test_an_endpoints_drafts_are_verified_and_its_sessions_closed(tiny_model, ar):
    endpoint, observer = Endpoint(ar), Recorder()
    server, address = serve(endpoint)
    drafter = drafter_for(address, observer)
    try:
        tokens, results = decode(tiny_model, drafter, SpeculationPlan(Method.DRAFT_MODEL, True, max_draft_tokens=2))
        end = time.monotonic() + 5.0  # CloseSessions is fire and forget
        while len(endpoint.closed) < len(ar) and time.monotonic() < end:
            time.sleep(0.01)
    finally:
        drafter.close()
        server.stop(0)
    assert tokens == ar
    assert observer.capacities and observer.rounds > 0 and not observer.fallbacks
    assert all(r.accepted_tokens == r.drafted_tokens > 0 for r in results)  # the endpoint's drafts were used
    assert max(endpoint.asked) == 2  # the request's cap, applied by the draft length
    assert {s.drafter for s in endpoint.specs} == {pb.DRAFTER_KIND_DRAFT_MODEL}
    assert sorted(endpoint.closed) == sorted(ar)


def test_a_plan_slower_than_plain_decoding_leaves_the_endpoint_then_speculation(tiny_model, ar):
    """Plain rounds said to take 1 ns, drafts always wrong: each sequence's endpoint plan falls to the
    target's n-gram index after its first round and PACED_ROUNDS more (its endpoint session closed then,
    not at its end), and that plan to none at most as many rounds later. Output equals AR."""
    asked: dict[str, int] = {}

    def counted(seq_id, tokens):
        asked[seq_id] = asked.get(seq_id, 0) + 1
        return pb.SequenceDrafts(request_id=seq_id, tokens=[(t + 1) % VOCAB for t in tokens])

    endpoint = Endpoint(ar, drafts=counted)
    server, address = serve(endpoint)
    drafter = drafter_for(address, Recorder())
    decoder = Decoder(tiny_model, len(PROMPTS), 128, drafter, PacedLength(3, plain_s=1e-9))
    try:
        # Long enough for both plans to be judged (the n-gram index drafts the tiny target's loops well).
        results = [decoder.add(str(i), p, SamplingParams(), 3 * NEW, stop_ids=[], plan=REMOTE)
                   for i, p in enumerate(PROMPTS)]
        judged = PACED_ROUNDS + 1
        while decoder.has_work and any(r.target_steps < judged + 1 for r in results):
            decoder.step()
        end = time.monotonic() + 5.0  # CloseSessions is fire and forget
        while len(endpoint.closed) < len(PROMPTS) and time.monotonic() < end:
            time.sleep(0.01)
        assert sorted(endpoint.closed) == sorted(ar), "closed on leaving the endpoint, while still running"
        while decoder.has_work:
            decoder.step()
    finally:
        drafter.close()
        server.stop(0)
    longer = generate(tiny_model, PROMPTS, SamplingParams(), 3 * NEW, stop_ids=[])
    assert [r.token_ids for r in results] == [r.token_ids for r in longer]
    assert asked == {str(i): judged for i in range(len(PROMPTS))}, "the endpoint drafted only the judged rounds"
    for r in results:
        assert r.plan_drops == 2 and all(drafted == 0 for drafted, _ in r.rounds[2 * judged:]), r.rounds
        assert all(drafted > 0 for drafted, _ in r.rounds[:judged]), "drafted on the endpoint first"


def test_unusable_replies_fall_back_for_that_round_only(tiny_model, ar):
    def bad(seq_id, tokens):
        if seq_id == "0":  # out of the vocabulary
            return pb.SequenceDrafts(request_id=seq_id, tokens=[VOCAB + 1] * len(tokens))
        if seq_id == "1":  # a q whose rows do not match its tokens
            return pb.SequenceDrafts(request_id=seq_id, tokens=tokens,
                                     sparse=pb.SparseDistribution(k=1, ids=[1], probs=[1.0] * 7))
        return pb.SequenceDrafts(request_id=seq_id, tokens=tokens)

    observer = Recorder()
    server, address = serve(Endpoint(ar, drafts=bad))
    drafter = drafter_for(address, observer)
    try:
        tokens, results = decode(tiny_model, drafter, REMOTE)
    finally:
        drafter.close()
        server.stop(0)
    assert tokens == ar
    assert observer.reasons == {Fallback.BAD_REPLY}
    assert {s for _, s in observer.fallbacks} == {"0", "1"}
    assert results[2].accepted_tokens == results[2].drafted_tokens > 0


def test_a_stream_that_breaks_falls_back_then_reattaches(tiny_model, ar):
    observer = Recorder()
    server, address = serve(Endpoint(ar, fail_after=2))
    drafter = drafter_for(address, observer)
    try:
        tokens, _ = decode(tiny_model, drafter, REMOTE)
        assert tokens == ar
        assert Fallback.ENDPOINT_FAILED in observer.reasons
        # Back on a new connection: the attach loop replaces the broken one.
        assert drafter.wait_attached(5.0) and len(observer.capacities) == 2
    finally:
        drafter.close()
        server.stop(0)


def test_the_target_api_enum_reaches_the_endpoint_as_its_drafter():
    from specpool.common.speculation import method_from_pb

    method = method_from_pb(target_pb2.SPECULATION_METHOD_SSD)
    spec = session_spec("s", [1], SpeculationPlan.of(method, has_endpoint=True), SamplingParams(), push=False)
    assert spec.drafter == pb.DRAFTER_KIND_SSD
