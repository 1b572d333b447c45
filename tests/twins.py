"""Biased twins: the real drafters and verifier with one thing deliberately wrong, by a tunable
`strength`, for the lossless tests to catch. In-process tests apply them with `biased(...)`; server
tests start a server under one with `python -m tests.twins KIND STRENGTH specpool-args...`.

- "misreported-q": a model drafter (plain, or SSD's with Saguaro rescaling and its cache) samples
  from q but reports q^(1 - strength), renormalised, so the verifier accepts with the wrong ratio.
- "misreported-cache-q": the same for the speculation cache only: SSD's pre-speculated forks carry
  a misreported q (whether the target or the endpoint looks them up).
- "leaky-residual": point-mass verification (n-gram and other deterministic drafts) leaves
  `strength` of the rejected token's mass in the residual instead of removing it.
- "leaky-siblings": token-tree verification leaves `strength` of the tried siblings' mass in the
  residual of the multi-candidate rule instead of removing it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch
from torch import Tensor

from specpool.engine import decoding
from specpool.engine.drafters.base import Drafts
from specpool.engine.drafters.model import ModelDrafter
from specpool.engine.drafters.ssd import SsdDrafter
from specpool.engine.verification import rules as ver

KINDS = ("misreported-q", "misreported-cache-q", "leaky-residual", "leaky-siblings")


def temper(probs: Tensor, strength: float) -> Tensor:
    flat = probs.double().clamp(min=0) ** (1 - strength)
    return (flat / flat.sum(-1, keepdim=True)).to(probs.dtype)


def _misreporting_propose(strength: float):
    real = ModelDrafter.propose

    def propose(self, *args, **kwargs) -> Drafts:
        d = real(self, *args, **kwargs)
        return dataclasses.replace(d, probs=None if d.probs is None else temper(d.probs, strength),
                                   topk_probs=None if d.topk_probs is None else temper(d.topk_probs, strength))

    return propose


def _misreporting_ssd_sample(strength: float):
    real = SsdDrafter._sample

    def _sample(self, logits, params):
        picked, ids, weights = real(self, logits, params)
        return picked, ids, None if weights is None else temper(weights, strength)

    return _sample


def _misreporting_tree_decode(strength: float):
    real = SsdDrafter._tree_decode

    def _tree_decode(self, forks, k_next):
        real(self, forks, k_next)
        for seq, outcome, _ in forks:
            fork = seq.forks[outcome]
            if fork.topk_probs is not None:
                fork.topk_probs = temper(fork.topk_probs, strength)

    return _tree_decode


def leaky_point_mass(strength: float):
    def verify_point_mass(draft_tokens, target_probs, num_drafts, generator=None):
        k = draft_tokens.shape[1]
        valid, tokens = ver._real_slots(draft_tokens, num_drafts)
        p_x = target_probs[:, :k].gather(-1, tokens[..., None]).squeeze(-1)
        accepted = ver._accept_prefix(p_x, torch.ones_like(p_x), valid, generator)
        bonus = accepted == num_drafts
        p_row = ver._rows(target_probs, accepted)
        if k == 0:
            return ver.VerifyResult(accepted, ver.sample(p_row, generator))
        rejected = torch.where(bonus, 0, ver._rows(tokens, ver._draft_slot(accepted, k)))[:, None]
        residual = p_row.scatter(-1, rejected, strength * p_row.gather(-1, rejected))  # the bug: not 0
        return ver.VerifyResult(accepted, ver._sample_next(p_row, residual, bonus, generator))

    return verify_point_mass


def leaky_candidates(strength: float):
    real = ver.verify_candidates

    def verify_candidates(candidate_tokens, num_candidates, target_probs, generator=None):
        idx, token = real(candidate_tokens, num_candidates, target_probs, generator)
        valid, tokens = ver._real_slots(candidate_tokens, num_candidates)
        tried = torch.zeros_like(target_probs).scatter_add_(-1, tokens, valid.to(target_probs.dtype)) > 0
        leaky = target_probs * torch.where(tried, strength, 1.0)  # the bug: tried tokens keep some mass
        redrawn = ver._sample_next(target_probs, leaky, torch.zeros_like(idx, dtype=torch.bool), generator)
        return idx, torch.where(idx >= 0, token, redrawn)

    return verify_candidates


@contextmanager
def biased(kind: str, strength: float) -> Iterator[None]:
    with ExitStack() as stack:
        if kind == "misreported-q":
            stack.enter_context(mock.patch.object(ModelDrafter, "propose", _misreporting_propose(strength)))
            stack.enter_context(mock.patch.object(SsdDrafter, "_sample", _misreporting_ssd_sample(strength)))
        elif kind == "misreported-cache-q":
            stack.enter_context(mock.patch.object(SsdDrafter, "_tree_decode", _misreporting_tree_decode(strength)))
        elif kind == "leaky-siblings":
            stack.enter_context(mock.patch.object(ver, "verify_candidates", leaky_candidates(strength)))
        elif kind == "leaky-residual":
            stack.enter_context(mock.patch.object(decoding, "verify_point_mass", leaky_point_mass(strength)))
        else:
            raise ValueError(f"twin kind {kind!r}: one of {KINDS}")
        yield


if __name__ == "__main__":
    from specpool.cli import main

    kind, strength, *args = sys.argv[1:]
    with biased(kind, float(strength)):
        sys.exit(main(args))
