"""The endpoint's domain API: sessions, rounds, tensor channels and capacity, without gRPC.

The servicer wraps one Endpoint; tests drive it directly (with a LoopbackChannel for dense q).
One lock guards the drafters: the engine step holds it while it drafts, and opening, closing and
expiring sessions take it, so a KV slot never changes hands mid-forward.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specpool.common.errors import FieldError, StatusCode
from specpool.common.speculation import q_travels_dense
from specpool.common.tensor_channel import ChannelError
from specpool.engine.method import Method
from specpool.spec_endpoint.batcher import Batcher
from specpool.spec_endpoint.channels import TenantChannels
from specpool.spec_endpoint.drafters import HostedDrafters, ModelDrafters
from specpool.spec_endpoint.messages import (
    CapacityReport,
    ModelReport,
    OpenRequest,
    OpenResult,
    Round,
    SessionSpec,
    TenantReport,
    Transport,
    context_too_long,
)
from specpool.spec_endpoint.metrics import EndpointMetrics
from specpool.spec_endpoint.sessions import Session, SessionKey, SessionTable
from specpool.spec_endpoint.streams import RoundStream

if TYPE_CHECKING:
    from specpool.common.tensor_channel import ChannelHost, ChannelOffer
    from specpool.engine.drafters.lookup import NgramIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EndpointConfig:
    max_sessions: int = 64
    max_sessions_per_tenant: int = 0  # 0: no cap below max_sessions
    max_len: int = 2048  # tokens a session may hold, every drafter kind (wire refuses longer contexts)
    lease_s: float = 30.0  # for sessions opened with lease_s 0
    max_lease_s: float = 120.0  # longer requested leases are clamped to it
    tenant_labels: int = 64  # tenants named in metric labels (see metrics.TenantLabels)
    endpoint_id: str = ""
    batch_window_s: float = 0.0  # see Batcher.window_s


class Endpoint:
    def __init__(
        self,
        drafters: HostedDrafters,
        config: EndpointConfig,
        channel_host: ChannelHost | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.drafters = drafters
        self.config = config
        self.channels = TenantChannels(channel_host)
        self.clock = clock
        self.metrics = EndpointMetrics(tenant_labels=config.tenant_labels)
        self.metrics.max_sessions.set(config.max_sessions)
        self.sessions = SessionTable(clock, label=self.metrics.tenants.of)
        self.lock = threading.RLock()
        self.batcher = Batcher(drafters, self.sessions, self.metrics, self.lock, self.channels, self._drop, clock,
                               config.batch_window_s)
        self._streams: set[RoundStream] = set()
        self._stop = threading.Event()
        self._documents = 0  # suffix-store documents opened: each n-gram session's gets a fresh id
        # The most feature rows a round can need: every session's whole context (the first rounds after a
        # re-attach). A larger declaration is refused before anything is allocated for it.
        self.max_feature_rows = config.max_sessions * config.max_len
        stores = [d.suffix for d in drafters.models.values() if d.suffix is not None]
        self.metrics.suffix_tokens.set_function(lambda: self._locked(lambda: sum(s.num_tokens for s in stores)))
        self.metrics.suffix_stores.set_function(lambda: self._locked(lambda: sum(len(s) for s in stores)))
        self._threads: list[threading.Thread] = []

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        sweep_s = max(0.05, min(1.0, self.config.lease_s / 4))
        self._threads = [
            threading.Thread(target=self.batcher.run_forever, args=(self._stop,), name="spec-engine", daemon=True),
            threading.Thread(target=self._sweep_forever, args=(sweep_s,), name="spec-lease-sweeper", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def drain(self) -> None:
        """End every open Rounds stream (its client sees the stream finish), so a server can stop."""
        for stream in list(self._streams):
            stream.cancel()

    def stop(self) -> None:
        self._stop.set()
        self.batcher.wake()
        self.drain()
        for t in self._threads:
            t.join(timeout=5.0)
        self.channels.close()

    def _sweep_forever(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.expire_idle()
            except Exception:
                log.exception("lease sweep failed")

    # -- sessions ------------------------------------------------------------------------------

    def open_sessions(self, request: OpenRequest) -> list[OpenResult]:
        """Opens (or re-opens) each session; -> one result per session, ok=False (with the field and why)
        on capacity or a session's own bad input. Raises FieldError (nothing opened) for an unknown model."""
        drafters = self.drafters.get(request.target_model)
        if drafters is None:
            raise FieldError(
                "target_model",
                f"no drafters for {request.target_model!r}; this endpoint serves {self.drafters.names()}",
                StatusCode.NOT_FOUND,
            )
        # Clamped rather than refused: a lease only bounds how long an abandoned session holds its slot.
        lease_s = min(request.lease_s or self.config.lease_s, self.config.max_lease_s)
        # n-gram contexts are indexed before the engine lock is taken: under it, indexing 64 sessions
        # of --max-len tokens would stall every tenant's rounds for about 0.6 s.
        ngram = drafters.ngram
        indexes = [ngram.index(spec.context)
                   if ngram is not None and (spec.drafter or drafters.best) is Method.NGRAM
                   and len(spec.context) <= drafters.max_len else None for spec in request.sessions]
        with self.lock:
            results = [self._open(request.tenant, drafters, f"sessions[{i}]", spec, index, lease_s)
                       for i, (spec, index) in enumerate(zip(request.sessions, indexes))]
        self._update_active(request.tenant)
        return results

    def _open(self, tenant: str, drafters: ModelDrafters, path: str, spec: SessionSpec, index: NgramIndex | None,
              lease_s: float) -> OpenResult:
        key = SessionKey(tenant, spec.request_id)
        old = self.sessions.get(key)
        if old is not None:
            self._drop(old)
        refused = spec.refused or _vocabulary_problem(path, spec, drafters.vocab_size)
        if refused:  # this session's own input: the request's other sessions still open
            return OpenResult(spec.request_id, False, refused)
        if len(spec.context) > drafters.max_len:
            return OpenResult(spec.request_id, False, context_too_long(path, len(spec.context), drafters.max_len))
        kind = spec.drafter or drafters.best
        if kind not in drafters.kinds:
            return OpenResult(spec.request_id, False, f"drafter: {drafters.name} has no {kind.value} drafter here; "
                              f"it has {[k.value for k in drafters.kinds]}")
        if len(self.sessions) >= self.config.max_sessions:
            return OpenResult(spec.request_id, False,
                              f"capacity: this endpoint holds its maximum of {self.config.max_sessions} sessions")
        per_tenant = self.config.max_sessions_per_tenant
        if per_tenant and self.sessions.active(tenant) >= per_tenant:
            return OpenResult(spec.request_id, False,
                              f"capacity: tenant {tenant!r} holds its maximum of {per_tenant} sessions on this "
                              "endpoint (--max-sessions-per-tenant); close finished ones or draft locally")
        drafter = drafters.drafter(kind)
        if spec.tree and not drafter.caps.grows_trees:
            return OpenResult(spec.request_id, False, f"{path}.tree: the {kind.value} drafter proposes chains only; "
                              "open the session without tree, or with the draft_model or ngram drafter")
        if drafter.caps.kv_cache and drafter.cache.free_slots == 0:
            return OpenResult(spec.request_id, False,
                              f"capacity: all {drafter.cache.max_slots} {kind.value} KV slots for "
                              f"{drafters.name} are in use")
        if index is not None:
            drafters.ngram.add_index(key.drafter_id, index)
            store = drafters.suffix_store(tenant)
            if store is not None:  # a fresh document each open: a re-opened session re-sends its context
                self._documents += 1
                drafters.ngram.attach_store(key.drafter_id, store, f"{key.drafter_id}#{self._documents}")
        reads_features = drafter.caps.features
        if index is None and not reads_features:  # a feature-fed drafter starts with the first round's features
            drafter.start(key.drafter_id, spec.context)
        self.metrics.tenants.admit(tenant)
        now = self.clock()
        self.sessions.add(Session(
            key=key, model=drafters.name, kind=kind, params=spec.params,
            dense=not spec.tree and q_travels_dense(spec.params, kind, spec.transport is Transport.DENSE),
            lease_s=lease_s, expires_at=now + lease_s, length=len(spec.context), push=spec.push, tree=spec.tree,
            unstarted_context=spec.context if reads_features else None,
        ))
        return OpenResult(spec.request_id, True, drafter=kind, reads_features=reads_features)

    def close_sessions(self, tenant: str, request_ids: Sequence[str]) -> int:
        closed = 0
        with self.lock:
            for request_id in request_ids:
                session = self.sessions.get(SessionKey(tenant, request_id))
                if session is not None:
                    self._drop(session)
                    closed += 1
        return closed

    def expire_idle(self) -> int:
        """Close sessions whose lease ran out (no round mentioned them for lease_s); -> how many."""
        with self.lock:
            expired = self.sessions.pop_expired(self.clock())
            for session in expired:
                self._remove_from_drafter(session)
        for tenant in {s.key.tenant for s in expired}:
            self._update_active(tenant)
        if expired:
            self.metrics.sessions_expired.inc(len(expired))
            log.info("expired %d idle sessions", len(expired))
        return len(expired)

    def _drop(self, session: Session) -> None:
        """Forget a session (the caller holds the lock)."""
        if self.sessions.get(session.key) is session:
            self.sessions.pop(session.key)
        self._remove_from_drafter(session)
        self._update_active(session.key.tenant)

    def _remove_from_drafter(self, session: Session) -> None:
        self.drafters.get(session.model).drafter(session.kind).release(session.key.drafter_id)

    def _update_active(self, tenant: str) -> None:
        label = self.metrics.tenants.of(tenant)
        self.metrics.active_sessions.labels(label).set(self.sessions.active_labelled(label))

    # -- rounds --------------------------------------------------------------------------------

    def open_stream(self) -> RoundStream:
        stream = RoundStream()
        self._streams.add(stream)
        return stream

    def submit(self, stream: RoundStream, round: Round) -> None:
        self.batcher.submit(stream, round)

    def receive_features(self, round: Round) -> Round:
        """The round with each sequence's rows of the feature tensor that follows it on the tenant's tensor
        channel. Called on the stream's own reader thread, in the order its rounds arrive: a slow or
        silent sender holds up only its own stream. A round whose features cannot be read carries
        `features_error` (its feature-reading sessions close, and the target re-opens them); the channel
        is dropped then too, since what is left on it is out of step."""
        if not any(s.num_features for s in round.sequences):
            return round
        total = sum(max(s.num_features, 0) for s in round.sequences)
        problem = ""
        bad = next((i for i, s in enumerate(round.sequences) if s.num_features < 0), None)
        if bad is not None:
            problem = f"sequences[{bad}].num_features: {round.sequences[bad].num_features} is negative"
        elif round.feature_dim <= 0:
            problem = f"feature_dim: {round.feature_dim}; name the width of the features that follow"
        elif round.feature_dim > max(d.feature_dim for d in self.drafters.models.values()):
            problem = f"feature_dim: {round.feature_dim} is wider than any hosted model's features"
        elif total > self.max_feature_rows:
            problem = (f"num_features: {total} rows, more than the {self.max_feature_rows} this endpoint's sessions "
                       "can hold (--max-sessions x --max-len)")
        channel = None if problem else self.channels.get(round.tenant)
        if not problem and channel is None:
            problem = "features need a tensor channel: call OpenTensorChannel"
        features = None
        if not problem:
            try:
                features = channel.recv((total, round.feature_dim), torch.float16)
            except ChannelError as e:
                problem = f"features: receiving them failed ({e})"
        if features is not None and not torch.isfinite(features).all():
            problem = "features: non-finite values"
        if problem:
            log.warning("round %d of tenant %s: %s", round.round_id, round.tenant, problem)
            self.channels.drop(round.tenant)
            return dataclasses.replace(round, features_error=problem)
        rows, sequences = 0, []
        for s in round.sequences:
            sequences.append(dataclasses.replace(s, features=features[rows : rows + s.num_features]))
            rows += s.num_features
        return dataclasses.replace(round, sequences=tuple(sequences))

    def end_stream(self, stream: RoundStream) -> None:
        """The stream's input ended: answer its queued rounds, then end it."""
        self.batcher.end(stream)

    def forget_stream(self, stream: RoundStream) -> None:
        self._streams.discard(stream)

    # -- tensor channels -----------------------------------------------------------------------

    def offer_channel(self, tenant: str) -> ChannelOffer:
        return self.channels.offer(tenant)

    # -- capacity ------------------------------------------------------------------------------

    def _locked(self, read: Callable[[], float]) -> float:
        """A figure of drafter state read from another thread (a metrics scrape): under the engine lock."""
        with self.lock:
            return read()

    def capacity(self) -> CapacityReport:
        models = tuple(
            ModelReport(d.name, d.kinds, d.draft_costs) for d in (self.drafters.get(n) for n in self.drafters.names())
        )
        tenants = tuple(
            TenantReport(tenant, active, totals.drafted, totals.accepted)
            for tenant, active, totals in self.sessions.tenants()
        )
        ssd = [d.drafters[Method.SSD].stats for d in self.drafters.models.values() if Method.SSD in d.drafters]
        lookups = sum(st.lookups for st in ssd)
        return CapacityReport(
            endpoint_id=self.config.endpoint_id,
            max_sessions=self.config.max_sessions,
            active_sessions=len(self.sessions),
            draft_busy_ratio=self.metrics.busy.ratio(),
            models=models,
            tenants=tenants,
            ssd_hit_ratio=sum(st.hits for st in ssd) / lookups if lookups else 0.0,
        )


def _vocabulary_problem(path: str, spec: SessionSpec, vocab_size: int) -> str:
    bad = next((t for t in spec.context if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"{path}.context: token id {bad} outside the vocabulary [0, {vocab_size})"
    if spec.params.top_k > vocab_size:
        return f"{path}.sampling.top_k: {spec.params.top_k} exceeds the vocabulary size {vocab_size}"
    return ""
