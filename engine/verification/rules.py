"""Lossless verification of speculated tokens against the target's sampling distribution.

Pure tensor-in/tensor-out functions, vectorised over the batch. Shapes: B rows, K draft slots, V vocab.
Draft rows may be ragged: `num_drafts[b]` of the K slots of row b are real; the rest are padding whose
token ids (and draft probabilities) may hold anything, since no padded value is ever read into a result.
Target row i (i < K) is the target's distribution for the token at draft slot i; row K is the bonus
position. `target_probs` must be the *sampler's* probabilities (`sampling.logits_to_probs`), so that
the emitted tokens are distributed exactly as plain sampling with the same parameters would be.

Preconditions (not checked, to keep the hot path free of device syncs): 0 <= num_drafts <= K; target
rows 0..num_drafts[b] of each row are valid distributions; the generator lives on the tensors' device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specpool.engine.verification.sampling import sample


@dataclass(frozen=True, slots=True)
class VerifyResult:
    accepted: Tensor  # [B] int64: draft tokens accepted, 0..num_drafts[b]
    next_token: Tensor  # [B] int64: correction token on rejection, bonus token when all drafts accepted

    def emitted(self, draft_tokens: Tensor) -> list[list[int]]:
        """Tokens each row emits: draft_tokens[b, :accepted[b]] followed by next_token[b]."""
        return emitted_tokens(draft_tokens, self)


def emitted_tokens(draft_tokens: Tensor, result: VerifyResult) -> list[list[int]]:
    drafts = draft_tokens.tolist()
    return [
        row[:n] + [tok]
        for row, n, tok in zip(drafts, result.accepted.tolist(), result.next_token.tolist(), strict=True)
    ]


# --- shared pieces -----------------------------------------------------------------------------


def _real_slots(draft_tokens: Tensor, num_drafts: Tensor) -> tuple[Tensor, Tensor]:
    """-> (valid [B, K] bool, tokens [B, K] with padding replaced by 0 so it is safe to gather with)."""
    k = draft_tokens.shape[1]
    valid = torch.arange(k, device=draft_tokens.device) < num_drafts[:, None]  # [B, K]
    return valid, torch.where(valid, draft_tokens, 0)


def _prefix_len(ok: Tensor) -> Tensor:
    """[B, K] bool -> [B] int64 length of the leading run of True (0..K; also fine for K == 0)."""
    return ok.long().cumprod(-1).sum(-1)


def _accept_prefix(p_x: Tensor, q_x: Tensor, valid: Tensor, generator: torch.Generator | None) -> Tensor:
    """Accept slot i with probability min(1, p(x_i)/q(x_i)); -> [B] number accepted before the first reject.

    u * q < p is u < p/q without dividing by zero; every slot draws its uniform, whether or not an
    earlier slot rejected, so the random stream does not depend on the outcome.
    """
    u = torch.rand(p_x.shape, generator=generator, device=p_x.device, dtype=p_x.dtype)  # [B, K]
    return _prefix_len((u * q_x < p_x) & valid)


def _rows(x: Tensor, idx: Tensor) -> Tensor:
    """x [B, R, ...], idx [B] -> x[b, idx[b]] as [B, ...]."""
    return x[torch.arange(x.shape[0], device=x.device), idx]


def _draft_slot(accepted: Tensor, k: int) -> Tensor:
    """Slot whose q is subtracted on rejection; clamped so bonus rows (accepted == K) still index in range."""
    return accepted.clamp(max=max(k - 1, 0))


def _sample_next(p_row: Tensor, residual: Tensor, bonus: Tensor, generator: torch.Generator | None) -> Tensor:
    """Sample the correction (from residual) or, on bonus rows, the bonus token (from p); [B, V] -> [B].

    A residual with no mass can only come from a rejection that had probability zero up to rounding
    (p == q, or p(x) == 1 for a point mass); p is the right distribution there, and multinomial would
    raise on an all-zero row.
    """
    use_p = bonus[:, None] | (residual.sum(-1, keepdim=True) <= 0)  # [B, 1]
    return sample(torch.where(use_p, p_row, residual), generator)


# --- chain verifiers ---------------------------------------------------------------------------


def verify_greedy(draft_tokens: Tensor, target_logits: Tensor, num_drafts: Tensor) -> VerifyResult:
    """Greedy target: accept while the draft equals the target argmax, then emit the argmax there."""
    k = draft_tokens.shape[1]
    valid, tokens = _real_slots(draft_tokens, num_drafts)
    best = target_logits.argmax(-1)  # [B, K+1]
    accepted = _prefix_len((tokens == best[:, :k]) & valid)  # [B]
    return VerifyResult(accepted, _rows(best, accepted))


def verify_dense(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    num_drafts: Tensor,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Speculative sampling with the full draft distribution: slot i's token was sampled from draft_probs[:, i].

    draft_tokens [B, K], draft_probs [B, K, V], target_probs [B, K+1, V], num_drafts [B].
    """
    k = draft_tokens.shape[1]
    valid, tokens = _real_slots(draft_tokens, num_drafts)
    p_x = target_probs[:, :k].gather(-1, tokens[..., None]).squeeze(-1)  # [B, K]
    q_x = draft_probs.gather(-1, tokens[..., None]).squeeze(-1)  # [B, K]
    accepted = _accept_prefix(p_x, q_x, valid, generator)  # [B]

    bonus = accepted == num_drafts  # [B]
    p_row = _rows(target_probs, accepted)  # [B, V]
    if k == 0:
        return VerifyResult(accepted, sample(p_row, generator))
    q_row = _rows(draft_probs, _draft_slot(accepted, k))  # [B, V]; padding garbage only on bonus rows
    residual = torch.where(bonus[:, None], 0.0, (p_row - q_row).clamp(min=0))  # [B, V] unnormalised
    return VerifyResult(accepted, _sample_next(p_row, residual, bonus, generator))


