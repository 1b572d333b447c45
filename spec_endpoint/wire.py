"""protobuf <-> domain for the SpeculationService, with the checks that need no model.

Decoders raise FieldError naming the field (`sessions[3].sampling.top_p`); checks that need the
target model (known model, vocabulary) happen in the endpoint.
"""

from __future__ import annotations

import math

from specpool.engine.sampling import SamplingParams
from specpool.spec_endpoint.messages import (
    CapacityReport,
    DrafterKind,
    FieldError,
    OpenRequest,
    OpenResult,
    Round,
    RoundResult,
    SequenceRound,
    SessionSpec,
    Transport,
    context_too_long,
)

from specpool.v1 import speculation_pb2 as pb
from specpool.v1 import target_pb2

_KIND_FROM_PB = {pb.DRAFTER_KIND_UNSPECIFIED: None, pb.DRAFTER_KIND_DRAFT_MODEL: DrafterKind.DRAFT_MODEL,
                 pb.DRAFTER_KIND_NGRAM: DrafterKind.NGRAM, pb.DRAFTER_KIND_SSD: DrafterKind.SSD}
_KIND_TO_PB = {v: k for k, v in _KIND_FROM_PB.items() if v is not None}
_RESOLUTION_FROM_PB = {pb.ROUND_RESOLUTION_ASK: "ask", pb.ROUND_RESOLUTION_TABLE_HIT: "table_hit",
                       pb.ROUND_RESOLUTION_LOCAL_DRAFTS: "local_drafts"}
_TRANSPORT_FROM_PB = {pb.DISTRIBUTION_TRANSPORT_AUTO: Transport.AUTO, pb.DISTRIBUTION_TRANSPORT_SPARSE: Transport.SPARSE,
                      pb.DISTRIBUTION_TRANSPORT_DENSE: Transport.DENSE}


def tenant_from(value: str) -> str:
    if not value:
        raise FieldError("tenant", "empty; name the target service (its service id)")
    return value


def sampling_from(path: str, msg: target_pb2.SamplingParams) -> SamplingParams:
    if not math.isfinite(msg.temperature) or msg.temperature < 0:
        raise FieldError(f"{path}.temperature", f"{msg.temperature} must be >= 0 (0: greedy)")
    if not 0.0 <= msg.top_p <= 1.0:  # NaN fails too
        raise FieldError(f"{path}.top_p", f"{msg.top_p} outside [0, 1] (0 or 1: no nucleus truncation)")
    if msg.top_k < 0:
        raise FieldError(f"{path}.top_k", f"{msg.top_k} must be >= 0 (0: no top-k truncation)")
    return SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.top_p > 0 else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
    )


def open_request_from(msg: pb.OpenSessionsRequest, max_len: int, tenant: str) -> OpenRequest:
    """A session whose context exceeds max_len is refused here, per session, before its tokens
    become Python ints: a 400k-token context then costs the engine nothing. tenant: the caller's."""
    if not msg.target_model:
        raise FieldError("target_model", "empty; name the target model (its GGUF file name without .gguf)")
    if not math.isfinite(msg.lease_s) or msg.lease_s < 0:
        raise FieldError("lease_s", f"{msg.lease_s} must be >= 0 seconds (0: the endpoint's default)")
    sessions = []
    for i, s in enumerate(msg.sessions):
        path = f"sessions[{i}]"
        if not s.request_id:
            raise FieldError(f"{path}.request_id", "empty")
        if not s.context:
            raise FieldError(f"{path}.context", "empty; send the prompt plus the tokens emitted so far")
        if len(s.context) > max_len:
            sessions.append(SessionSpec(s.request_id, (), SamplingParams(),
                                        refused=context_too_long(path, len(s.context), max_len)))
            continue
        if s.drafter not in _KIND_FROM_PB:
            raise FieldError(f"{path}.drafter", f"unknown drafter kind {s.drafter}")
        if s.transport not in _TRANSPORT_FROM_PB:
            raise FieldError(f"{path}.transport", f"unknown distribution transport {s.transport}")
        sessions.append(SessionSpec(
            request_id=s.request_id,
            context=tuple(s.context),
            params=sampling_from(f"{path}.sampling", s.sampling),
            drafter=_KIND_FROM_PB[s.drafter],
            transport=_TRANSPORT_FROM_PB[s.transport],
            push=s.push,
        ))
    return OpenRequest(tenant, msg.target_model, msg.lease_s, tuple(sessions))


