"""protobuf <-> domain for the SpeculationService, with the checks that need no model.

Decoders raise FieldError naming the field (`sessions[3].sampling.top_p`); checks that need the
target model (known model, vocabulary) happen in the endpoint.
"""

from __future__ import annotations

import math

from specpool.common.errors import FieldError
from specpool.common.speculation import (
    backend_to_pb,
    drafter_from_pb,
    drafter_to_pb,
    on_the_wire,
    sampling_from_pb,
    sparse_q_to_pb,
)
from specpool.engine.verification.sampling import SamplingParams
from specpool.spec_endpoint.messages import (
    CapacityReport,
    OpenRequest,
    OpenResult,
    Round,
    RoundResult,
    SequenceRound,
    SessionSpec,
    Transport,
    context_too_long,
)
from specpool_client.v1 import speculation_pb2 as pb

_RESOLUTION_FROM_PB = {pb.ROUND_RESOLUTION_UNSPECIFIED: "ask", pb.ROUND_RESOLUTION_TABLE_HIT: "table_hit",
                       pb.ROUND_RESOLUTION_LOCAL_DRAFTS: "local_drafts"}
_TRANSPORT_FROM_PB = {pb.DISTRIBUTION_TRANSPORT_UNSPECIFIED: Transport.AUTO, pb.DISTRIBUTION_TRANSPORT_SPARSE: Transport.SPARSE,
                      pb.DISTRIBUTION_TRANSPORT_DENSE: Transport.DENSE}


def tenant_from(value: str) -> str:
    if not value:
        raise FieldError("tenant", "empty; name the target service (its service id)")
    return value


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
        drafter = drafter_from_pb(s.drafter, f"{path}.drafter")  # never Method.NONE: no such DrafterKind
        if s.transport not in _TRANSPORT_FROM_PB:
            raise FieldError(f"{path}.transport", f"unknown distribution transport {s.transport}")
        sessions.append(SessionSpec(
            request_id=s.request_id,
            context=tuple(s.context),
            params=sampling_from_pb(s.sampling, f"{path}.sampling"),
            drafter=drafter,
            transport=_TRANSPORT_FROM_PB[s.transport],
            push=s.push,
            tree=s.tree,
        ))
    return OpenRequest(tenant, msg.target_model, msg.lease_s, tuple(sessions))


def open_response_to(results: list[OpenResult]) -> pb.OpenSessionsResponse:
    return pb.OpenSessionsResponse(sessions=[
        pb.OpenedSession(
            request_id=r.request_id, ok=r.ok, error=r.error,
            drafter=drafter_to_pb(r.drafter), reads_features=r.reads_features,
        )
        for r in results
    ])


def round_from(msg: pb.RoundsRequest, tenant: str | None = None) -> Round:
    """Per-sequence problems (unknown session, bad num_draft_tokens) are answered per sequence.
    tenant: the caller's; None (an --insecure endpoint) takes the message's own field."""
    return Round(
        tenant=tenant if tenant is not None else tenant_from(msg.tenant),
        round_id=msg.round_id,
        sequences=tuple(
            SequenceRound(s.request_id, tuple(s.new_tokens), s.num_draft_tokens,
                          _RESOLUTION_FROM_PB.get(s.resolution, str(s.resolution)), tuple(s.drafts_in_use),
                          s.num_features)
            for s in msg.sequences
        ),
        feature_dim=msg.feature_dim,
    )


def round_response_to(result: RoundResult) -> pb.RoundsResponse:
    sequences = []
    for s in result.sequences:
        out = pb.SequenceDrafts(request_id=s.request_id, tokens=s.tokens, parents=s.parents, dense_on_channel=s.dense,
                                error=s.error, from_cache=s.from_cache)
        if s.sparse_k:
            out.sparse.CopyFrom(sparse_q_to_pb(s.sparse_ids, s.sparse_probs, s.sparse_k))
        sequences.append(out)
    tables = [
        pb.OutcomeTable(request_id=t.request_id, follows=t.follows, fast_backup=t.fast_backup, entries=[
            pb.OutcomeEntry(accepted=k, bonus=b, tokens=tokens,
                            sparse=sparse_q_to_pb(ids, probs, sk) if sk else None)
            for k, b, tokens, ids, probs, sk in t.entries
        ])
        for t in result.tables
    ]
    return pb.RoundsResponse(
        round_id=result.round_id, sequences=sequences, dense_rows=result.dense_rows,
        vocab_size=result.vocab_size, draft_seconds=result.draft_seconds, tables=tables,
    )


def channel_response_to(offer) -> pb.OpenTensorChannelResponse:
    """specpool.common.tensor_channel.ChannelOffer -> OpenTensorChannelResponse."""
    return pb.OpenTensorChannelResponse(
        store_host=offer.host, store_port=offer.port, prefix=offer.prefix, backend=backend_to_pb(offer.backend),
        target_rank=offer.target_rank, timeout_s=offer.timeout_s, secret=offer.secret,
    )


def capacity_to(report: CapacityReport, only: str | None = None) -> pb.GetCapacityResponse:
    """only: list that tenant's figures alone ("": no tenant's); None: every tenant's."""
    models = []
    for m in report.models:
        offered = [drafter_to_pb(k) for k in m.drafters if on_the_wire(k)]
        out = pb.ModelDrafters(target_model=m.target_model, drafters=offered)
        if m.draft_step_costs is not None:
            c = m.draft_step_costs
            out.draft_step_costs.CopyFrom(pb.StepCostTable(
                batch_sizes=c.batch_sizes, draft_lens=c.draft_lens, seconds=[s for row in c.seconds for s in row]
            ))
        models.append(out)
    return pb.GetCapacityResponse(
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
