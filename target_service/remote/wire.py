"""The Speculation API on the target's side, both ways (the mirror of spec_endpoint/wire.py, which reads
requests and writes replies): every message the target sends is built here from plain values, and every
reply it reads becomes typed rows here. Nothing here judges the drafts (codec.unusable does) or knows a
session."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from specpool.common.speculation import drafter_to_pb, sampling_to_pb, sparse_q_from_pb
from specpool.engine.plan import SpeculationPlan
from specpool.engine.policy.costs import StepCosts
from specpool.engine.verification.sampling import SamplingParams
from specpool.target_service.remote.codec import Q
from specpool_client.v1 import speculation_pb2 as pb

# -- the messages the target sends ---------------------------------------------------------------


def capacity_request() -> pb.GetCapacityRequest:
    return pb.GetCapacityRequest()


def tensor_channel_request(tenant: str) -> pb.OpenTensorChannelRequest:
    return pb.OpenTensorChannelRequest(tenant=tenant)


def session_spec(seq_id: str, context: list[int], plan: SpeculationPlan, params: SamplingParams,
                 push: bool) -> pb.SessionSpec:
    # No seed: the endpoint draws its drafts from its own stream; verification stays lossless.
    return pb.SessionSpec(request_id=seq_id, context=context, drafter=drafter_to_pb(plan.method), push=push,
                          sampling=sampling_to_pb(replace(params, seed=None)), tree=plan.tree)


def open_sessions_request(tenant: str, target_model: str, lease_s: float,
                          specs: list[pb.SessionSpec]) -> pb.OpenSessionsRequest:
    return pb.OpenSessionsRequest(tenant=tenant, target_model=target_model, lease_s=lease_s, sessions=specs)


def close_sessions_request(tenant: str, seq_ids: list[str]) -> pb.CloseSessionsRequest:
    return pb.CloseSessionsRequest(tenant=tenant, request_ids=seq_ids)


def sequence_round(seq_id: str, new_tokens: list[int], num_draft_tokens: int,
                   num_features: int = 0) -> pb.SequenceRound:
    """A sequence's part of a round that asks the endpoint for up to num_draft_tokens drafts (0: it only
    reports the tokens emitted since its previous round); num_features: its feature rows in the round."""
    return pb.SequenceRound(request_id=seq_id, new_tokens=new_tokens, num_draft_tokens=num_draft_tokens,
                            num_features=num_features)


def resolved_round(seq_id: str, new_tokens: list[int], drafts: list[int], table_hit: bool,
                   num_features: int = 0) -> pb.SequenceRound:
    """SSD push: a sequence whose drafts the target resolved itself, asking nothing. A table hit takes
    the endpoint's pushed drafts (it counts on them being verified); otherwise the table said the
    endpoint would back off to n-gram drafts, drafted here and reported as the drafts in use."""
    if table_hit:
        return pb.SequenceRound(request_id=seq_id, new_tokens=new_tokens, num_features=num_features,
                                resolution=pb.ROUND_RESOLUTION_TABLE_HIT, num_draft_tokens=len(drafts))
    return pb.SequenceRound(request_id=seq_id, new_tokens=new_tokens, num_features=num_features,
                            resolution=pb.ROUND_RESOLUTION_LOCAL_DRAFTS, drafts_in_use=drafts)


def rounds_request(tenant: str, round_id: int, sequences: list[pb.SequenceRound],
                   feature_dim: int = 0) -> pb.RoundsRequest:
    """One step's round; feature_dim: the width of the feature rows that follow it on the tensor channel."""
    return pb.RoundsRequest(tenant=tenant, round_id=round_id, sequences=sequences, feature_dim=feature_dim)


# -- the replies the target reads ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SequenceReply:
    """One sequence's part of a RoundsResponse, as read."""

    seq_id: str  # the request_id it answers
    tokens: list[int]  # [K] draft ids (a tree's nodes, parents first)
    q: Q  # dense [K, V] float32 (its rows of the channel's block), sparse (ids [K, k], probs [K, k]), or None
    q_sent: bool  # the endpoint sent a q: a None q beside it is a malformed one
    parents: list[int]  # [K] each node's parent (-1: the last emitted token); empty: a chain
    error: str  # why the endpoint could not draft it; '' when it did
    from_cache: bool  # SSD: served from a pre-speculated fork (a hit)


def read_round(response: pb.RoundsResponse, dense: torch.Tensor | None) -> list[SequenceReply]:
    """Every sequence of a reply; dense [dense_rows, V]: the q rows that followed it on the tensor channel,
    one block for every dense_on_channel sequence in order (None when they did not arrive)."""
    out = []
    dense_row = 0
    for d in response.sequences:
        q = None
        if d.dense_on_channel:
            q = dense[dense_row : dense_row + len(d.tokens)] if dense is not None else None
            dense_row += len(d.tokens)
        elif d.HasField("sparse"):
            q = sparse_q_from_pb(d.sparse, len(d.tokens))
        out.append(SequenceReply(d.request_id, list(d.tokens), q, d.dense_on_channel or d.HasField("sparse"),
                                 list(d.parents), d.error, d.from_cache))
    return out


@dataclass(frozen=True, slots=True)
class PushedDrafts:
    """The drafts an SSD outcome table holds for one outcome, as read and cut to the number asked."""

    tokens: list[int]  # [n] draft ids, n <= the number asked
    q: Q  # sparse (ids [n, k], probs [n, k]), or None (a point mass, or a malformed q)
    q_sent: bool  # the entry carried a q: a None q beside it is a malformed one


def read_entry(entry: pb.OutcomeEntry, num_tokens: int) -> PushedDrafts:
    """An outcome table's entry, its first num_tokens drafts (the table holds as many as the endpoint
    pre-speculated)."""
    tokens = list(entry.tokens)[:num_tokens]
    q = None
    if entry.HasField("sparse"):
        q = sparse_q_from_pb(entry.sparse, len(entry.tokens))
        q = (q[0][: len(tokens)], q[1][: len(tokens)]) if q is not None else None
    return PushedDrafts(tokens, q, entry.HasField("sparse"))


def draft_costs(capacity: pb.GetCapacityResponse, target_model: str) -> StepCosts | None:
    """The endpoint's measured draft-model step costs for this target model, if it sent them."""
    for m in capacity.models:
        table = m.draft_step_costs
        if m.target_model == target_model and table.seconds:
            n = len(table.draft_lens)
            rows = [tuple(table.seconds[i * n : (i + 1) * n]) for i in range(len(table.batch_sizes))]
            return StepCosts(tuple(table.batch_sizes), tuple(table.draft_lens), tuple(rows))
    return None
