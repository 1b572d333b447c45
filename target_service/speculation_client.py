"""The target's side of the Speculation API: a Drafter backed by a pooled endpoint, failing open.

Every step, the drafts for all of this target's sequences come from the endpoint in one
RoundRequest on one bidirectional stream; the same message reports what the previous round
emitted. When the endpoint is absent, late (past the per-step deadline) or failing, the affected
sequences are drafted by a local n-gram index for that round, losslessly: a deterministic draft is
verified as a point mass. A background thread re-attaches to a returning endpoint, and sequences
then re-open their sessions with their full context.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import torch
from specpool.engine.drafter import DraftRequest, Drafts
from specpool.engine.ngram import NgramDrafter
from specpool.engine.sampling import SamplingParams
from specpool.engine.speculation_policy import StepCosts

from specpool.common.security import Security
from specpool.common.serving import MESSAGE_SIZE_OPTIONS
from specpool.common.speculation import SPARSE_Q_MAX_K
from specpool.common.tensor_channel import ChannelOffer, DistributedPairChannel
from specpool.v1 import speculation_pb2 as pb
from specpool.v1 import speculation_pb2_grpc, target_pb2

log = logging.getLogger("specpool.target.speculation")

REMOTE_KINDS = (pb.DRAFTER_KIND_DRAFT_MODEL, pb.DRAFTER_KIND_NGRAM, pb.DRAFTER_KIND_SSD)


class DeadlineBreaker:
    """Stops a target waiting on an endpoint whose rounds keep coming late (hung, overloaded, a slow link).

    Closed, a round waits up to `deadline()`: twice the slowest of the last 64 round trips, within
    [MIN_DEADLINE_S, the configured deadline], so a late round costs a few healthy round trips, not
    the configured worst case. After `trip_after` late rounds in a row it opens: nothing waits on
    the endpoint (sequences draft locally) and one probe round at a time goes out, every `probe_s`.
    Every reply is timed, however late; the first back within the deadline closes it.
    Called from the step thread, and from the connection's reader thread (`replied`).
    """

    MIN_DEADLINE_S = 0.05

    def __init__(self, deadline_s: float, trip_after: int = 3, probe_s: float = 0.25, clock=time.monotonic):
        self.max_deadline_s = deadline_s
        self.trip_after = trip_after
        self.probe_s = probe_s
        self.clock = clock
        self.open = False
        self._round_trips: deque[float] = deque(maxlen=64)
        self._late_in_a_row = 0
        self._probe_sent_at: float | None = None
        self._lock = threading.Lock()

    def deadline(self) -> float:
        with self._lock:
            return self._deadline()

    def _deadline(self) -> float:
        if len(self._round_trips) < 8:
            return self.max_deadline_s
        # Twice the slowest of the recent replies: a healthy endpoint's occasional slow round (its batch
        # window, a busy core) is never cut short; a 90th percentile was, and drafted rounds fell back.
        return min(self.max_deadline_s, max(self.MIN_DEADLINE_S, 2 * max(self._round_trips)))

    def on_time(self) -> None:
        with self._lock:
            self._late_in_a_row = 0

    def late(self) -> None:
        with self._lock:
            self._late_in_a_row += 1
            if self.open or self._late_in_a_row < self.trip_after:
                return
            self.open, self._probe_sent_at = True, None
            deadline = self._deadline()
        log.warning("speculation endpoint late %d rounds in a row; drafting locally until a round comes back "
                    "within %.0f ms", self.trip_after, deadline * 1e3)

    def probe_due(self) -> bool:
        """While open: whether to send a probe round now (one at a time; a lost one is replaced)."""
        with self._lock:
            now, sent = self.clock(), self._probe_sent_at
            if sent is not None and now - sent < max(self.probe_s, self.max_deadline_s):
                return False
            self._probe_sent_at = now
            return True

    def replied(self, round_trip_s: float) -> None:
        """A round's reply arrived, this long after it was sent."""
        with self._lock:
            self._round_trips.append(round_trip_s)
            if not self.open:
                return
            if round_trip_s > self._deadline():
                self._probe_sent_at = None  # answered, late: the next probe may go at once
                return
            self.open, self._late_in_a_row = False, 0
        log.info("speculation endpoint answered in %.0f ms; drafting on it again", round_trip_s * 1e3)