def verify_sparse(
    draft_tokens: Tensor,
    draft_topk_ids: Tensor,
    draft_topk_probs: Tensor,
    target_probs: Tensor,
    num_drafts: Tensor,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Speculative sampling with q sent as k (id, prob) pairs per slot; exact, same rule as verify_dense.

    draft_topk_ids / draft_topk_probs [B, K, k]: the support of the draft sampler and its weights. The
    weights are renormalised here, because the draft sampled from the truncated, renormalised q; raw
    top-k probabilities of the untruncated q therefore give the same (correct) result.
    Only the one q row needed for the residual is made dense ([B, V]), never [B, K, V].
    """
    k = draft_tokens.shape[1]
    valid, tokens = _real_slots(draft_tokens, num_drafts)
    w = torch.where(valid[..., None], draft_topk_probs.float(), 0.0)  # [B, K, k]; padding can hold NaN
    q = w / w.sum(-1, keepdim=True).clamp(min=torch.finfo(w.dtype).tiny)  # [B, K, k]
    # Summed over matches, so a repeated id counts the same here as in the scatter_add below.
    q_x = ((draft_topk_ids == tokens[..., None]) * q).sum(-1)  # [B, K]
    p_x = target_probs[:, :k].gather(-1, tokens[..., None]).squeeze(-1)  # [B, K]
    accepted = _accept_prefix(p_x, q_x.to(p_x.dtype), valid, generator)  # [B]

    bonus = accepted == num_drafts  # [B]
    p_row = _rows(target_probs, accepted)  # [B, V]
    if k == 0:
        return VerifyResult(accepted, sample(p_row, generator))
    slot = _draft_slot(accepted, k)
    ids = torch.where(bonus[:, None], 0, _rows(draft_topk_ids, slot))  # [B, k]; bonus rows may index padding
    q_row = torch.zeros_like(p_row).scatter_add_(-1, ids, _rows(q, slot).to(p_row.dtype))  # [B, V]
    residual = torch.where(bonus[:, None], 0.0, (p_row - q_row).clamp(min=0))  # [B, V]
    return VerifyResult(accepted, _sample_next(p_row, residual, bonus, generator))


def verify_point_mass(
    draft_tokens: Tensor,
    target_probs: Tensor,
    num_drafts: Tensor,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Deterministic drafts (n-gram, cached greedy): q is a point mass on the drafted token.

    The dense rule with q = one-hot(x̂): accept with probability p(x̂); on rejection max(0, p - q) is p with
    x̂ removed. Correct however x̂ was chosen, as long as it does not depend on this call's randomness.
    No draft probabilities are used: plugging a drafter's scores in as q is the classic biased bug.
    """
    k = draft_tokens.shape[1]
    valid, tokens = _real_slots(draft_tokens, num_drafts)
    p_x = target_probs[:, :k].gather(-1, tokens[..., None]).squeeze(-1)  # [B, K]
    accepted = _accept_prefix(p_x, torch.ones_like(p_x), valid, generator)  # [B]

    # A deliberate parallel of verify_sparse's tail: the rules differ only in the residual they build.
    bonus = accepted == num_drafts  # [B]
    p_row = _rows(target_probs, accepted)  # [B, V]
    if k == 0:
        return VerifyResult(accepted, sample(p_row, generator))
    rejected = torch.where(bonus, 0, _rows(tokens, _draft_slot(accepted, k)))  # [B]
    residual = p_row.scatter(-1, rejected[:, None], 0.0)  # [B, V]; only read on rejected rows
    return VerifyResult(accepted, _sample_next(p_row, residual, bonus, generator))


# --- several candidates at one position ----------------------------------------------------------


def verify_candidates(
    candidate_tokens: Tensor,
    num_candidates: Tensor,
    target_probs: Tensor,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """SpecInfer's multi-candidate rule for distinct deterministic candidates at one position.

    candidate_tokens [B, C] (distinct within the first num_candidates[b]), num_candidates [B],
    target_probs [B, V]. Candidate i is tried after candidates < i failed: accept it with probability
    p(x_i) / (1 - sum_{j<i} p(x_j)), i.e. p(x_i) under p with the tried tokens removed. If all fail,
    sample from p with every tried token removed. The emitted token is then distributed exactly as p.
    -> (accepted_index [B] int64, -1 when none accepted; token [B] int64, the accepted candidate or the
    residual sample). With a one-hot (greedy) p this accepts exactly the candidate equal to the argmax.
    """
    c = candidate_tokens.shape[1]
    valid, tokens = _real_slots(candidate_tokens, num_candidates)  # [B, C]
    p_c = target_probs.gather(-1, tokens) * valid  # [B, C]
    left = 1.0 - (p_c.cumsum(-1) - p_c)  # [B, C] mass not yet ruled out when candidate i is tried
    u = torch.rand(p_c.shape, generator=generator, device=p_c.device, dtype=p_c.dtype)  # [B, C]
    first = _prefix_len(~((u * left < p_c) & valid))  # [B] index of the first accepted, C if none
    hit = first < c  # [B]

    # Count rather than scatter a bool mask: padding ids (0) may collide with a real candidate 0.
    tried = torch.zeros_like(target_probs).scatter_add_(-1, tokens, valid.to(target_probs.dtype))  # [B, V]
    residual = target_probs * (tried == 0)  # [B, V] unnormalised
    drawn = _sample_next(target_probs, residual, torch.zeros_like(hit), generator)  # [B]
    if c == 0:
        return torch.full_like(first, -1), drawn
    picked = _rows(tokens, first.clamp(max=c - 1))  # [B]
    return torch.where(hit, first, -1), torch.where(hit, picked, drawn)


# --- token trees ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TreeVerifyResult:
    accepted: Tensor  # [B] int64: nodes on the accepted path
    next_token: Tensor  # [B] int64: the target's token after that path
    path: Tensor  # [B, N] int64: the accepted nodes from the root down, -1 past `accepted`


def verify_tree(
    node_tokens: Tensor,
    parents: Tensor,
    num_nodes: Tensor,
    target_probs: Tensor,
    generator: torch.Generator | None = None,
) -> TreeVerifyResult:
    """Deterministic token trees (engine/verification/token_tree.py), walked from the root one level at a time: at
    each node the children are candidates for the next token under the multi-candidate rule
    (verify_candidates), so the emitted tokens are distributed exactly as p however the tree was
    built, as long as siblings are distinct and the tree does not depend on this call's randomness.
    A greedy target passes one-hot rows and gets the longest path of argmax tokens.

    node_tokens [B, N], parents [B, N] (node indices, -1: a child of the root; padding may hold
    anything), num_nodes [B], target_probs [B, N+1, V]: row 0 scores the root's next token, row i+1
    node i's.
    """
    B, n = node_tokens.shape
    dev = node_tokens.device
    rows = torch.arange(B, device=dev)
    nodes = torch.arange(n, device=dev)
    valid = nodes < num_nodes[:, None]  # [B, N]
    parent_row = torch.where(valid, parents + 1, -1)  # [B, N]: the target row of each node's parent
    child_of = parent_row[:, None, :] == torch.arange(n + 1, device=dev)[None, :, None]  # [B, N+1, N]
    counts = child_of.sum(-1)  # [B, N+1]
    width = int(counts.max()) if n else 0
    children = torch.where(child_of, nodes, n + nodes).argsort(-1)[..., :width]  # [B, N+1, C], by node index
    tokens = torch.where(valid, node_tokens, 0)

    at = torch.zeros(B, dtype=torch.long, device=dev)  # the target row of the node the walk is at
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    accepted = torch.zeros(B, dtype=torch.long, device=dev)
    next_token = torch.zeros(B, dtype=torch.long, device=dev)
    path = torch.full((B, n), -1, dtype=torch.long, device=dev)
    for _ in range(n + 1):  # a path is at most N nodes long; the last level only samples
        cand = children[rows, at]  # [B, C]
        num = torch.where(done, 0, counts[rows, at])
        idx, token = verify_candidates(tokens.gather(1, cand), num, target_probs[rows, at], generator)
        hit = (idx >= 0) & ~done
        node = cand.gather(1, idx.clamp(min=0)[:, None]).squeeze(1) if width else at
        path[rows[hit], accepted[hit]] = node[hit]
        accepted += hit
        next_token = torch.where(~hit & ~done, token, next_token)
        done |= ~hit
        at = torch.where(hit, node + 1, at)
        if bool(done.all()):
            break
    return TreeVerifyResult(accepted, next_token, path)
