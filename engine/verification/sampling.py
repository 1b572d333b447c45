"""Turning logits into the distribution actually sampled from, and sampling from it.

Every speculative path must verify against exactly the distribution the sampler used, so the
temperature / top-k / top-p / min-p transform lives here once and both drafters and verifiers call it.
They compose in that order: temperature scales the logits, top-k keeps every token whose logit is at
least the k-th largest (ties at the cut all stay), top-p keeps the smallest run of the remaining tokens,
most probable first (ties in id order), whose mass reaches top_p, and min-p keeps the tokens of those
with p >= min_p * p_max. tests/reference_sampling.py is the same, written from the definitions in numpy.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables
    min_p: float = 0.0  # 0 disables
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] fp32 probabilities of the sampler (one-hot argmax when greedy)."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # Shifted so the largest is 0 before dividing: any temperature > 0, however small (1e-45), then
    # gives logits in [-inf, 0] with the mode at 0, never inf - inf = NaN. A tiny temperature is the
    # exact limit: uniform over the tied maxima.
    logits = (logits - logits.amax(-1, keepdim=True)) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(_top_p_drops(logits, params.top_p), float("-inf"))
    if params.min_p > 0.0:
        # p / p_max survives renormalising and every cut above keeps the most probable token, so
        # min-p cuts what it would cut first; top-p, before it, read the mass without min-p's cut.
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return logits.softmax(-1)


# Top-p looks for its cut among this many likeliest tokens first: sorting a 49k vocabulary took 2 ms a
# row (60 ms a step at batch 32, more than the step), and the cut almost always falls far inside them.
TOP_P_CANDIDATES = 1024


def _top_p_drops(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] -> bool [..., V]: the tokens top-p drops. In descending order (ties: lower id first), a
    token goes when the mass before it already reaches top_p; the top token always stays."""
    k = min(TOP_P_CANDIDATES, logits.shape[-1])
    values, ids = torch.topk(logits, k, dim=-1)
    # topk leaves ties in any order: by id first, then stably by value, as the full sort orders them.
    by_id = ids.argsort(-1)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    values, ids = values.gather(-1, order), ids.gather(-1, order)
    probs = torch.exp(values - torch.logsumexp(logits, -1, keepdim=True))
    drop_candidates = (probs.cumsum(-1) - probs) >= top_p
    # Exact when every row's cut comes before the value the candidates end at: tokens tied at it may lie
    # beyond them, and the lowest ids of the tie must come first.
    if k < logits.shape[-1] and not bool(drop_candidates[values == values[..., -1:]].all()):
        # Some row's cut reaches past the candidates (a flat distribution): sort the whole vocabulary.
        sorted_logits, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
        probs = sorted_logits.softmax(-1)
        return torch.zeros_like(logits, dtype=torch.bool).scatter(-1, ids, (probs.cumsum(-1) - probs) >= top_p)
    # Every token outside the candidates comes after a dropped one: dropped too.
    return torch.ones_like(logits, dtype=torch.bool).scatter(-1, ids, drop_candidates)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def continued_seed(seed: int, delivered: int) -> int:
    """The seed of a seeded stream continued after `delivered` tokens (a request migrated to another
    replica): a fresh stream, still reproducible. The original seed would replay the draws that chose
    the delivered tokens, and the continuation would come out correlated with them."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{delivered}".encode(), digest_size=8).digest(), "big")


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, V] probabilities (unnormalised allowed) -> [B] sampled ids (int64): one uniform draw a row
    against the cumulative distribution (float64), never a token of probability 0. multinomial drew an
    exponential for every token of the vocabulary: 1 ms a row at 49k tokens."""
    cdf = probs.double().cumsum(-1)
    total = cdf[..., -1]
    # As multinomial did: a row that is no distribution (a NaN or negative q from a broken drafter) raises,
    # and the caller ends that row's group.
    if not (torch.isfinite(total).all() and (total > 0).all() and (probs.amin(-1) >= 0).all()):
        raise RuntimeError("sample: every row must be finite, non-negative and not all zero")
    u = torch.rand((*probs.shape[:-1], 1), generator=generator, dtype=torch.float64, device=probs.device)
    picked = torch.searchsorted(cdf, u * cdf[..., -1:], right=True)
    return picked.squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def sample_from_logits(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """[B, V] logits -> [B] next tokens under params."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(logits_to_probs(logits, params), generator)