@dataclass
class _Seq:
    context: list[int]  # prompt and every emitted token: what a re-opened session starts from
    params: SamplingParams
    kind: int | None  # DrafterKind asked of the endpoint; None: local n-gram; -1: no speculation
    max_draft: int = 0  # the request's own cap on drafts per round (0: none)
    opened: bool = False  # a session for it is open on the current endpoint connection
    opening: bool = False  # an OpenSessions call for it is in flight
    opened_at: int = 0  # len(context) when that call was sent
    retry_at: float = 0.0  # after a declined open (capacity), when to ask again
    drafts: list[int] = field(default_factory=list)  # the drafts it verifies now (SSD: what tables follow)
    cache_lookups: int = 0  # SSD rounds with an outcome to look up
    cache_hits: int = 0
    pending: list[int] = field(default_factory=list)  # emitted since its last round was sent


@dataclass(frozen=True)
class _InFlight:
    """A round on the wire: box is None when it needs no reply (every draft came from SSD tables)."""

    conn: _Connection
    round_id: int
    box: queue.Queue | None
    asked: dict[str, int]  # seq_id -> drafts asked, of the sequences the reply will draft
    resolved: dict[str, tuple[list[int], object]]  # drafts already known (SSD table hits)


@dataclass
class DraftRound:
    """One step's drafts, asked for (`SpeculationClient.start_groups`) and not yet collected."""

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


@dataclass(frozen=True)
class _Reply:
    response: pb.RoundResponse
    dense: torch.Tensor | None  # [dense_rows, V] from the tensor channel
    arrived_at: float = field(default_factory=time.monotonic)


