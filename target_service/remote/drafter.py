# Over 400 lines: a round's send, its collection and each fallback share one state (its parts live apart).
"""The remote drafter: the target's side of the Speculation API, a Drafter backed by a pooled endpoint,
failing open.

Every step, the drafts for all of this target's sequences come from the endpoint in one
RoundsRequest on one bidirectional stream; the same message reports what the previous round
emitted. When the endpoint is absent, late (past the per-step deadline) or failing, the affected
sequences are drafted by the next member of their chain (engine/drafters/chain.py), the target's own
n-gram index, for that round, losslessly: a deterministic draft is verified as a point mass. A background thread re-attaches to a returning endpoint, and sequences
then re-open their sessions with their full context.

The parts: connection (the stream), sessions (per-sequence bookkeeping), ssd_push (SSD's pushed tables
and hit counts), fallback (the
breaker and the reasons to draft locally), wire (the messages, and the replies read into rows), codec
(the drafts checked and assembled). What happens is told to one observer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import torch

from specpool.common.security import Security
from specpool.common.speculation import q_travels_dense
from specpool.common.tensor_channel import ChannelError
from specpool.engine.drafters.base import Capabilities, Drafter, DraftRequest, Drafts
from specpool.engine.drafters.chain import DraftChain
from specpool.engine.drafters.ngram import NgramDrafter
from specpool.engine.method import Method
from specpool.engine.plan import LOCAL_NGRAM, SpeculationPlan, TreeShape
from specpool.engine.policy.costs import StepCosts
from specpool.engine.verification.sampling import SamplingParams
from specpool.target_service.remote.codec import DraftRow, assemble, unusable
from specpool.target_service.remote.connection import Connection, Reply
from specpool.target_service.remote.fallback import DeadlineBreaker, Fallback
from specpool.target_service.remote.sessions import Session, Sessions
from specpool.target_service.remote.ssd_push import SsdPush
from specpool.target_service.remote.wire import (
    SequenceReply,
    draft_costs,
    read_round,
    resolved_round,
    rounds_request,
    sequence_round,
)
from specpool_client.v1 import speculation_pb2 as pb

log = logging.getLogger("specpool.target.speculation")

LOCAL_TREE = TreeShape(max_depth=8)  # the local n-gram drafter's trees (of its shape, only the depth matters)


class SpeculationObserver(Protocol):
    """What the drafter reports, on the step's thread unless said otherwise."""

    def attached(self, capacity: pb.GetCapacityResponse) -> None:
        """An endpoint was attached (on the drafter's attach thread)."""

    def fell_back(self, reason: Fallback, seq_ids: list[str]) -> None:
        """These sequences' round is drafted locally."""

    def round_trip(self, wait_s: float, draft_s: float) -> None:
        """A round was collected: how long the step waited, and the endpoint's drafting time in it."""

    def cache_stats(self, seq_id: str, hits: int, lookups: int) -> None:
        """An SSD sequence ended: its outcome-table hits and lookups."""


@dataclass
class RunningMean:
    """An exponentially weighted mean of a measured figure, `value` (the prior) until measured."""

    value: float
    weight: float = 0.05

    def add(self, x: float) -> None:
        self.value += self.weight * (x - self.value)


@dataclass(frozen=True)
class _InFlight:
    """A round on the wire: box is None when it needs no reply (every draft came from SSD tables)."""

    conn: Connection
    round_id: int
    box: object | None  # queue.Queue of the reply
    asked: dict[str, int]  # seq_id -> drafts asked, of the sequences the reply will draft
    resolved: dict[str, DraftRow]  # drafts already known (SSD table hits)


@dataclass(frozen=True, slots=True)
class _Outgoing:
    """A round built, not yet sent."""

    request: pb.RoundsRequest
    asking: dict[str, int]  # seq_id -> drafts asked, of the sequences the reply will draft
    resolved: dict[str, DraftRow]  # drafts already known (SSD table hits, or n-gram drafts a table said to use)
    features: list[torch.Tensor]  # each [n, d] float16: the round's feature rows, sent after it in this order