def open_response_to(results: list[OpenResult]) -> pb.OpenSessionsResponse:
    return pb.OpenSessionsResponse(sessions=[
        pb.OpenedSession(
            request_id=r.request_id, ok=r.ok, error=r.error,
            drafter=_KIND_TO_PB[r.drafter] if r.drafter else pb.DRAFTER_KIND_UNSPECIFIED,
        )
        for r in results
    ])


def round_from(msg: pb.RoundRequest, tenant: str | None = None) -> Round:
    """Per-sequence problems (unknown session, bad num_draft_tokens) are answered per sequence.
    tenant: the caller's; None (an --insecure endpoint) takes the message's own field."""
    return Round(
        tenant=tenant if tenant is not None else tenant_from(msg.tenant),
        round_id=msg.round_id,
        sequences=tuple(
            SequenceRound(s.request_id, tuple(s.new_tokens), s.num_draft_tokens,
                          _RESOLUTION_FROM_PB.get(s.resolution, str(s.resolution)), tuple(s.drafts_in_use))
            for s in msg.sequences
        ),
    )


def round_response_to(result: RoundResult) -> pb.RoundResponse:
    sequences = []
    for s in result.sequences:
        out = pb.SequenceDrafts(request_id=s.request_id, tokens=s.tokens, dense_on_channel=s.dense, error=s.error,
                                from_cache=s.from_cache)
        if s.sparse_k:
            out.sparse.CopyFrom(pb.SparseDistribution(k=s.sparse_k, ids=s.sparse_ids, probs=s.sparse_probs))
        sequences.append(out)
    tables = [
        pb.OutcomeTable(request_id=t.request_id, follows=t.follows, fast_backup=t.fast_backup, entries=[
            pb.OutcomeEntry(accepted=k, bonus=b, tokens=tokens,
                            sparse=pb.SparseDistribution(k=sk, ids=ids, probs=probs) if sk else None)
            for k, b, tokens, ids, probs, sk in t.entries
        ])
        for t in result.tables
    ]
    return pb.RoundResponse(
        round_id=result.round_id, sequences=sequences, dense_rows=result.dense_rows,
        vocab_size=result.vocab_size, draft_seconds=result.draft_seconds, tables=tables,
    )


def channel_response_to(offer) -> pb.TensorChannelResponse:
    """specpool.common.tensor_channel.ChannelOffer -> TensorChannelResponse."""
    return pb.TensorChannelResponse(
        store_host=offer.host, store_port=offer.port, prefix=offer.prefix, backend=offer.backend,
        target_rank=offer.target_rank, timeout_s=offer.timeout_s, secret=offer.secret,
    )


def capacity_to(report: CapacityReport, only: str | None = None) -> pb.Capacity:
    """only: list that tenant's figures alone ("": no tenant's); None: every tenant's."""
    models = []
    for m in report.models:
        out = pb.ModelDrafters(target_model=m.target_model, drafters=[_KIND_TO_PB[k] for k in m.drafters])
        if m.draft_step_costs is not None:
            c = m.draft_step_costs
            out.draft_step_costs.CopyFrom(pb.StepCostTable(
                batch_sizes=c.batch_sizes, draft_lens=c.draft_lens, seconds=[s for row in c.seconds for s in row]
            ))
        models.append(out)
    return pb.Capacity(
        endpoint_id=report.endpoint_id,
        max_sessions=report.max_sessions,
        active_sessions=report.active_sessions,
        draft_busy_ratio=report.draft_busy_ratio,
        models=models,
        ssd_hit_ratio=report.ssd_hit_ratio,
        tenants=[
            pb.TenantStats(tenant=t.tenant, active_sessions=t.active_sessions,
                           drafted_tokens=t.drafted_tokens, accepted_tokens=t.accepted_tokens)
            for t in report.tenants if only is None or t.tenant == only
        ],
    )


def capacity_json(report: CapacityReport, only: str | None = None) -> dict:
    """The same report for the HTTP /capacity route."""
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(capacity_to(report, only), always_print_fields_with_no_presence=True)