class _Connection:
    """One attachment to an endpoint: the Rounds stream, its reader thread and the tensor channel."""

    def __init__(self, address: str, tenant: str, connect_timeout_s: float, delay_s: float = 0.0,
                 on_reply: Callable[[float], None] = lambda round_trip_s: None,
                 credentials: Security | None = None):
        self.tenant = tenant
        self.delay_s = delay_s  # injected per message, each way (tests and benchmarks)
        self.on_reply = on_reply  # every round's reply, awaited or not: its round trip
        self._sent_at: dict[int, float] = {}
        self.tables: dict[str, pb.OutcomeTable] = {}  # SSD push: the latest table per sequence
        self.tables_changed = threading.Condition()
        # Only a certificate that names an endpoint (endpoint.specpool) gets this target's contexts.
        self.channel = (credentials or Security.insecure()).channel(address, "endpoint", options=MESSAGE_SIZE_OPTIONS)
        self.stub = speculation_pb2_grpc.SpeculationServiceStub(self.channel)
        self.capacity = self.stub.GetCapacity(pb.CapacityRequest(), timeout=connect_timeout_s)
        self.broken = threading.Event()
        self._outbox: queue.Queue = queue.Queue()
        self._waiting: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        self.tensor: DistributedPairChannel | None = None
        self._tensor_ready = threading.Event()
        offer = self.stub.OpenTensorChannel(pb.TensorChannelRequest(tenant=tenant), timeout=connect_timeout_s)
        threading.Thread(target=self._connect_tensor, args=(offer,), daemon=True).start()
        self._stream = self.stub.Rounds(self._delayed(iter(self._outbox.get, None)))
        threading.Thread(target=self._read, daemon=True, name="spec-reader").start()

    def _connect_tensor(self, offer: pb.TensorChannelResponse) -> None:
        try:
            self.tensor = DistributedPairChannel.connect(
                ChannelOffer(host=offer.store_host, port=offer.store_port, prefix=offer.prefix,
                             backend=offer.backend, target_rank=offer.target_rank, timeout_s=offer.timeout_s,
                             secret=offer.secret),
                rank=offer.target_rank,
            )
            self._tensor_ready.set()
        except (RuntimeError, TimeoutError, OSError, ValueError) as e:  # ValueError: an offer with no secret
            # dense q then drafts locally; sparse is unaffected
            log.warning("tensor channel to the endpoint failed: %s", e)

    @property
    def dense_ready(self) -> bool:
        return self._tensor_ready.is_set()

    def _delayed(self, messages):
        for message in messages:
            if self.delay_s:
                time.sleep(self.delay_s)
            yield message

    def _read(self) -> None:
        try:
            for response in self._stream:
                if self.delay_s:
                    time.sleep(self.delay_s)
                if response.tables:
                    with self.tables_changed:
                        for table in response.tables:
                            self.tables[table.request_id] = table
                        self.tables_changed.notify_all()
                if not response.round_id:
                    continue  # an unsolicited push
                dense = None
                if response.dense_rows:
                    # Read even when nobody waits any more: the channel must stay in step.
                    dense = self.tensor.recv((response.dense_rows, response.vocab_size), torch.float32)
                with self._lock:
                    box = self._waiting.pop(response.round_id, None)
                    sent_at = self._sent_at.pop(response.round_id, None)
                if sent_at is not None:
                    self.on_reply(time.monotonic() - sent_at)
                if box is not None:
                    box.put(_Reply(response, dense))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                log.warning("speculation stream broke: %s %s", e.code().name, e.details())
        except Exception:
            log.exception("speculation stream reader failed")
        finally:
            self.broken.set()
            with self._lock:
                boxes, self._waiting = list(self._waiting.values()), {}
            for box in boxes:
                box.put(None)

    def send(self, request: pb.RoundRequest) -> None:
        """A round that needs no reply (push mode: every sequence resolved its drafts itself)."""
        self._outbox.put(request)

    def table_for(self, seq_id: str, follows: list[int], timeout_s: float) -> pb.OutcomeTable | None:
        """The pushed table for these outstanding drafts, waiting up to timeout_s for it to arrive."""
        end = time.monotonic() + timeout_s
        with self.tables_changed:
            while True:
                table = self.tables.get(seq_id)
                if table is not None and list(table.follows) == follows:
                    return table
                left = end - time.monotonic()
                if left <= 0 or self.broken.is_set():
                    return None
                self.tables_changed.wait(left)

    def probe(self, request: pb.RoundRequest) -> None:
        """Send a round nobody waits for: its reply is only timed (see DeadlineBreaker)."""
        with self._lock:
            self._sent_at[request.round_id] = time.monotonic()
        self._outbox.put(request)

    def send_round(self, request: pb.RoundRequest) -> queue.Queue:
        """Send one round; its reply (None if the stream breaks) arrives in the returned box."""
        box: queue.Queue = queue.Queue(maxsize=1)
        with self._lock:
            self._waiting[request.round_id] = box
            self._sent_at[request.round_id] = time.monotonic()
        if self.broken.is_set():
            box.put(None)
        self._outbox.put(request)
        return box

    def wait_round(self, round_id: int, box: queue.Queue, timeout_s: float) -> _Reply | None:
        """The reply from `send_round`, waiting up to timeout_s; None when late or broken."""
        try:
            return box.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            with self._lock:
                self._waiting.pop(round_id, None)
            return None

    def close(self) -> None:
        self._outbox.put(None)
        self.channel.close()
        if self.tensor is not None:
            self.tensor.close()