@dataclass
class DraftRound:
    """One step's drafts, asked for (`RemoteDrafter.start_groups`) and not yet collected."""

    requests: list[DraftRequest]
    in_flight: _InFlight | None
    deadline: float  # monotonic: when finish_groups stops waiting
    sent_at: float = field(default_factory=time.monotonic)

    @property
    def waiting(self) -> set[str]:
        """The sequences this round drafts (SSD table hits included: the endpoint now counts on those
        drafts being verified): they must not move until it is collected."""
        flight = self.in_flight
        return set(flight.asked) | set(flight.resolved) if flight is not None else set()

    def ready(self) -> bool:
        """Whether finish_groups would return without waiting."""
        flight = self.in_flight
        return (flight is None or flight.box is None or not flight.box.empty()
                or flight.conn.broken.is_set() or time.monotonic() >= self.deadline)


class RemoteDrafter(Drafter):
    """The Drafter (engine/drafters/base.py) that drafts on a remote endpoint: `start_groups` sends a step's
    round, `finish_groups` collects it."""

    # The decoder's hidden states, for sessions whose drafter reads them; each sequence's plan and sampler,
    # which its session opens with.
    caps = Capabilities(features=True, plan=True, params=True)

    def __init__(
        self,
        tenant: str,
        target_model: str,
        vocab_size: int,
        address: str | None,
        local: NgramDrafter,
        observer: SpeculationObserver,
        deadline_s: float = 0.5,
        lease_s: float = 30.0,
        reattach_s: float = 1.0,
        ssd_push: bool = True,
        delay_s: float = 0.0,
        credentials: Security | None = None,
    ):
        self.credentials = credentials or Security.insecure()
        self.observer = observer
        self.delay_s = delay_s
        self.tenant = tenant
        self.target_model = target_model
        self.vocab_size = vocab_size  # an endpoint's draft outside it is a bad reply, not a crash
        self.address = address
        self.local = local
        self.breaker = DeadlineBreaker(deadline_s)  # holds the configured deadline: rounds wait up to it
        self.reattach_s = reattach_s
        self.sessions = Sessions(tenant, target_model, lease_s, ssd_push, reattach_s)
        self.capacity: pb.GetCapacityResponse | None = None  # the last attached endpoint's, kept while detached
        # What the draft-length policy charges remote rounds: their time beyond drafting, and SSD's hits.
        self.wire_s = RunningMean(0.0)
        self.ssd_hit_ratio = RunningMean(0.5)
        self.ssd = SsdPush(ssd_push, vocab_size, self.ssd_hit_ratio)
        self._conn: Connection | None = None
        self._round_id = 0
        self._stop = threading.Event()
        if address:
            threading.Thread(target=self._attach_loop, daemon=True, name="spec-attach").start()

    # -- attachment -------------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        return self._conn is not None and not self._conn.broken.is_set()

    @property
    def healthy(self) -> bool:
        """Attached, and its rounds come back on time (the breaker is closed): worth drafting on."""
        return self.attached and not self.breaker.open

    def wait_attached(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.attached:
                return True
            time.sleep(0.05)
        return self.attached

    def _attach_loop(self) -> None:
        while not self._stop.is_set():
            if not self.attached:
                try:
                    conn = Connection(self.address, self.tenant, connect_timeout_s=2.0, breaker=self.breaker,
                                      delay_s=self.delay_s, credentials=self.credentials)
                except grpc.RpcError as e:
                    log.debug("endpoint %s not reachable: %s", self.address, e.code().name)
                else:
                    log.info("attached to speculation endpoint %s", self.address)
                    self._conn, self.capacity = conn, conn.capacity
                    self.observer.attached(conn.capacity)
            self._stop.wait(self.reattach_s)

    def draft_costs(self) -> StepCosts | None:
        """The endpoint's measured draft-model step costs for our model, once one attached."""
        return draft_costs(self.capacity, self.target_model) if self.capacity is not None else None

    def close(self) -> None:
        self._stop.set()
        if self._conn is not None:
            self._conn.close()

    def _detach(self, conn: Connection | None) -> None:
        if conn is None or self._conn is not conn:
            return
        log.warning("detached from speculation endpoint %s; drafting locally until it returns", self.address)
        self._conn = None
        conn.close()
        self.sessions.detached()

    def _plain_running(self) -> bool:
        """Whether a sequence that asked for no speculation is running: then no step drafts locally for a
        sequence the endpoint failed."""
        return any(seq.plan.method is Method.NONE for seq in self.sessions.seqs.values())

    def _fall_back(self, reason: Fallback, seq_ids: list[str]) -> None:
        self.observer.fell_back(reason, seq_ids)

    # -- Drafter protocol ---------------------------------------------------------------------

    def start(self, seq_id: str, context: Sequence[int], features: torch.Tensor | None = None,
              plan: SpeculationPlan | None = None, params: SamplingParams | None = None) -> None:
        """features [len(context) - 1, d]: the target's at every context position but the last. plan: how
        the sequence speculates (None: the target's own n-gram index); params: its sampler."""
        plan = plan or LOCAL_NGRAM
        session = Session(list(context), params or SamplingParams(), plan)
        # A method whose endpoint drafter may read the target's features: its session keeps them, and
        # sends them once the endpoint says it reads them (OpenedSession.reads_features).
        if plan.remote and plan.method.row.reads_features:
            session.features = []
            session.keep_features(features)
        self.sessions.add(seq_id, session)
        self.local.start(seq_id, context)

    def observe(self, seq_id: str, tokens: Sequence[int], features: torch.Tensor | None = None) -> None:
        """features [len(tokens), d]: the target's at the position before each token."""
        seq = self.sessions[seq_id]
        seq.context.extend(tokens)
        seq.pending.extend(tokens)
        seq.keep_features(features)
        self.local.observe(seq_id, tokens)

    def replan(self, seq_id: str, plan: SpeculationPlan) -> None:
        """Off the endpoint (SpeculationPlan.fallback never moves onto it): its session there closes with
        the next flush, and the target's n-gram index, which has seen every token, drafts from now on."""
        seq = self.sessions.get(seq_id)
        if seq is None:
            return
        if seq.plan.remote and not plan.remote:
            self.sessions.close(seq_id)
        seq.plan = plan

    def release(self, seq_id: str) -> None:
        seq = self.sessions.remove(seq_id)
        self.local.release(seq_id)
        if seq is not None and seq.cache_lookups:
            self.observer.cache_stats(seq_id, seq.cache_hits, seq.cache_lookups)
        if not self.sessions.seqs:
            self.sessions.flush_closes(self._conn)

    def propose(self, seq_ids, num_tokens, params, generator) -> Drafts:
        requests = [DraftRequest(list(seq_ids), list(num_tokens), params, generator)]
        return self.finish_groups(self.start_groups(requests))[0]

    def start_groups(self, requests: Sequence[DraftRequest]) -> DraftRound:
        """Sends the step's round; `finish_groups` waits for it. In between, the decoder steps the
        sequences that wait for no remote drafts (engine/decoding.py)."""
        self.sessions.flush_closes(self._conn)
        requests = list(requests)
        return DraftRound(requests, self._send(requests), time.monotonic() + self.breaker.deadline())

    def finish_groups(self, pending: DraftRound) -> list[Drafts]:
        remote = self._receive(pending)
        # Beside a plain sequence, one the endpoint failed this round decodes plainly: its local drafts would
        # be made on this core and verified in the plain row's forward, wider than its own (a plain stream
        # ran 2.5-3x its solo time while the endpoint hung, issue 38).
        plain_decodes = self._plain_running()

        def none_beside_plain(seq_id: str, n: int) -> DraftRow | None:
            """No drafts for a round of none, nor for a remote sequence beside a plain one: the chain ends."""
            return DraftRow([]) if n <= 0 or (self.sessions[seq_id].plan.remote and plain_decodes) else None

        chain = DraftChain(lambda seq_id, _n: remote.get(seq_id), none_beside_plain, self._draft_locally)
        out = []
        for r in pending.requests:
            rows = []
            for seq_id, n in zip(r.seq_ids, r.num_tokens):
                seq = self.sessions.get(seq_id)
                if seq is None:  # left while its round was out (cancelled): the decoder drops its row
                    rows.append(DraftRow([]))
                    continue
                rows.append(chain.draft(seq_id, n))
                seq.drafts = list(rows[-1].tokens)
            out.append(assemble(rows, r.params))
        return out

    def _draft_locally(self, seq_id: str, n: int) -> DraftRow:
        """The chain's last member: the target's n-gram index, a tree of LOCAL_TREE for a tree session."""
        if self.sessions[seq_id].plan.tree:
            tokens, parents = self.local.draft_tree(seq_id, n, LOCAL_TREE)
            return DraftRow(tokens, parents=parents)
        return DraftRow(self.local.draft(seq_id, n))

    # -- the round ------------------------------------------------------------------------------

    def _send(self, requests: Sequence[DraftRequest]) -> _InFlight | None:
        """One RoundsRequest for every remote-drafted sequence of this step, sent; None when nothing
        waits for a reply (no remote sequence, a fallback, or every draft resolved from SSD tables)."""
        wanted = [(s, n) for r in requests for s, n in zip(r.seq_ids, r.num_tokens)
                  if self.sessions[s].plan.remote]
        if not wanted:
            return None
        # An open breaker waits on nothing: at most a probe round goes out, and only its timing is used.
        probing = self.breaker.open
        conn = self._connection_for([s for s, _ in wanted], probing)
        ready = self._ready(conn, wanted) if conn is not None else []
        if not ready:
            return None
        return self._dispatch(conn, self._outgoing(conn, ready, probing), probing)

    def _connection_for(self, seq_ids: list[str], probing: bool) -> Connection | None:
        """The attached connection, with these sequences' sessions opened on it (or opening); None (and a
        fallback told) when the round cannot go out."""
        conn = self._conn
        if conn is None or conn.broken.is_set():
            self._detach(conn)
            self._fall_back(Fallback.ENDPOINT_UNAVAILABLE if self.address else Fallback.NO_ENDPOINT, seq_ids)
            return None
        if probing and not self.breaker.probe_due():
            self._fall_back(Fallback.BREAKER_OPEN, seq_ids)
            return None
        # An open prefills the context on the endpoint, longer than a round: it may take the configured
        # deadline, not the adaptive one (a few round trips), or a new sequence's first round drafts locally.
        # Beside a plain sequence it waits for nothing: the plain row would wait with it (issue 38).
        wait_s = 0.0 if probing or self._plain_running() else self.breaker.max_deadline_s
        if not self.sessions.open(conn, seq_ids, wait_s, timeout_s=max(10.0, self.breaker.max_deadline_s)):
            self._detach(conn)
            self._fall_back(Fallback.ENDPOINT_FAILED, seq_ids)
            return None
        return conn

    def _ready(self, conn: Connection, wanted: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """Those of (seq_id, drafts wanted) whose sessions can draft now; the others fall back."""
        ready = [(s, n) for s, n in wanted if self._can_draft(conn, self.sessions[s])]
        if len(ready) < len(wanted):
            ready_ids = {s for s, _ in ready}
            self._fall_back(Fallback.SESSION_UNAVAILABLE, [s for s, _ in wanted if s not in ready_ids])
        return ready

    def _outgoing(self, conn: Connection, ready: list[tuple[str, int]], probing: bool) -> _Outgoing:
        """The round for these sequences: each reports its emitted tokens, then asks for drafts or says
        which it resolved from an SSD table."""
        self._round_id += 1
        resolved: dict[str, DraftRow] = {}
        asking = {}
        features = []
        sequences = []
        for s, n in ready:
            seq = self.sessions[s]
            ssd = seq.plan.method.row.prespeculates and not probing
            found = self.ssd.resolve(conn, s, seq, n, self.breaker.deadline(), self.local.draft) if ssd else None
            rows = seq.take_unsent()
            num_features = 0 if rows is None else rows.shape[0]
            if rows is not None:
                features.append(rows)
            if found is None:
                sequences.append(sequence_round(s, seq.pending, max(n, 0), num_features))
                asking[s] = n
            else:
                sequences.append(resolved_round(s, seq.pending, found.tokens, found.table_hit, num_features))
                resolved[s] = DraftRow(found.tokens, found.q)
            seq.pending = []  # the endpoint applies them whether or not we wait for the reply
        request = rounds_request(self.tenant, self._round_id, sequences,
                                 feature_dim=features[0].shape[1] if features else 0)
        return _Outgoing(request, asking, resolved, features)

    def _dispatch(self, conn: Connection, out: _Outgoing, probing: bool) -> _InFlight | None:
        """Sends the round, then its feature rows -> what to wait for (None: nothing)."""
        if not out.asking:
            conn.send(out.request)
            flight = _InFlight(conn, out.request.round_id, None, {}, out.resolved)
        elif probing:
            conn.probe(out.request)
            self._fall_back(Fallback.BREAKER_OPEN, list(out.asking))
            flight = None
        else:
            flight = _InFlight(conn, out.request.round_id, conn.send_round(out.request), out.asking, out.resolved)
        if out.features and not self._send_features(conn, torch.cat(out.features)):
            self._fall_back(Fallback.ENDPOINT_FAILED, list(out.asking))
            return None
        return flight

    def _send_features(self, conn: Connection, rows: torch.Tensor) -> bool:
        """The round's feature rows, after its message, on the tensor channel; a broken channel detaches
        the connection (the next one pairs a fresh channel, and sessions re-open with all their features)."""
        try:
            conn.tensor.send(rows)
        except ChannelError as e:
            log.warning("sending features to the endpoint failed: %s; re-attaching", e)
            self._detach(conn)
            return False
        return True

    @staticmethod
    def _can_draft(conn: Connection, seq: Session) -> bool:
        """Its session is open, and a dense q (the endpoint's choice, spec_endpoint.sessions) or features its
        drafter reads have a channel. Trees carry no q."""
        dense = not seq.plan.tree and q_travels_dense(seq.params, seq.plan.method)
        return seq.opened and (conn.dense_ready or not (dense or seq.reads_features))

    def _receive(self, pending: DraftRound) -> dict[str, DraftRow]:
        """Waits (until the round's deadline) for its reply -> seq_id -> the remote drafts."""
        flight = pending.in_flight
        if flight is None:
            return {}
        if flight.box is None:
            return flight.resolved
        reply = flight.conn.wait_round(flight.round_id, flight.box, pending.deadline - time.monotonic())
        self._time_round(pending, reply)
        if reply is None:
            self._missed(flight)
            return {}
        self.breaker.on_time()
        drafts = dict(flight.resolved)
        for d in read_round(reply.response, reply.dense):
            row = self._usable(d, flight.asked)
            if row is not None:
                drafts[d.seq_id] = row
        return drafts

    def _time_round(self, pending: DraftRound, reply: Reply | None) -> None:
        # Timed to the reply's arrival: the decoder may have stepped other sequences before collecting it.
        waited = (reply.arrived_at if reply else time.monotonic()) - pending.sent_at
        self.observer.round_trip(waited, reply.response.draft_seconds if reply else 0.0)
        if reply is not None:
            self.wire_s.add(max(0.0, waited - reply.response.draft_seconds))

    def _missed(self, flight: _InFlight) -> None:
        """No reply by the deadline: a broken stream detaches; a late reply counts against the breaker."""
        if flight.conn.broken.is_set():
            self._detach(flight.conn)
            self._fall_back(Fallback.ENDPOINT_FAILED, list(flight.asked))
        else:
            self.breaker.late()
            self._fall_back(Fallback.DEADLINE, list(flight.asked))

    def _usable(self, d: SequenceReply, asked: dict[str, int]) -> DraftRow | None:
        """A sequence's drafts from the reply, when they can be verified; None (logged, and a fallback told)
        when not."""
        if d.seq_id not in asked:
            log.warning("endpoint answered for %r, which this round did not ask for; ignored", d.seq_id)
            return None
        seq = self.sessions.get(d.seq_id)
        if seq is None:  # left while the round was out
            return None
        if d.error:
            log.debug("endpoint could not draft %s: %s", d.seq_id, d.error)
            seq.opened = False  # re-open (with the full context) next round
            self._fall_back(Fallback.SESSION_LOST, [d.seq_id])
            return None
        # A tree session's drafts are a tree, even a one-node one; a chain session's never are.
        parents = d.parents if seq.plan.tree else None
        if d.parents and parents is None:
            problem = "a token tree for a chain session"
        else:
            problem = unusable(d.tokens, d.q, asked[d.seq_id], d.q_sent, self.vocab_size, parents)
        if problem:
            log.warning("endpoint's drafts for %s are unusable (%s); drafting locally", d.seq_id, problem)
            self._fall_back(Fallback.BAD_REPLY, [d.seq_id])
            return None
        if seq.plan.method.row.prespeculates:
            self.ssd.replied(seq, d)
        return DraftRow(d.tokens, d.q, parents)
