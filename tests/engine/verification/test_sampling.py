"""The engine's sampler (engine/verification/sampling.py) against the numpy reference written from the definitions
(tests/reference_sampling.py), one parameter at a time with the cut placed at a known token, then
composed. Each cut is checked on both sides of its boundary and exactly on it (ties, mass exactly
top_p, p exactly min_p * p_max), so a version one token off at the cut fails; the hand-written cases
check the reference itself."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from specpool.engine.verification import sampling
from specpool.engine.verification.sampling import SamplingParams, logits_to_probs
from tests.reference_sampling import assert_matches_reference, reference_probs
from tests.stats import exact_probs

V = 16
ROWS = 64  # random logit vectors per case
# A parameter is placed this share of a token's own probability (or of its p / p_max) from the token's
# boundary: far above float32 rounding, below the gap to the neighbouring token (3.3% at T 1.5).
MARGIN = 0.02


@pytest.fixture(autouse=True, params=[sampling.TOP_P_CANDIDATES, 4], ids=["top-p-candidates", "top-p-4-candidates"])
def top_p_candidates(request, monkeypatch):
    """Every check twice: with top-p's candidates covering this vocabulary, and with 4 of its 16 tokens,
    so a cut within the candidates and one beyond them (the full sort) both meet the reference."""
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", request.param)
    return request.param


def random_logits(seed: int, rows: int = ROWS) -> torch.Tensor:
    """[rows, V] logits in random order, neighbours 0.05 to 0.3 apart: every token holds enough mass
    (>= 5e-4 at T 1) for a cut placed beside it to sit clear of float32 rounding."""
    gen = torch.Generator().manual_seed(seed)
    values = (0.05 + 0.25 * torch.rand(rows, V, generator=gen)).cumsum(-1)
    return torch.gather(values, -1, torch.rand(rows, V, generator=gen).argsort(-1))


def check(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """Asserts engine == reference; -> the set each row keeps, [rows, V] bool."""
    probs = logits_to_probs(logits, params)
    assert_matches_reference(probs.numpy(), logits.numpy(), params)
    return probs.numpy() > 0


def test_temperature_scales_the_logits():
    logits = random_logits(0)
    for temperature in (0.25, 0.7, 1.0, 1.5, 4.0):
        check(logits, SamplingParams(temperature=temperature))
    # By hand: logits ln 1, ln 2, ln 4 at T 2 give weights 1 : sqrt 2 : 2.
    logits = torch.tensor([0.0, math.log(2), math.log(4)])
    by_hand = np.array([1, math.sqrt(2), 2]) / (3 + math.sqrt(2))
    assert reference_probs(logits.numpy(), 2.0) == pytest.approx(by_hand, rel=1e-6)
    assert check(logits[None], SamplingParams(temperature=2.0)).all()


def test_temperature_limits_are_greedy_and_uniform_over_tied_maxima():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0]])
    assert check(logits, SamplingParams(temperature=0.0)).tolist() == [[False, True, False, False]]
    assert check(logits, SamplingParams(temperature=1e-45)).tolist() == [[False, True, True, False]]


@pytest.mark.parametrize("k", range(1, V))
def test_top_k_keeps_the_k_largest(k):
    kept = check(random_logits(k), SamplingParams(temperature=1.0, top_k=k))
    assert (kept.sum(-1) == k).all()


def test_top_k_keeps_every_token_tied_at_the_cut():
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])
    for k, kept in ((1, 1), (2, 4), (3, 4), (4, 4), (5, 5)):
        assert check(logits, SamplingParams(temperature=1.0, top_k=k)).sum() == kept


@pytest.mark.parametrize("cut", range(V - 1))
def test_top_p_keeps_the_token_that_crosses_it(cut):
    """top_p just below / just above the mass of the `cut + 1` most probable tokens."""
    logits = random_logits(100 + cut)
    sorted_probs = np.sort(reference_probs(logits.numpy(), 1.0), -1)[:, ::-1]  # [rows, V]
    mass = sorted_probs.cumsum(-1)[:, cut]
    below, above = mass - MARGIN * sorted_probs[:, cut], mass + MARGIN * sorted_probs[:, cut + 1]
    for top_p, kept in ((below, cut + 1), (above, cut + 2)):
        for row, p in zip(logits, top_p, strict=True):
            assert check(row[None], SamplingParams(temperature=1.0, top_p=float(p))).sum() == kept


def test_top_p_at_exactly_its_mass_stops_there_and_breaks_ties_by_id():
    """32 tied tokens of 1/32 each (exact in float32): every top_p = m/32 is reached exactly by the m
    lowest ids. (torch's default sort orders 32 ties 16, 31, 30, ..: an unstable top-p fails here.)"""
    logits = torch.zeros(1, 32)
    for m in range(1, 32):
        kept = check(logits, SamplingParams(temperature=1.0, top_p=m / 32))
        assert kept[0].tolist() == [True] * m + [False] * (32 - m)


@pytest.mark.parametrize("cut", range(1, V))
def test_min_p_keeps_tokens_at_least_min_p_times_the_most_probable(cut):
    """min_p just below / just above p / p_max of the `cut + 1`-th most probable token."""
    logits = random_logits(200 + cut)
    for temperature in (0.7, 1.5):
        probs = reference_probs(logits.numpy(), temperature)
        ratio = np.sort(probs, -1)[:, ::-1][:, cut] / probs.max(-1)  # [rows]
        for min_p, kept in ((ratio * (1 - MARGIN), cut + 1), (ratio * (1 + MARGIN), cut)):
            for row, m in zip(logits, min_p, strict=True):
                assert check(row[None], SamplingParams(temperature=temperature, min_p=float(m))).sum() == kept


def test_min_p_at_exactly_min_p_times_the_most_probable_keeps_the_token():
    """min_p 1: p = p_max exactly for every token tied with the most probable, and they all stay."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0, 1.999]])
    assert check(logits, SamplingParams(temperature=1.0, min_p=1.0)).tolist() == [[False, True, False, True, False]]


def test_the_cuts_compose_in_the_documented_order():
    """p = 0.5, 0.3, 0.1, 0.1. Top-k 3 keeps all four (both 0.1 tie with the 3rd largest); top_p 0.6
    then keeps 0.5 and 0.3 (the mass before 0.3 is 0.5 < 0.6); min_p 0.3 keeps p >= 0.15, the same
    two. Had min-p gone before top-p, top-p would read 0.625, 0.375 and keep the first alone."""
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.1), math.log(0.1)]])
    assert check(logits, SamplingParams(temperature=1.0, top_k=3)).sum() == 4
    kept = check(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.6, min_p=0.3))
    assert kept.tolist() == [[True, True, False, False]]


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0, 2.0])
def test_every_combination_matches_the_reference(temperature):
    logits = random_logits(300, rows=16) * 2
    for top_k in (0, 1, 4, 12):
        for top_p in (1.0, 0.95, 0.6, 0.2):
            for min_p in (0.0, 0.02, 0.3):
                check(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))


@pytest.mark.parametrize("field, value", [("temperature", -0.1), ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5),
                                          ("min_p", -0.1), ("min_p", 1.5), ("min_p", math.nan)])
def test_out_of_range_params_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must"):
        SamplingParams(**{field: value}).validate()


def test_every_exact_distribution_is_checked_against_the_reference(monkeypatch):
    """The lossless tests' exact distributions come from tests/stats.exact_probs: a sampler one token
    off at the top-k cut stops them there instead of moving their exact distribution with it."""
    real = sampling.logits_to_probs
    monkeypatch.setattr(sampling, "logits_to_probs", lambda logits, params: real(
        logits, dataclasses.replace(params, top_k=params.top_k + 1)))
    with pytest.raises(AssertionError, match="keeps tokens the reference cuts"):
        exact_probs(random_logits(0), SamplingParams(temperature=1.0, top_k=3))


def test_sample_draws_each_token_at_its_probability_and_never_one_of_probability_zero():
    """One uniform a row against the cumulative distribution: frequencies within 5 standard errors of
    the (renormalised) probabilities over 40k draws, and a token of probability 0 never drawn, also
    beside ties and at either end of the vocabulary."""
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
                          [3.0, 1.0, 0.0, 1.0, 0.0, 0.0]])  # unnormalised: 0.6, 0.2, 0.2
    gen = torch.Generator().manual_seed(0)
    n = 40_000
    draws = sampling.sample(probs.repeat(n, 1), gen).view(n, len(probs))
    for row, p in enumerate(probs / probs.sum(-1, keepdim=True)):
        freq = torch.bincount(draws[:, row], minlength=len(p)).double() / n
        assert (freq[p == 0] == 0).all(), f"row {row} drew a token of probability 0"
        tolerance = 5 * (p.double() * (1 - p.double()) / n).sqrt() + 1e-12
        assert ((freq - p.double()).abs() <= tolerance).all(), (row, freq.tolist(), p.tolist())


@pytest.mark.parametrize("row", [[0.5, float("nan"), 0.5], [0.5, -0.1, 0.6], [0.0, 0.0, 0.0], [float("inf"), 0.0, 1.0]])
def test_sample_refuses_a_row_that_is_no_distribution(row):
    """A broken drafter's q reaches `sample` through the residual: it must raise (the decoder ends that
    group), never pick a token from it."""
    with pytest.raises(RuntimeError, match="finite, non-negative"):
        sampling.sample(torch.tensor([[0.2, 0.3, 0.5], row]))
