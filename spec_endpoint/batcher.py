# Over 400 lines: one engine step (outcomes, grouped drafts, replies) and its counters read best together.
"""The engine loop: one batched draft forward per step for every session of every tenant.

Every Rounds stream pushes its rounds into ONE queue. A step takes the first round (blocking),
then everything else already queued, whoever sent it; applies each sequence's reported tokens
(the verification outcome) to its drafter; groups the sequences that want drafts by (target
model, drafter, sampler, sparse or dense q) and calls `propose` once per group, so tenants of
the same model with the same sampler share one forward; then answers each round on its own
stream, with dense q rows following on that tenant's tensor channel. Drafters that pre-speculate
(SSD) then work while the targets verify (see prespeculation).
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

from specpool.common.tensor_channel import ChannelError
from specpool.engine.drafters.base import Drafter
from specpool.engine.method import MAX_DRAFT_TOKENS, Method
from specpool.engine.verification.sampling import SamplingParams
from specpool.spec_endpoint import prespeculation
from specpool.spec_endpoint.channels import TenantChannels
from specpool.spec_endpoint.drafters import HostedDrafters
from specpool.spec_endpoint.messages import RESOLUTIONS, Round, RoundResult, SequenceDrafts
from specpool.spec_endpoint.metrics import EndpointMetrics
from specpool.spec_endpoint.prespeculation import Prespeculation, local_drafts_error
from specpool.spec_endpoint.sessions import Session, SessionKey, SessionTable
from specpool.spec_endpoint.streams import Queued, RoundStream, StreamClock, split_conflicts

log = logging.getLogger(__name__)

SESSION_NOT_FOUND = "session not found: open it again"
NO_CHANNEL = "dense q needs a tensor channel: call OpenTensorChannel"


@dataclass(slots=True)
class _RoundWork:
    """One round in this step, and its reply as it is filled in."""

    stream: RoundStream  # the stream it came on, which its reply goes back on
    round: Round
    results: list[SequenceDrafts]  # [len(round.sequences)]: each sequence's part of the reply
    arrived: float = 0.0  # monotonic: when the round was queued
    channel: Any = None  # PairChannel of the tenant, when a sequence sends dense q
    vocab_size: int = 0  # of the dense rows
    dense: dict[int, torch.Tensor] = field(default_factory=dict)  # sequence index -> [n, V] q rows
    draft_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class _Want:
    """A sequence that wants drafts this step."""

    work: _RoundWork  # its round
    index: int  # its place in the round's sequences (and results)
    session: Session
    drafter: Drafter
    num: int  # drafts to propose, within the session's length cap


@dataclass(frozen=True, slots=True)
class DraftGroup:
    """What the sequences drafted by one propose call share (the key they are grouped by in a step)."""

    model: str  # the target model the drafter serves
    kind: Method  # the drafter
    params: SamplingParams | None  # its sampler, seed cleared; None: deterministic drafts ignore it
    dense: bool  # q rows [K, V] travel on the tensor channel (else sparse, or none)
    tree: bool  # token trees (else chains)


def group_key(session: Session, drafter: Drafter, dense: bool) -> DraftGroup:
    """Sequences drafted by one propose call: one model, drafter kind and draft shape (chain or tree).
    The seed never matters (the endpoint samples from its own generator); greedy drafts ignore the
    sampler; deterministic (n-gram) drafts ignore it altogether."""
    if drafter.caps.deterministic:
        return DraftGroup(session.model, session.kind, None, False, session.tree)
    params = SamplingParams() if session.params.greedy else dataclasses.replace(session.params, seed=None)
    return DraftGroup(session.model, session.kind, params, dense, session.tree)


class Batcher:
    def __init__(
        self,
        drafters: HostedDrafters,
        sessions: SessionTable,
        metrics: EndpointMetrics,
        lock: threading.RLock,
        channels: TenantChannels,
        drop: Callable[[Session], None],
        clock: Callable[[], float] = time.monotonic,
        window_s: float = 0.0,
    ):
        self.drafters = drafters
        self.sessions = sessions
        self.metrics = metrics
        self.lock = lock  # held while drafters change: also by open, close and expiry
        self.channels = channels
        self.drop = drop
        self.clock = clock
        self.submitted = 0  # rounds queued so far
        # The longest a step waits for another busy stream's round, so that tenants share one forward.
        self.window_s = window_s
        self._clocks: dict[int, StreamClock] = {}  # id(stream) -> its round arrivals
        self._queue: queue.Queue[Queued] = queue.Queue()
        self._carry: list[Queued] = []
        self._prespeculation = Prespeculation(drafters, sessions, metrics)
        self._forwards = drafters.forwards()  # counted into metrics after each step

    def submit(self, stream: RoundStream, round: Round) -> None:
        self.submitted += 1
        now = time.monotonic()
        self._clocks.setdefault(id(stream), StreamClock()).arrived(now)
        self._queue.put(Queued(stream, round, now))

    def end(self, stream: RoundStream) -> None:
        self._clocks.pop(id(stream), None)
        self._queue.put(Queued(stream, None))

    def wake(self) -> None:
        """Unblocks a waiting run_once (to stop the loop without waiting out its poll)."""
        self._queue.put(Queued(RoundStream(), None))

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
        if self._prespeculation.pending:  # while the targets verify the drafts just delivered
            with self.lock:
                tables = self._prespeculation.run()
            prespeculation.push(tables)
        self._count_forwards()
        return True

    def _count_forwards(self) -> None:
        forwards = self.drafters.forwards()
        for model, n in forwards.items():
            if (new := n - self._forwards.get(model, 0)) > 0:
                self.metrics.draft_forwards.labels(model).inc(new)
        self._forwards = forwards

    def _wait_for_busy_streams(self, items: list[Queued]) -> None:
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
        # A little slack for jitter; a round already overdue comes any moment: the whole budget.
        overdue = any(at <= now for at in expected.values())
        until = now + budget if overdue else max(expected.values(), default=now) + 0.002
        while not set(expected) <= {id(i.stream) for i in items}:
            left = min(until, now + budget) - time.monotonic()
            if left <= 0:
                return
            try:
                items.append(self._queue.get(timeout=left))
            except queue.Empty:
                return

    # -- one step ------------------------------------------------------------------------------

    def _step(self, items: list[Queued]) -> list[_RoundWork | RoundStream]:
        now = self.clock()
        out: list[_RoundWork | RoundStream] = []
        groups: dict[DraftGroup, list[_Want]] = {}
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
                    key = group_key(want.session, want.drafter, want.work.results[i].dense)
                    groups.setdefault(key, []).append(want)
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
        drafters = self.drafters.get(session.model)
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
        drafter = drafters.drafter(session.kind)
        inputs, problem = self._inputs(work.round, i, session, drafter, drafters.feature_dim)
        if problem:
            self.drop(session)
            out.error = f"{problem}; session closed"
            return None
        accepted = session.record_outcome(seq.new_tokens)
        self.metrics.target_tokens.labels(session.model).inc(len(seq.new_tokens))
        ssd = drafters.prespeculating.get(session.kind)
        adopts = seq.resolution == "local_drafts" and ssd is not None
        if adopts:  # pre-speculation feeds them, with every session's forks of that drafter
            error = local_drafts_error(seq, drafters.vocab_size)
            if error:
                self.drop(session)
                out.error = f"sequences[{i}].{error}; session closed"
                return None
        if ssd is not None:  # when the outcome arrived, not when this step got to it: SSD sizes its forks by that
            ssd.outcome_arrived(session.key.drafter_id, work.arrived)
        drafter.observe(session.key.drafter_id, seq.new_tokens, **inputs)
        session.stream = work.stream
        if adopts:
            # Push mode, a miss the target drafted itself: pre-speculate after its drafts.
            ssd.adopt(session.key.drafter_id, list(seq.drafts_in_use))
            session.last_drafts, session.needs_tokens = tuple(seq.drafts_in_use), True
            self._prespeculation.add(ssd, [session])
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
        if drafter.caps.kv_cache:  # a draft model
            if session.needs_tokens:
                out.error = (
                    f"sequences[{i}].new_tokens: empty, but the draft model continues from the tokens "
                    "emitted since its previous drafts (open the session again to redraft)"
                )
                return None
            n = min(n, drafters.max_len - session.length + 1)  # its tokens and n - 1 fed drafts fit in max_len
            out.dense = session.dense
        if out.dense:
            work.channel = work.channel or self.channels.get(work.round.tenant)
            if work.channel is None:
                out.error, out.dense = NO_CHANNEL, False
                return None
            if work.vocab_size and work.vocab_size != drafters.vocab_size:
                out.error, out.dense = f"sequences[{i}]: dense rows of one round need one vocabulary size", False
                return None
            work.vocab_size = drafters.vocab_size
        return _Want(work, i, session, drafter, n)

    @staticmethod
    def _inputs(round: Round, i: int, session: Session, drafter: Drafter, feature_dim: int) -> tuple[dict, str]:
        """What a feature-fed drafter observes with sequence i's new tokens -> (observe's keyword arguments,
        why the session must close). Its first round starts the drafter with the context's features."""
        seq = round.sequences[i]
        if not drafter.caps.features:
            if seq.num_features:
                return {}, f"sequences[{i}].num_features: {seq.num_features}, but this session's drafter reads none"
            return {}, ""
        if round.features_error:
            return {}, round.features_error
        context = session.unstarted_context
        expected = len(seq.new_tokens) + (len(context) - 1 if context is not None else 0)
        if seq.num_features != expected:
            why = "one per new token" + (", and per context token but the last in a session's first round"
                                         if context is not None else "")
            return {}, f"sequences[{i}].num_features: {seq.num_features}, expected {expected} ({why})"
        if round.feature_dim != feature_dim:
            return {}, f"feature_dim: {round.feature_dim}, but this model's drafter reads features of {feature_dim}"
        features = seq.features
        if context is not None:
            try:
                drafter.start(session.key.drafter_id, context, features=features[: len(context) - 1])
            except RuntimeError as e:  # every KV slot is taken (opens count only started sessions)
                return {}, f"capacity: {e}"
            session.unstarted_context, features = None, features[len(context) - 1 :]
        return {"features": features}, ""

    def _draft(self, group: DraftGroup, wants: list[_Want]) -> float:
        """One propose call for a group; -> its seconds."""
        model = group.model
        drafters = self.drafters.get(model)
        drafter = drafters.drafter(group.kind)
        ssd = drafters.prespeculating.get(group.kind)
        ids = [w.session.key.drafter_id for w in wants]
        nums = [w.num for w in wants]
        q_form = {"sparse": not group.dense} if drafter.caps.sparse_q_per_call else {}
        if group.tree:
            q_form["tree"] = drafters.tree_shape
        start = time.monotonic()  # the busy window's clock (self.clock times leases, and tests fake it)
        try:
            drafts = drafter.propose(ids, nums, group.params or SamplingParams(), drafters.generator, **q_form)
            self._prespeculation.add(ssd, [w.session for w in wants])
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
            parents = drafts.parents[b] if drafts.parents is not None else None
            out.parents = list(parents or [])
            n = len(tokens)
            if drafts.topk_ids is not None:
                out.sparse_k = drafts.topk_ids.shape[-1]
                out.sparse_ids = drafts.topk_ids[b, :n].reshape(-1).tolist()
                out.sparse_probs = drafts.topk_probs[b, :n].reshape(-1).tolist()
            elif drafts.probs is not None:
                w.work.dense[w.index] = drafts.probs[b, :n].float()
            w.work.draft_seconds += end - start
            out.from_cache = ssd is not None and ssd.served_from_cache(w.session.key.drafter_id)
            w.session.record_drafts(tokens, parents)
            tenant = w.session.key.tenant
            self.sessions.count(tenant, drafted=n)
            self.metrics.drafted.labels(self.metrics.tenants.of(tenant), model).inc(n)
        return end - start

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

