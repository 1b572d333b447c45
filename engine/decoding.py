"""The one decode loop: draft, verify, accept, roll back. AR decoding is the loop with no drafter.

Every drafter (draft model, n-gram, the remote endpoint) goes through `verify_round`, so there is
exactly one place where speculated tokens turn into output.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.drafter import Drafter, Drafts
from engine.model import Llama
from engine.sampling import SamplingParams, logits_to_probs, make_generator, sample_from_logits
from engine.speculation_policy import AcceptanceEstimate, SpeculationPolicy
from engine.verification import (
    VerifyResult,
    verify_dense,
    verify_greedy,
    verify_point_mass,
    verify_sparse,
)


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "stop" (a stop token) or "length"
    target_steps: int = 0  # verify/decode forwards after prefill
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        elapsed = self.prefill_s + self.decode_s
        return len(self.token_ids) / elapsed if elapsed > 0 else 0.0

    @property
    def mean_accept_len(self) -> float:
        """Tokens emitted per target step after the first token, bonus included."""
        return (len(self.token_ids) - 1) / self.target_steps if self.target_steps else 0.0


def pad_drafts(drafts: Drafts) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (tokens [B, K] right-padded with 0, num_drafts [B])."""
    k = max((len(t) for t in drafts.tokens), default=0)
    tokens = torch.zeros(len(drafts.tokens), k, dtype=torch.long)
    for b, row in enumerate(drafts.tokens):
        tokens[b, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return tokens, torch.tensor([len(t) for t in drafts.tokens], dtype=torch.long)


def verify_round(
    drafts: Drafts, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> VerifyResult:
    """target_logits [B, T, V] with T >= K+1: row i scores the token at draft slot i (row K: the bonus)."""
    tokens, num = pad_drafts(drafts)
    k = tokens.shape[1]
    logits = target_logits[:, : k + 1]
    if params.greedy:
        return verify_greedy(tokens, logits, num)
    p = logits_to_probs(logits, params)  # [B, K+1, V]
    if drafts.probs is not None:
        return verify_dense(tokens, drafts.probs[:, :k], p, num, generator)
    if drafts.topk_ids is not None:
        return verify_sparse(tokens, drafts.topk_ids[:, :k], drafts.topk_probs[:, :k], p, num, generator)
    return verify_point_mass(tokens, p, num, generator)


def generate(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    max_new_tokens: int,
    drafter: Drafter | None = None,
    num_draft_tokens: int = 0,
    stop_ids: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    policy: SpeculationPolicy | None = None,
) -> list[GenerationResult]:
    """Decode all prompts together (ragged batch); speculate with `drafter` when given.

    The draft length is `num_draft_tokens`, or, with a `policy`, chosen every step from the
    batch size and the acceptance measured so far.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if policy is not None:
        num_draft_tokens = policy.max_draft
    acceptance = AcceptanceEstimate()
    stop = set(stop_ids if stop_ids is not None else [model.config.eos_id])
    gen = generator or make_generator(params.seed)
    results = [GenerationResult(prompt_ids=list(p)) for p in prompts]
    max_len = max(len(p) for p in prompts) + max_new_tokens + num_draft_tokens + 1
    cache = model.new_cache(len(prompts), max_len)
    slots = [cache.allocate() for _ in prompts]
    ids = [str(i) for i in range(len(prompts))]
    unseen = [0] * len(prompts)  # tokens the drafter has been given but not yet run its model over

    def emit(i: int, tokens: Sequence[int]) -> list[int]:
        """Append tokens to result i up to a stop token or the length limit; -> what was appended."""
        res, taken = results[i], []
        for t in tokens:
            if len(res.token_ids) >= max_new_tokens:
                break
            res.token_ids.append(t)
            taken.append(t)
            if t in stop:
                res.finish_reason = "stop"
                break
        if not res.finish_reason and len(res.token_ids) >= max_new_tokens:
            res.finish_reason = "length"
        return taken

    start = time.perf_counter()
    logits = model.forward(cache, slots, prompts)  # [B, V]
    firsts = sample_from_logits(logits, params, gen).tolist()
    prefill_s = time.perf_counter() - start
    for i, t in enumerate(firsts):
        emit(i, [t])
        results[i].prefill_s = prefill_s
        if drafter is not None and not results[i].finish_reason:
            drafter.add_sequence(ids[i], list(prompts[i]) + [t])
            unseen[i] = len(prompts[i]) + 1

    start = time.perf_counter()
    active = [i for i, r in enumerate(results) if not r.finish_reason]
    while active:
        length = 0
        if drafter is not None:
            if policy is None:
                length = num_draft_tokens
            else:
                catch_up = sum(unseen[i] for i in active) / len(active)
                remaining = sum(max_new_tokens - len(results[i].token_ids) for i in active) / len(active)
                length = policy.choose(len(active), acceptance.alpha, catch_up, remaining)
        # Never draft past the length limit: the bonus token always fills the last place.
        budget = [min(length, max_new_tokens - len(results[i].token_ids) - 1) for i in active]
        if any(budget):
            drafts = drafter.propose([ids[i] for i in active], budget, params, gen)
        else:
            drafts = Drafts.empty(len(active))
        rows = [[results[i].token_ids[-1]] + drafts.tokens[b] for b, i in enumerate(active)]
        logits = model.forward(cache, [slots[i] for i in active], rows, all_logits=True)  # [B, T, V]
        outcome = verify_round(drafts, logits, params, gen)
        accepted = outcome.accepted.tolist()
        next_tokens = outcome.next_token.tolist()
        for b, i in enumerate(active):
            res = results[i]
            res.target_steps += 1
            res.drafted_tokens += len(drafts.tokens[b])
            res.accepted_tokens += accepted[b]
            acceptance.update(accepted[b], len(drafts.tokens[b]))
            # Keep the fed last token and the accepted drafts; drop the rejected drafts' K/V.
            cache.truncate(slots[i], cache.lengths[slots[i]] - len(rows[b]) + 1 + accepted[b])
            taken = emit(i, drafts.tokens[b][: accepted[b]] + [next_tokens[b]])
            if drafter is not None:
                if res.finish_reason:
                    drafter.remove_sequence(ids[i])
                else:
                    drafter.extend(ids[i], taken)
                    # Accepted drafts are already in the drafter's cache; the rest is new to it.
                    unseen[i] = (0 if drafts.tokens[b] else unseen[i]) + len(taken) - min(accepted[b], len(taken))
        active = [i for i in active if not results[i].finish_reason]
    decode_s = time.perf_counter() - start
    for r in results:
        r.decode_s = decode_s
    return results
