"""Speculation API messages on the target's side (the vocabulary itself is in specpool.common.speculation):
every message the target sends is built here, from plain values; the drafts it receives are checked
here before they reach verification, and a sampling group's rows are made into one Drafts."""

from __future__ import annotations

from dataclasses import replace

import torch

from specpool.common.speculation import drafter_to_pb, sampling_to_pb
from specpool.engine.drafters.base import Drafts
from specpool.engine.plan import SpeculationPlan
from specpool.engine.policy.costs import StepCosts
from specpool.engine.verification import token_tree
from specpool.engine.verification.sampling import SamplingParams
from specpool_client.v1 import speculation_pb2 as pb

# A row's draft distribution: dense [K, V], sparse (ids [K, k], probs [K, k]), or None (a point mass).
Q = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None
# A row's drafts: tokens, their q, and a token tree's parents (None: a chain).
Row = tuple[list[int], Q, list[int] | None]


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


# -- the drafts the target receives --------------------------------------------------------------


def unusable(tokens: list[int], q: Q, asked: int, q_sent: bool, vocab_size: int,
             parents: list[int] | None = None) -> str:
    """Why an endpoint's drafts for one sequence cannot be verified ('' when they can). Checked here:
    in verification a bad id or shape would fail every sequence of the batch, not only this one."""
    if len(tokens) > asked:
        return f"{len(tokens)} drafts where {asked} were asked"
    if any(not 0 <= t < vocab_size for t in tokens):
        return f"a draft token outside the vocabulary [0, {vocab_size})"
    if parents is not None:
        if q_sent:
            return "a token tree with a draft distribution (tree nodes are deterministic)"
        try:
            token_tree.check_tree(tokens, parents)
        except ValueError as e:
            return f"a malformed token tree ({e})"
    if q_sent and q is None:
        return "its draft distribution is malformed"
    if isinstance(q, torch.Tensor):
        if tuple(q.shape) != (len(tokens), vocab_size):
            return f"dense q of shape {tuple(q.shape)} for {len(tokens)} drafts"
        probs = q
    elif q is not None:
        ids, probs = q
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab_size):
            return "a sparse q id outside the vocabulary"
    if q is not None and not (torch.isfinite(probs).all() and (probs >= 0).all()):
        return "negative or non-finite draft probabilities"
    return ""


def draft_costs(capacity: pb.GetCapacityResponse, target_model: str) -> StepCosts | None:
    """The endpoint's measured draft-model step costs for this target model, if it sent them."""
    for m in capacity.models:
        table = m.draft_step_costs
        if m.target_model == target_model and table.seconds:
            n = len(table.draft_lens)
            rows = [tuple(table.seconds[i * n : (i + 1) * n]) for i in range(len(table.batch_sizes))]
            return StepCosts(tuple(table.batch_sizes), tuple(table.draft_lens), tuple(rows))
    return None


def assemble(rows: list[Row], params: SamplingParams) -> Drafts:
    """One Drafts for a sampling group whose rows came from different sources.

    Rows drafted deterministically (n-gram, fallback, trees) are written as a one-hot q, which the
    dense and sparse rules verify exactly as the point-mass rule does. Trees are verified as trees
    unless another row of the group carries a q (the tree rule takes none): they then send their
    first-child chain, a deterministic chain.
    """
    sampled = not params.greedy and any(q is not None for _, q, _ in rows)
    if any(p is not None for _, _, p in rows):
        if not sampled:
            return Drafts(tokens=[t for t, _, _ in rows],
                          parents=[p if p is not None else token_tree.chain(len(t)) for t, _, p in rows])
        rows = [(t, q, None) if p is None else ([t[i] for i in token_tree.first_children(p)], None, None)
                for t, q, p in rows]
    tokens = [t for t, _, _ in rows]
    if not sampled:
        return Drafts(tokens=tokens)
    k_max = max((len(t) for t in tokens), default=0)
    if any(isinstance(q, torch.Tensor) for _, q, _ in rows):
        vocab = next(q.shape[-1] for _, q, _ in rows if isinstance(q, torch.Tensor))
        probs = torch.zeros(len(rows), k_max, vocab)
        for b, (t, q, _) in enumerate(rows):
            if isinstance(q, torch.Tensor):
                probs[b, : len(t)] = q
            elif t:
                probs[b, torch.arange(len(t)), torch.tensor(t)] = 1.0
        return Drafts(tokens=tokens, probs=probs)
    # Sparse: every row shares the sampler's top-k; one-hot rows repeat their token with weight 0.
    k = max(q[0].shape[-1] for _, q, _ in rows if q is not None)  # rows pad to the widest (weight 0)
    ids = torch.zeros(len(rows), k_max, k, dtype=torch.long)
    weights = torch.zeros(len(rows), k_max, k)
    for b, (t, q, _) in enumerate(rows):
        if q is not None:
            ids[b, : len(t), : q[0].shape[-1]], weights[b, : len(t), : q[0].shape[-1]] = q
        elif t:
            ids[b, : len(t)] = torch.tensor(t)[:, None]
            weights[b, : len(t), 0] = 1.0
    return Drafts(tokens=tokens, topk_ids=ids, topk_probs=weights)