class SpeculationClient:
    """A Drafter (engine.drafter protocol, with `propose_groups`) that drafts on a remote endpoint."""

    def __init__(
        self,
        tenant: str,
        target_model: str,
        vocab_size: int,
        address: str | None,
        local: NgramDrafter,
        deadline_s: float = 0.5,
        lease_s: float = 30.0,
        reattach_s: float = 1.0,
        on_fallback: Callable[[str, list[str]], None] | None = None,
        on_attach: Callable[[pb.Capacity], None] | None = None,
        ssd_push: bool = True,
        delay_s: float = 0.0,
        on_cache_stats: Callable[[str, int, int], None] | None = None,
        on_round: Callable[[float, float], None] | None = None,
        credentials: Security | None = None,
    ):
        self.credentials = credentials or Security.insecure()
        self.on_round = on_round or (lambda wait_s, draft_s: None)  # a round trip: our wait, their drafting
        self.on_cache_stats = on_cache_stats or (lambda seq_id, hits, lookups: None)  # SSD, when a sequence ends
        self.ssd_push = ssd_push  # SSD: take drafts from pushed outcome tables (else pull each round)
        self.delay_s = delay_s
        self.tenant = tenant
        self.target_model = target_model
        self.vocab_size = vocab_size  # an endpoint's draft outside it is a bad reply, not a crash
        self.address = address
        self.local = local
        self.breaker = DeadlineBreaker(deadline_s)  # holds the configured deadline: rounds wait up to it
        self.lease_s = lease_s
        self.reattach_s = reattach_s
        self.on_fallback = on_fallback or (lambda reason, seq_ids: None)  # called on the step's thread
        self.on_attach = on_attach or (lambda capacity: None)
        self._seqs: dict[str, _Seq] = {}
        self._configured: dict[str, tuple[int | None, SamplingParams, int]] = {}
        self._conn: _Connection | None = None
        self._round_id = 0
        self._opens: list[tuple[_Connection, list[str], grpc.Future]] = []
        self._to_close: list[str] = []
        self._closing: list[grpc.Future] = []
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
                    conn = _Connection(self.address, self.tenant, connect_timeout_s=2.0, delay_s=self.delay_s,
                                       on_reply=self.breaker.replied, credentials=self.credentials)
                except grpc.RpcError as e:
                    log.debug("endpoint %s not reachable: %s", self.address, e.code().name)
                else:
                    log.info("attached to speculation endpoint %s", self.address)
                    self._conn = conn
                    self.on_attach(conn.capacity)
            self._stop.wait(self.reattach_s)

    def draft_costs(self) -> StepCosts | None:
        """The endpoint's measured draft-model step costs for our model, when attached."""
        if self._conn is None:
            return None
        for m in self._conn.capacity.models:
            table = m.draft_step_costs
            if m.target_model == self.target_model and table.seconds:
                n = len(table.draft_lens)
                rows = [tuple(table.seconds[i * n : (i + 1) * n]) for i in range(len(table.batch_sizes))]
                return StepCosts(tuple(table.batch_sizes), tuple(table.draft_lens), tuple(rows))
        return None

    def close(self) -> None:
        self._stop.set()
        if self._conn is not None:
            self._conn.close()

    # -- Drafter protocol ---------------------------------------------------------------------

    def configure(self, seq_id: str, kind: int | None, params: SamplingParams, max_draft: int = 0) -> None:
        """Before start: which endpoint drafter (None: local n-gram, -1: none), sampler, cap."""
        self._configured[seq_id] = (kind, params, max_draft)

    def start(self, seq_id: str, context: Sequence[int]) -> None:
        kind, params, max_draft = self._configured.pop(seq_id, (None, SamplingParams(), 0))
        self._seqs[seq_id] = _Seq(list(context), params, kind, max_draft)
        self.local.start(seq_id, context)

    def observe(self, seq_id: str, tokens: Sequence[int]) -> None:
        seq = self._seqs[seq_id]
        seq.context.extend(tokens)
        seq.pending.extend(tokens)
        self.local.observe(seq_id, tokens)

    def release(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        self.local.release(seq_id)
        if seq is not None and seq.cache_lookups:
            self.on_cache_stats(seq_id, seq.cache_hits, seq.cache_lookups)
        if seq is not None and (seq.opened or seq.opening):
            self._to_close.append(seq_id)
        if not self._seqs:
            self._flush_closes()

    def _flush_closes(self) -> None:
        """One CloseSessions per step for every sequence that left (fire and forget: leases back it up)."""
        conn, ids, self._to_close = self._conn, self._to_close, []
        # Hold the futures until done: grpc cancels a call whose future is garbage-collected.
        self._closing = [f for f in self._closing if not f.done()]
        if ids and conn is not None and not conn.broken.is_set():
            self._closing.append(
                conn.stub.CloseSessions.future(pb.CloseSessionsRequest(tenant=self.tenant, request_ids=ids))
            )

    def propose(self, seq_ids, num_tokens, params, generator) -> Drafts:
        return self.propose_groups([DraftRequest(list(seq_ids), list(num_tokens), params, generator)])[0]

    def propose_groups(self, requests: Sequence[DraftRequest]) -> list[Drafts]:
        return self.finish_groups(self.start_groups(requests))

    def start_groups(self, requests: Sequence[DraftRequest]) -> DraftRound:
        """The first half of propose_groups: sends the step's round; `finish_groups` waits for it. In
        between, the decoder steps the sequences that wait for no remote drafts (engine.decoding)."""
        self._flush_closes()
        requests = [self._capped(r) for r in requests]
        return DraftRound(requests, self._send(requests), time.monotonic() + self.breaker.deadline())

    def finish_groups(self, pending: DraftRound) -> list[Drafts]:
        remote = self._receive(pending)
        out = []
        for r in pending.requests:
            rows = []
            for seq_id, n in zip(r.seq_ids, r.num_tokens):
                seq = self._seqs.get(seq_id)
                if seq is None:  # left while its round was out (cancelled): the decoder drops its row
                    rows.append(([], None))
                    continue
                if seq_id in remote:
                    rows.append(remote[seq_id])
                elif seq.kind == -1 or n <= 0:
                    rows.append(([], None))
                else:
                    rows.append((self.local.draft(seq_id, n), None))
                seq.drafts = list(rows[-1][0])
            out.append(_assemble(rows, r.params))
        return out

    def _capped(self, r: DraftRequest) -> DraftRequest:
        caps = [self._seqs[s].max_draft or n for s, n in zip(r.seq_ids, r.num_tokens)]
        return DraftRequest(r.seq_ids, [min(n, c) for n, c in zip(r.num_tokens, caps)], r.params, r.generator)

    # -- the round ------------------------------------------------------------------------------

    def _send(self, requests: Sequence[DraftRequest]) -> _InFlight | None:
        """One RoundRequest for every remote-drafted sequence of this step, sent; None when nothing
        waits for a reply (no remote sequence, a fallback, or every draft resolved from SSD tables)."""
        wanted = [(s, n) for r in requests for s, n in zip(r.seq_ids, r.num_tokens)
                  if self._seqs[s].kind in REMOTE_KINDS]
        if not wanted:
            return None
        conn = self._conn
        if conn is None or conn.broken.is_set():
            self._detach(conn)
            self.on_fallback("endpoint_unavailable" if self.address else "no_endpoint", [s for s, _ in wanted])
            return None
        # An open breaker waits on nothing: at most a probe round goes out, and only its timing is used.
        probing = self.breaker.open
        if probing and not self.breaker.probe_due():
            self.on_fallback("breaker_open", [s for s, _ in wanted])
            return None
        # An open prefills the context on the endpoint, longer than a round: it may take the configured
        # deadline, not the adaptive one (a few round trips), or a new sequence's first round drafts locally.
        self._open_sessions(conn, [s for s, _ in wanted], wait_s=0.0 if probing else self.breaker.max_deadline_s)
        if self._conn is not conn:
            self.on_fallback("endpoint_failed", [s for s, _ in wanted])
            return None
        dense_ok = conn.dense_ready
        ready = [(s, n) for s, n in wanted if self._seqs[s].opened and (dense_ok or not _needs_dense(self._seqs[s]))]
        if len(ready) < len(wanted):
            ready_ids = {s for s, _ in ready}
            self.on_fallback("session_unavailable", [s for s, _ in wanted if s not in ready_ids])
        if not ready:
            return None
        self._round_id += 1
        request = pb.RoundRequest(tenant=self.tenant, round_id=self._round_id)
        resolved: dict[str, tuple[list[int], object]] = {}
        asking = []
        for s, n in ready:
            seq = self._seqs[s]
            ssd = seq.kind == pb.DRAFTER_KIND_SSD and not probing
            found = self._resolve_from_table(conn, s, seq, n) if ssd else None
            if found is None:
                request.sequences.append(pb.SequenceRound(request_id=s, new_tokens=seq.pending,
                                                          num_draft_tokens=max(n, 0)))
                asking.append((s, n))
            else:
                resolution, tokens, q = found
                request.sequences.append(pb.SequenceRound(
                    request_id=s, new_tokens=seq.pending, resolution=resolution,
                    num_draft_tokens=len(tokens) if resolution == pb.ROUND_RESOLUTION_TABLE_HIT else 0,
                    drafts_in_use=tokens if resolution == pb.ROUND_RESOLUTION_LOCAL_DRAFTS else [],
                ))
                resolved[s] = (tokens, q)
            seq.pending = []  # the endpoint applies them whether or not we wait for the reply
        if not asking:
            conn.send(request)
            return _InFlight(conn, request.round_id, None, {}, resolved)
        if probing:
            conn.probe(request)
            self.on_fallback("breaker_open", [s for s, _ in asking])
            return None
        return _InFlight(conn, request.round_id, conn.send_round(request), dict(asking), resolved)

    def _receive(self, pending: DraftRound) -> dict[str, tuple[list[int], object]]:
        """Waits (until the round's deadline) for its reply -> seq_id -> (tokens, q) of remote drafts."""
        flight = pending.in_flight
        if flight is None:
            return {}
        if flight.box is None:
            return flight.resolved
        conn, asked = flight.conn, flight.asked
        reply = conn.wait_round(flight.round_id, flight.box, pending.deadline - time.monotonic())
        # Timed to the reply's arrival: the decoder may have stepped other sequences before collecting it.
        waited = (reply.arrived_at if reply else time.monotonic()) - pending.sent_at
        self.on_round(waited, reply.response.draft_seconds if reply else 0.0)
        if reply is None:
            if conn.broken.is_set():
                self._detach(conn)
                self.on_fallback("endpoint_failed", list(asked))
            else:
                self.breaker.late()
                self.on_fallback("deadline", list(asked))
            return {}
        self.breaker.on_time()
        drafts = dict(flight.resolved)
        dense_row = 0
        for d in reply.response.sequences:
            if d.request_id not in asked:
                log.warning("endpoint answered for %r, which this round did not ask for; ignored", d.request_id)
                continue
            if d.request_id not in self._seqs:  # left while the round was out
                continue
            if d.error:
                log.debug("endpoint could not draft %s: %s", d.request_id, d.error)
                self._seqs[d.request_id].opened = False  # re-open (with the full context) next round
                self.on_fallback("session_lost", [d.request_id])
                continue
            q = None
            if d.dense_on_channel:
                q = reply.dense[dense_row : dense_row + len(d.tokens)] if reply.dense is not None else None
                dense_row += len(d.tokens)
            elif d.HasField("sparse"):
                q = _sparse_q(d.sparse, len(d.tokens))
            problem = self._unusable(list(d.tokens), q, asked[d.request_id], d.dense_on_channel)
            if problem:
                log.warning("endpoint's drafts for %s are unusable (%s); drafting locally", d.request_id, problem)
                self.on_fallback("bad_reply", [d.request_id])
                continue
            drafts[d.request_id] = (list(d.tokens), q)
            if self._seqs[d.request_id].kind == pb.DRAFTER_KIND_SSD and d.tokens:
                self._seqs[d.request_id].cache_hits += d.from_cache
        return drafts

    def _unusable(self, tokens: list[int], q, asked: int, q_sent: bool) -> str:
        """Why an endpoint's drafts for one sequence cannot be verified ('' when they can). Checked here:
        in verification a bad id or shape would fail every sequence of the batch, not only this one."""
        if len(tokens) > asked:
            return f"{len(tokens)} drafts where {asked} were asked"
        if any(not 0 <= t < self.vocab_size for t in tokens):
            return f"a draft token outside the vocabulary [0, {self.vocab_size})"
        if q_sent and q is None:
            return "its draft distribution is malformed"
        if isinstance(q, torch.Tensor):
            if tuple(q.shape) != (len(tokens), self.vocab_size):
                return f"dense q of shape {tuple(q.shape)} for {len(tokens)} drafts"
            probs = q
        elif q is not None:
            ids, probs = q
            if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < self.vocab_size):
                return "a sparse q id outside the vocabulary"
        if q is not None and not (torch.isfinite(probs).all() and (probs >= 0).all()):
            return "negative or non-finite draft probabilities"
        return ""

    def _resolve_from_table(self, conn: _Connection, seq_id: str, seq: _Seq, n: int):
        """SSD: count the lookup; in push mode, -> (resolution, tokens, q) when the pushed table
        answers this outcome (a hit) or says the endpoint would back off to n-gram drafts anyway
        (then draft them here, with no round trip). None: ask the endpoint."""
        k = 0
        while k < len(seq.drafts) and k < len(seq.pending) and seq.pending[k] == seq.drafts[k]:
            k += 1
        if not seq.drafts or len(seq.pending) != k + 1:
            return None
        seq.cache_lookups += 1
        if not self.ssd_push or n <= 0:
            return None
        table = conn.table_for(seq_id, seq.drafts, self.breaker.deadline())
        if table is None:
            return None
        for entry in table.entries:
            if entry.accepted == k and entry.bonus == seq.pending[k]:
                tokens = list(entry.tokens)[:n]
                q = None
                if entry.HasField("sparse"):
                    q = _sparse_q(entry.sparse, len(entry.tokens))
                    q = (q[0][: len(tokens)], q[1][: len(tokens)]) if q is not None else None
                problem = self._unusable(tokens, q, n, entry.HasField("sparse"))
                if problem:
                    log.warning("endpoint's table for %s is unusable (%s); asking instead", seq_id, problem)
                    return None
                seq.cache_hits += 1
                return pb.ROUND_RESOLUTION_TABLE_HIT, tokens, q
        if table.fast_backup:
            return pb.ROUND_RESOLUTION_LOCAL_DRAFTS, self.local.draft(seq_id, n), None
        return None



    def _open_sessions(self, conn: _Connection, seq_ids: list[str], wait_s: float) -> None:
        """Open sessions for new (or re-attached) sequences, waiting at most wait_s: a slow open
        leaves its sequences drafting locally until it lands, never stalls the step."""
        now = time.monotonic()
        closed = [s for s in seq_ids if not (self._seqs[s].opened or self._seqs[s].opening)
                  and self._seqs[s].retry_at <= now]
        if closed:
            specs = []
            for s in closed:
                seq = self._seqs[s]
                seq.opening, seq.opened_at = True, len(seq.context)
                p = seq.params
                specs.append(pb.SessionSpec(
                    request_id=s, context=seq.context, drafter=seq.kind, push=self.ssd_push,
                    sampling=target_pb2.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p),
                ))
            future = conn.stub.OpenSessions.future(
                pb.OpenSessionsRequest(tenant=self.tenant, target_model=self.target_model,
                                       lease_s=self.lease_s, sessions=specs),
                timeout=max(10.0, self.breaker.max_deadline_s),
            )
            self._opens.append((conn, closed, future))
            try:
                future.result(timeout=wait_s)
            except (grpc.RpcError, grpc.FutureTimeoutError):
                pass  # collected below or on a later step
        self._collect_opens()

    def _collect_opens(self) -> None:
        pending = []
        for conn, seq_ids, future in self._opens:
            if not future.done():
                pending.append((conn, seq_ids, future))
                continue
            live = [self._seqs[s] for s in seq_ids if s in self._seqs]
            for seq in live:
                seq.opening = False
            if conn is not self._conn:
                continue  # opened on a connection we have since dropped
            try:
                reply = future.result()
            except grpc.RpcError as e:
                log.warning("OpenSessions failed: %s %s", e.code().name, e.details())
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    self._detach(conn)
                continue
            for opened in reply.sessions:
                seq = self._seqs.get(opened.request_id)
                if seq is None:
                    continue
                seq.opened = opened.ok
                if opened.ok:
                    seq.pending = seq.context[seq.opened_at :]  # emitted while the open was in flight
                else:
                    seq.retry_at = time.monotonic() + self.reattach_s
                    log.debug("endpoint declined %s: %s", opened.request_id, opened.error)
        self._opens = pending

    def _detach(self, conn: _Connection | None) -> None:
        if conn is None or self._conn is not conn:
            return
        log.warning("detached from speculation endpoint %s; drafting locally until it returns", self.address)
        self._conn = None
        conn.close()
        for seq in self._seqs.values():
            seq.opened, seq.opening, seq.pending = False, False, []


