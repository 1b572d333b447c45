"""Total-variation checks against the sampling noise floor, shared by every lossless test."""

from __future__ import annotations

import math

import torch
from torch import Tensor

DELTA = 1e-6  # allowed false-failure probability of one correct statistic


def tv(counts: Tensor, exact: Tensor) -> float:
    return 0.5 * (counts.double() / counts.sum() - exact.double()).abs().sum().item()


def tv_threshold(exact: Tensor, n: int, gen: torch.Generator, draws: int = 5) -> tuple[float, float]:
    """-> (threshold, empirical noise floor) for the TV of n samples against `exact`.

    Theory: E[TV] = 1/2 sum_i E|p̂_i - p_i| <= 1/2 sum_i sqrt(p_i (1 - p_i) / n) (Jensen; the usual
    approximation sum_i sqrt(p_i (1 - p_i) / (2 pi n)) is 1.25x smaller). The n rows are independent and
    moving one row's outcome changes TV by at most 1/n, so McDiarmid gives
    P(TV > E[TV] + t) <= exp(-2 n t^2); t = sqrt(ln(1/DELTA) / (2n)) makes a correct verifier fail with
    probability <= DELTA whatever the seed (n = 100k: ~0.0083 on top of a ~0.01-0.02 mean).
    The empirical floor (max TV of `draws` direct samples) is 2x'd and can only raise the threshold:
    a guard against a slip in the theory, never a way to make the check stricter.
    """
    p = exact.double()
    bound = 0.5 * (p * (1 - p) / n).sqrt().sum().item() + math.sqrt(math.log(1 / DELTA) / (2 * n))
    floor = max(
        tv(torch.bincount(torch.multinomial(p, n, replacement=True, generator=gen), minlength=p.numel()), p)
        for _ in range(draws)
    )
    return max(bound, 2 * floor), floor
