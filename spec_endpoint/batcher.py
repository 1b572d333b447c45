"""The engine loop: one batched draft forward per step for every session of every tenant.

Every Rounds stream pushes its rounds into ONE queue. A step takes the first round (blocking),
then everything else already queued, whoever sent it; applies each sequence's reported tokens
(the verification outcome) to its drafter; groups the sequences that want drafts by (target
model, drafter, sampler, sparse or dense q) and calls `propose` once per group, so tenants of
the same model with the same sampler share one forward; then answers each round on its own
stream, with dense q rows following on that tenant's tensor channel.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from specpool.engine.sampling import SamplingParams
from specpool.spec_endpoint.channels import TenantChannels
from specpool.spec_endpoint.messages import (
    MAX_DRAFT_TOKENS,
    RESOLUTIONS,
    DrafterKind,
    FieldError,
    OutcomeTable,
    Round,
    RoundResult,
    SequenceDrafts,
    SequenceRound,
)
from specpool.spec_endpoint.metrics import EndpointMetrics
from specpool.spec_endpoint.registry import DrafterRegistry
from specpool.spec_endpoint.sessions import Session, SessionKey, SessionTable

from specpool.common.tensor_channel import ChannelError

log = logging.getLogger(__name__)

SESSION_NOT_FOUND = "session not found: open it again"
NO_CHANNEL = "dense q needs a tensor channel: call OpenTensorChannel"


class RoundStream:
    """One Rounds call: its replies in order. None ends the stream; a FieldError aborts it."""

    def __init__(self) -> None:
        self.outbound: queue.Queue[RoundResult | FieldError | None] = queue.Queue()

    def fail(self, error: FieldError) -> None:
        self.outbound.put(error)

    def cancel(self) -> None:
        """The client went away: wake the reply generator. Its sessions stay until their lease ends."""
        self.outbound.put(None)


@dataclass(frozen=True, slots=True)
class _Queued:
    stream: RoundStream
    round: Round | None  # None: the stream's input ended (answer it after its earlier rounds)
    arrived: float = 0.0  # monotonic seconds


@dataclass(slots=True)
class _RoundWork:
    stream: RoundStream
    round: Round
    results: list[SequenceDrafts]
    arrived: float = 0.0
    channel: Any = None  # PairChannel of the tenant, when a sequence sends dense q
    vocab_size: int = 0  # of the dense rows
    dense: dict[int, torch.Tensor] = field(default_factory=dict)  # sequence index -> [n, V] q rows
    draft_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class _Want:
    work: _RoundWork
    index: int
    session: Session
    num: int


GroupKey = tuple[str, DrafterKind, SamplingParams | None, bool]


def group_key(session: Session, dense: bool) -> GroupKey:
    """Sequences drafted by one propose call. The seed never matters (the endpoint samples from its
    own generator); greedy drafts ignore the sampler; n-gram drafts ignore it altogether."""
    if session.kind is DrafterKind.NGRAM:
        return (session.model, session.kind, None, False)
    params = SamplingParams() if session.params.greedy else dataclasses.replace(session.params, seed=None)
    return (session.model, session.kind, params, dense)


def split_conflicts(items: list[_Queued]) -> tuple[list[_Queued], list[_Queued]]:
    """-> (this step's items, the rest). A round that names a session an earlier round of this
    step already names waits for the next step, and so does everything after it on its stream."""
    now: list[_Queued] = []
    later: list[_Queued] = []
    seen: set[SessionKey] = set()
    blocked: set[int] = set()
    for item in items:
        if id(item.stream) in blocked:
            later.append(item)
            continue
        if item.round is not None:
            keys = {SessionKey(item.round.tenant, s.request_id) for s in item.round.sequences}
            if keys & seen:
                blocked.add(id(item.stream))
                later.append(item)
                continue
            seen |= keys
        now.append(item)
    return now, later


def _local_drafts_error(seq: SequenceRound, vocab_size: int) -> str:
    """Why SSD cannot pre-speculate after a round's local drafts ("" when it can)."""
    if not seq.new_tokens:  # the glue computes the first draft's row from the last new token
        return "new_tokens: empty, but local drafts follow the tokens emitted since the previous round"
    if len(seq.drafts_in_use) > MAX_DRAFT_TOKENS:
        return f"drafts_in_use: {len(seq.drafts_in_use)} drafts, over {MAX_DRAFT_TOKENS}"
    bad = next((t for t in seq.drafts_in_use if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"drafts_in_use: token id {bad} outside the vocabulary [0, {vocab_size})"
    return ""


class _StreamClock:
    """When a stream's rounds arrive: the last one and a moving average of the gap between them."""

    def __init__(self) -> None:
        self.last = 0.0
        self.period = 0.0

    def arrived(self, now: float) -> None:
        if self.last:
            gap = now - self.last
            self.period = gap if not self.period else 0.7 * self.period + 0.3 * gap
        self.last = now

    @property
    def next_at(self) -> float:
        return self.last + self.period

    def busy(self, now: float) -> bool:
        return self.period > 0 and now - self.last < 2 * self.period


class Batcher:
    def __init__(
        self,
        registry: DrafterRegistry,
        sessions: SessionTable,
        metrics: EndpointMetrics,
        lock: threading.RLock,
        channels: TenantChannels,
        drop: Callable[[Session], None],
        clock: Callable[[], float] = time.monotonic,
        window_s: float = 0.0,
    ):
        self.registry = registry
        self.sessions = sessions
        self.metrics = metrics
        self.lock = lock  # held while drafters change: also by open, close and expiry
        self.channels = channels
        self.drop = drop
        self.clock = clock
        self.submitted = 0  # rounds queued so far
        # The longest a step waits for another busy stream's round, so that tenants share one forward.
        self.window_s = window_s
        self._clocks: dict[int, _StreamClock] = {}  # id(stream) -> its round arrivals
        self._queue: queue.Queue[_Queued] = queue.Queue()
        self._carry: list[_Queued] = []
        self._to_prespeculate: dict[str, list[Session]] = {}  # SSD: model -> sessions with fresh drafts

    def submit(self, stream: RoundStream, round: Round) -> None:
        self.submitted += 1
        now = time.monotonic()
        self._clocks.setdefault(id(stream), _StreamClock()).arrived(now)
        self._queue.put(_Queued(stream, round, now))

    def end(self, stream: RoundStream) -> None:
        self._clocks.pop(id(stream), None)
        self._queue.put(_Queued(stream, None))

    def wake(self) -> None:
        """Unblocks a waiting run_once (to stop the loop without waiting out its poll)."""
        self._queue.put(_Queued(RoundStream(), None))

    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.run_once(timeout_s=0.25)
            except Exception:  # a bug in one step must not stop drafting for everyone
                log.exception("engine step failed")

    def run_once(self, timeout_s: float = 0.0) -> bool:
        """One engine step over everything queued (waiting up to timeout_s for the first round)."""
        items, self._carry = self._carry, []
        if not items:
            try:
                items = [self._queue.get(timeout=timeout_s) if timeout_s > 0 else self._queue.get_nowait()]
            except queue.Empty:
                return False
        self._wait_for_busy_streams(items)
        with self.lock:
            # Drain under the lock: rounds that arrive while another thread holds it join this step.
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            items, self._carry = split_conflicts(items)
            works = self._step(items)
        self._deliver(works)
        if self._to_prespeculate:
            with self.lock:
                tables = self._prespeculate()
            self._push(tables)
        return True

    def _wait_for_busy_streams(self, items: list[_Queued]) -> None:
        """Wait (at most window_s, and at most half this stream's round period) for the rounds other
        busy streams are expected to send: tenants then share one forward, and as their replies leave
        together their next rounds arrive together too. Whichever stream comes first waits, so any
        two streams with similar periods fall into step within a round or two."""
        if self.window_s <= 0:
            return
        now = time.monotonic()
        present = {id(i.stream) for i in items}
        own = min((self._clocks[s].period for s in present if s in self._clocks), default=0.0)
        budget = min(self.window_s, own / 2)
        expected = {s: c.next_at for s, c in self._clocks.items()
                    if s not in present and c.busy(now) and c.next_at - now <= budget}
        until = max(expected.values(), default=now) + 0.002  # a little slack for jitter
        while not set(expected) <= {id(i.stream) for i in items}:
            left = min(until, now + budget) - time.monotonic()
            if left <= 0:
                return
            try:
                items.append(self._queue.get(timeout=left))
            except queue.Empty:
                return

    # -- one step ------------------------------------------------------------------------------

    def _step(self, items: list[_Queued]) -> list[_RoundWork | RoundStream]:
        now = self.clock()
        out: list[_RoundWork | RoundStream] = []
        groups: dict[GroupKey, list[_Want]] = {}
        for item in items:
            if item.round is None:
                out.append(item.stream)
                continue
            work = _RoundWork(item.stream, item.round, [SequenceDrafts(s.request_id) for s in item.round.sequences],
                              arrived=item.arrived)
            self.metrics.rounds.labels(self.metrics.tenants.of(item.round.tenant)).inc()
            seen: set[str] = set()
            for i in range(len(item.round.sequences)):
                want = self._apply(work, i, seen, now)
                if want is not None:
                    groups.setdefault(group_key(want.session, want.work.results[i].dense), []).append(want)
            out.append(work)
        seconds = sum(self._draft(key, wants) for key, wants in groups.items())
        if groups:
            self.metrics.draft_seconds.observe(seconds)
        return out

    def _apply(self, work: _RoundWork, i: int, seen: set[str], now: float) -> _Want | None:
        """Apply sequence i's outcome to its drafter; -> what it wants drafted, if anything."""
        seq = work.round.sequences[i]
        out = work.results[i]
        if seq.request_id in seen:
            out.error = f"sequences[{i}].request_id: {seq.request_id!r} appears twice in this round"
            return None
        seen.add(seq.request_id)
        session = self.sessions.get(SessionKey(work.round.tenant, seq.request_id))
        if session is None:
            out.error = SESSION_NOT_FOUND
            return None
        if seq.resolution not in RESOLUTIONS:  # before the outcome is recorded: the session is out of step now
            self.drop(session)
            out.error = f"sequences[{i}].resolution: unknown value {seq.resolution}; session closed"
            return None
        drafters = self.registry.get(session.model)
        session.renew(now)
        length = session.length + len(seq.new_tokens)
        if length > drafters.max_len:  # the context cap holds as a session grows too
            self.drop(session)
            out.error = (f"sequences[{i}].new_tokens: the session would hold {length} tokens, over this endpoint's "
                         f"max length {drafters.max_len} (--max-len); session closed, draft locally")
            return None
        bad = next((t for t in seq.new_tokens if not 0 <= t < drafters.vocab_size), None)
        if bad is not None:
            self.drop(session)
            out.error = (
                f"sequences[{i}].new_tokens: token id {bad} outside the vocabulary [0, {drafters.vocab_size}); "
                "session closed"
            )
            return None
        accepted = session.record_outcome(seq.new_tokens)
        if session.kind is not DrafterKind.SSD:
            drafters.drafter(session.kind).observe(session.key.drafter_id, seq.new_tokens)
        else:
            if seq.resolution == "local_drafts":  # pre-speculation feeds them, with every SSD session's forks
                error = _local_drafts_error(seq, drafters.vocab_size)
                if error:
                    self.drop(session)
                    out.error = f"sequences[{i}].{error}; session closed"
                    return None
            # When the outcome arrived, not when this step got to it: SSD sizes its forks by that.
            drafters.ssd.observe(session.key.drafter_id, seq.new_tokens, arrived_at=work.arrived)
            session.stream = work.stream
            if seq.resolution == "local_drafts":
                # Push mode, a miss the target drafted itself: pre-speculate after its drafts.
                drafters.ssd.adopt(session.key.drafter_id, list(seq.drafts_in_use))
                session.last_drafts, session.needs_tokens = tuple(seq.drafts_in_use), True
                self._to_prespeculate.setdefault(session.model, []).append(session)
                return None
        if accepted:
            self.sessions.count(session.key.tenant, accepted=accepted)
            self.metrics.accepted.labels(self.metrics.tenants.of(session.key.tenant), session.model).inc(accepted)

        n = seq.num_draft_tokens
        if not 0 <= n <= MAX_DRAFT_TOKENS:
            out.error = f"sequences[{i}].num_draft_tokens: {n} outside [0, {MAX_DRAFT_TOKENS}]"
            return None
        if n == 0:
            return None
        if session.kind in (DrafterKind.DRAFT_MODEL, DrafterKind.SSD):
            if session.needs_tokens:
                out.error = (
                    f"sequences[{i}].new_tokens: empty, but the draft model continues from the tokens "
                    "emitted since its previous drafts (open the session again to redraft)"
                )
                return None
            n = min(n, drafters.max_len - session.length + 1)  # its tokens and n - 1 fed drafts fit in max_len
            out.dense = not session.params.greedy and session.dense
        if out.dense:
            work.channel = work.channel or self.channels.get(work.round.tenant)
            if work.channel is None:
                out.error, out.dense = NO_CHANNEL, False
                return None
            if work.vocab_size and work.vocab_size != drafters.vocab_size:
                out.error, out.dense = f"sequences[{i}]: dense rows of one round need one vocabulary size", False
                return None
            work.vocab_size = drafters.vocab_size
        return _Want(work, i, session, n)

    def _draft(self, key: GroupKey, wants: list[_Want]) -> float:
        """One propose call for a group; -> its seconds."""
        model, kind, params, _ = key
        drafters = self.registry.get(model)
        ids = [w.session.key.drafter_id for w in wants]
        nums = [w.num for w in wants]
        start = time.monotonic()  # the busy window's clock (self.clock times leases, and tests fake it)
        try:
            if kind is DrafterKind.DRAFT_MODEL:
                drafts = drafters.model.propose(ids, nums, params, drafters.generator, sparse=not key[3])
            elif kind is DrafterKind.SSD:
                drafts = drafters.ssd.propose(ids, nums, params or SamplingParams(), None)
                self._to_prespeculate.setdefault(model, []).extend(w.session for w in wants)
            else:
                drafts = drafters.ngram.propose(ids, nums, params or SamplingParams(), None)
        except Exception as exc:  # the drafter's state for these sequences is unknown now: drop them
            log.exception("drafting failed for %d sequences of %s", len(wants), model)
            for w in wants:
                self.drop(w.session)
                out = w.work.results[w.index]
                out.error, out.dense = f"internal: drafting failed ({exc}); session closed", False
            return 0.0
        end = time.monotonic()
        self.metrics.busy.add(start, end)
        tenants = {w.session.key.tenant for w in wants}
        self.metrics.draft_batches.inc()
        self.metrics.batch_tenants.observe(len(tenants))
        self.metrics.batch_sequences.observe(len(wants))
        if len(tenants) > 1:
            self.metrics.shared_batches.inc()

        for b, w in enumerate(wants):
            tokens = drafts.tokens[b]
            out = w.work.results[w.index]
            out.tokens = list(tokens)
            n = len(tokens)
            if drafts.topk_ids is not None:
                out.sparse_k = drafts.topk_ids.shape[-1]
                out.sparse_ids = drafts.topk_ids[b, :n].reshape(-1).tolist()
                out.sparse_probs = drafts.topk_probs[b, :n].reshape(-1).tolist()
            elif drafts.probs is not None:
                w.work.dense[w.index] = drafts.probs[b, :n].float()
            w.work.draft_seconds += end - start
            if kind is DrafterKind.SSD:
                out.from_cache = drafters.ssd.served_from_cache(w.session.key.drafter_id)
            w.session.record_drafts(tokens)
            tenant = w.session.key.tenant
            self.sessions.count(tenant, drafted=n)
            self.metrics.drafted.labels(self.metrics.tenants.of(tenant), model).inc(n)
        return end - start

    def _prespeculate(self) -> list[tuple[RoundStream, OutcomeTable]]:
        """SSD: build the speculation cache for the drafts just handed out (while the targets verify
        them); -> the outcome tables of push-mode sessions."""
        pending, self._to_prespeculate = self._to_prespeculate, {}
        tables = []
        for model, sessions in pending.items():
            ssd = self.registry.get(model).ssd
            live = [s for s in sessions if self.sessions.get(s.key) is s]
            start = time.monotonic()
            ssd.prespeculate([s.key.drafter_id for s in live])
            self.metrics.busy.add(start, time.monotonic())
            self.metrics.observe_ssd(model, ssd)
            for s in live:
                if s.push and s.stream is not None:
                    tables.append((s.stream, self._table(s, ssd)))
        return tables

    @staticmethod
    def _table(session: Session, ssd) -> OutcomeTable:
        entries = []
        for (k, bonus), fork in ssd.outcome_table(session.key.drafter_id).items():
            if fork.topk_ids is not None:
                sk = fork.topk_ids.shape[-1]
                entries.append((k, bonus, fork.drafts, fork.topk_ids.reshape(-1).tolist(),
                                fork.topk_probs.reshape(-1).tolist(), sk))
            else:
                entries.append((k, bonus, fork.drafts, [], [], 0))
        return OutcomeTable(session.key.request_id, list(session.last_drafts), entries,
                            fast_backup=ssd.choose_backup() == "fast")

    def _push(self, tables: list[tuple[RoundStream, OutcomeTable]]) -> None:
        by_stream: dict[int, tuple[RoundStream, list[OutcomeTable]]] = {}
        for stream, table in tables:
            by_stream.setdefault(id(stream), (stream, []))[1].append(table)
        for stream, batch in by_stream.values():
            stream.outbound.put(RoundResult(round_id=0, sequences=[], tables=batch))

    def _deliver(self, out: list[_RoundWork | RoundStream]) -> None:
        for item in out:
            if isinstance(item, RoundStream):
                item.outbound.put(None)
                continue
            rows = [item.dense[i] for i in sorted(item.dense)]
            dense = torch.cat(rows).contiguous() if rows else None
            item.stream.outbound.put(RoundResult(
                round_id=item.round.round_id,
                sequences=item.results,
                dense_rows=0 if dense is None else dense.shape[0],
                vocab_size=item.vocab_size if dense is not None else 0,
                draft_seconds=item.draft_seconds,
            ))
            if dense is not None:
                try:
                    item.channel.send(dense)
                except ChannelError as e:  # broken: the tenant's next dense round asks for a new channel
                    log.warning("sending dense q to tenant %s failed: %s", item.round.tenant, e)
                    self.channels.drop(item.round.tenant)
                    continue
                self.metrics.dense_bytes.inc(dense.numel() * dense.element_size())