def _sparse_q(msg: pb.SparseDistribution, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ids [rows, k], probs [rows, k]), or None when the message's sizes do not say that."""
    k = msg.k
    if k < 1 or len(msg.ids) != rows * k or len(msg.probs) != rows * k:
        return None
    return (torch.tensor(msg.ids, dtype=torch.long).view(rows, k),
            torch.tensor(msg.probs, dtype=torch.float32).view(rows, k))


def _needs_dense(seq: _Seq) -> bool:
    """The endpoint's choice (spec_endpoint.sessions.sampled_dense) for the sessions this client opens."""
    sparse = 0 < seq.params.top_k <= SPARSE_Q_MAX_K
    return not seq.params.greedy and not sparse and seq.kind == pb.DRAFTER_KIND_DRAFT_MODEL


def _assemble(rows: list[tuple[list[int], object]], params: SamplingParams) -> Drafts:
    """One Drafts for a sampling group whose rows came from different sources.

    Rows drafted deterministically (n-gram, fallback) are written as a one-hot q, which the
    dense and sparse rules verify exactly as the point-mass rule does.
    """
    tokens = [t for t, _ in rows]
    if params.greedy or all(q is None for _, q in rows):
        return Drafts(tokens=tokens)
    k_max = max((len(t) for t in tokens), default=0)
    if any(isinstance(q, torch.Tensor) for _, q in rows):
        vocab = next(q.shape[-1] for _, q in rows if isinstance(q, torch.Tensor))
        probs = torch.zeros(len(rows), k_max, vocab)
        for b, (t, q) in enumerate(rows):
            if isinstance(q, torch.Tensor):
                probs[b, : len(t)] = q
            elif t:
                probs[b, torch.arange(len(t)), torch.tensor(t)] = 1.0
        return Drafts(tokens=tokens, probs=probs)
    # Sparse: every row shares the sampler's top-k; one-hot rows repeat their token with weight 0.
    k = max(q[0].shape[-1] for _, q in rows if q is not None)  # rows pad to the widest (weight 0)
    ids = torch.zeros(len(rows), k_max, k, dtype=torch.long)
    weights = torch.zeros(len(rows), k_max, k)
    for b, (t, q) in enumerate(rows):
        if q is not None:
            ids[b, : len(t), : q[0].shape[-1]], weights[b, : len(t), : q[0].shape[-1]] = q
        elif t:
            ids[b, : len(t)] = torch.tensor(t)[:, None]
            weights[b, : len(t), 0] = 1.0
    return Drafts(tokens=tokens, topk_ids=ids, topk_probs=weights)
