"""Total variation against an exact distribution: the statistic every lossless test uses, its null
threshold, and the smallest bias a test catches.

A test draws n rows from the path under test, counts the outcomes and compares them with the exact
distribution p enumerated from the target model: TV = 1/2 sum_i |count_i / n - p_i|.

The threshold is the null distribution's mean + Z sd, both simulated (seeded) for this p and this n:
counts of n rows drawn exactly from Multinomial(n, p), NULL_DRAWS times. The null TV is a sum of
folded normals, close to Gaussian for many cells and right-skewed for few. Simulated at 2 x 10^5 draws
(n = 100k, random p), the share of null draws above mean + z sd was:

    cells   z = 3     z = 4     z = 5     (Gaussian: 1.3e-3, 3.2e-5, 2.9e-7)
    8       5.1e-3    5.0e-4    2.5e-5
    64      2.7e-3    1.5e-4    5.0e-6
    512     1.7e-3    3.5e-5    0

falling by 20x or more per sd, so Z = 6 keeps a correct path's false failure near 1e-6 per statistic.
(The distribution-free bound used before, a Jensen bound on the mean plus McDiarmid's
sqrt(ln(1/delta) / 2n), sat about twice as far above the null mean at n = 100k: 0.010-0.011
against 0.0054 here, so a bias had to be twice as large to be seen.)

Power: a bug moves the sampled distribution from p to some p'. `detection_limit` finds the smallest
TV(p', p) along a given direction (a biased twin's measured distribution) that the threshold catches
with 95% probability, by simulating n rows from p' = p + b (toward - p) / TV(toward, p).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

Z = 6.0
NULL_DRAWS = 2000
POWER_DRAWS = 400

# Two tiers. `make test` (CI, a hard 90-minute wall on 2 cores) runs the costly lossless tests (through
# the servers, SSD) at the rows their mechanism's strong twin is caught at, the cheap ones at full power; `make test-full` (SPECPOOL_TEST_FULL_POWER=1) runs them at the
# power tests/README.md's table gives, and adds the tests marked `full_power` (tests/conftest.py
# deselects them in the CI tier): the twins placed just above that power's detection limit, and the
# twins of a mechanism's variants (SSD pull beside push: the same twin, caught in both tiers on push).
FULL_POWER = os.environ.get("SPECPOOL_TEST_FULL_POWER") == "1"


def rows(full: int, ci: int) -> int:
    """A lossless test's rows: `full` at full power, `ci` in the CI tier."""
    return full if FULL_POWER else ci


def tv(counts: Tensor, exact: Tensor) -> float:
    return _tvs(counts.double(), exact, int(counts.sum())).item()


def sample_counts(p: Tensor, n: int, draws: int, gen: torch.Generator) -> Tensor:
    """[draws, cells] outcome counts of n rows drawn from p, each draw exact (a binomial per cell)."""
    p = p.double().clamp(min=0)
    p = p / p.sum()
    out = torch.empty(draws, p.numel(), dtype=torch.float64)
    left, mass = torch.full((draws,), float(n), dtype=torch.float64), 1.0
    for i in range(p.numel() - 1):
        share = min(1.0, float(p[i]) / mass) if mass > 0 else 0.0
        out[:, i] = torch.binomial(left, torch.full_like(left, share), generator=gen)
        left -= out[:, i]
        mass -= float(p[i])
    out[:, -1] = left
    return out


def _tvs(counts: Tensor, exact: Tensor, n: int) -> Tensor:
    return 0.5 * (counts / n - exact.double()).abs().sum(-1)


@dataclass(frozen=True)
class Threshold:
    value: float
    null_mean: float
    null_sd: float


def tv_threshold(exact: Tensor, n: int, seed: int = 0) -> Threshold:
    """The TV that n rows of a correct path exceed with probability ~1e-6 (see the module doc)."""
    null = _tvs(sample_counts(exact, n, NULL_DRAWS, torch.Generator().manual_seed(seed)), exact, n)
    mean, sd = null.mean().item(), null.std().item()
    return Threshold(mean + Z * sd, mean, sd)


def detection_limit(exact: Tensor, n: int, threshold: float, toward: Tensor, power: float = 0.95,
                    seed: int = 0) -> float:
    """The smallest bias b = TV(p', exact), p' on the segment from exact to `toward`, that n rows
    push above `threshold` with probability >= power; inf if even `toward` itself is not caught."""
    exact, toward = exact.double(), toward.double() / toward.sum()
    full = 0.5 * (toward - exact).abs().sum().item()
    gen = torch.Generator().manual_seed(seed)

    def caught(b: float) -> bool:
        p = exact + (b / full) * (toward - exact)
        return (_tvs(sample_counts(p, n, POWER_DRAWS, gen), exact, n) > threshold).double().mean() >= power

    if full == 0 or not caught(full):
        return float("inf")
    lo, hi = 0.0, full
    for _ in range(20):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if caught(mid) else (mid, hi)
    return hi


@dataclass(frozen=True, repr=False)
class TvCheck:
    """One lossless statistic: n rows' counts against the exact distribution."""

    name: str
    counts: Tensor
    exact: Tensor
    threshold: Threshold

    @property
    def n(self) -> int:
        return int(self.counts.sum())

    @property
    def distance(self) -> float:
        return tv(self.counts, self.exact)

    @property
    def passed(self) -> bool:
        return self.distance < self.threshold.value

    def __repr__(self) -> str:
        return (f"{self.name}: TV {self.distance:.4f} vs threshold {self.threshold.value:.4f} "
                f"(null mean {self.threshold.null_mean:.4f}, sd {self.threshold.null_sd:.4f}, n {self.n})")


def check_tv(name: str, outcomes: Tensor, exact: Tensor, seed: int = 0) -> TvCheck:
    """outcomes: [n] cell indices into `exact`."""
    counts = torch.bincount(outcomes.flatten().long(), minlength=exact.numel())
    return TvCheck(name, counts, exact, tv_threshold(exact, int(counts.sum()), seed))


def report(check: TvCheck, twin: bool = False, at_n: int | None = None, **shares: float) -> None:
    """One line per test for the correctness table (tests/README.md); `pytest -s` shows it. A twin's
    line adds its TV over the threshold and the smallest bias along its direction that a test of
    `at_n` rows (default: the twin's own) catches with 95% power."""
    parts = [str(check)] + [f"{k} {v:.3f}" for k, v in shares.items()]
    if twin:
        n = at_n or check.n
        threshold = check.threshold.value if n == check.n else tv_threshold(check.exact, n).value
        limit = detection_limit(check.exact, n, threshold, check.counts.double() / check.n)
        parts.append(f"{check.distance / check.threshold.value:.2f}x threshold; 95%-power limit along this "
                     f"bias at n {n}: {limit:.4f}")
    print(("TWIN | " if twin else "LOSSLESS | ") + " | ".join(parts))


def exact_probs(logits: Tensor, params) -> Tensor:
    """[..., V] logits -> the engine's sampled distribution under params (logits_to_probs), asserted
    equal to the numpy reference's (tests/reference_sampling.py): every exact distribution a lossless
    test compares with comes from here, so a temperature / top-k / top-p / min-p bug in the engine
    fails the test instead of moving its exact distribution along with its samples."""
    from specpool.engine.verification.sampling import logits_to_probs
    from tests.reference_sampling import assert_matches_reference

    probs = logits_to_probs(logits, params)
    assert_matches_reference(probs.numpy(), logits.detach().float().numpy(), params)
    return probs


def exact_joint(model, prompt: list[int], params, first: int, last: int) -> Tensor:
    """p(t_first .. t_last | prompt) over generated tokens t_0, t_1, .. (0 is the prefill's), the
    earlier ones marginalised, enumerated from the model: [V ** (last - first + 1)], row-major."""
    v, length = model.config.vocab_size, last + 1
    cache = model.new_cache(v ** (length - 1) + 1, len(prompt) + length)
    # As decoding runs it: the prompt through a prefill step, the generated tokens through decode or verify
    # steps (a quantized model's prefill runs other kernels than its verify steps).
    p0 = exact_probs(model.forward(cache, [cache.allocate()], [prompt], prefill=True), params)[0].double()  # [V]
    if length == 1:
        return p0
    prefixes = torch.cartesian_prod(*[torch.arange(v)] * (length - 1)).reshape(-1, length - 1)  # t_0..t_{L-2}
    slots = [cache.allocate() for _ in range(len(prefixes))]
    model.forward(cache, slots, [prompt] * len(slots), prefill=True)
    logits = model.forward(cache, slots, prefixes.tolist(), all_logits=True)
    p = exact_probs(logits, params).double()  # [R, L-1, V]: p(t_i | .. t_{i-1})
    rows, joint = torch.arange(len(prefixes)), p0[prefixes[:, 0]]
    for i in range(1, length - 1):
        joint = joint * p[rows, i - 1, prefixes[:, i]]
    joint = (joint[:, None] * p[:, -1]).reshape([v] * length)  # every t_0..t_{L-1}
    return joint.sum(dim=tuple(range(first))).reshape(-1) if first else joint.reshape(-1)


def cells(tokens: list[list[int]], first: int, last: int, vocab: int) -> Tensor:
    """Each row's t_first..t_last as one cell index into exact_joint's output."""
    window = torch.tensor([row[first:last + 1] for row in tokens])
    return (window * vocab ** torch.arange(last - first, -1, -1)).sum(-1)


# -- through the path: one bound for every SSD test's shares ------------------------------------------

PATH_SHARE = 0.25


def assert_through_the_path(shares: dict[str, float], n: int, path: str = "cache hit",
                            forgiven_late_rows: int = 0) -> None:
    """The one bound on the shares a lossless test reports for the path it names (SSD: the cache hit
    share), and, through the servers, on the rows that left the path (the fallback share).

    The path's share h >= PATH_SHARE = 1/4. A bias confined to a path carrying a share h of the scored
    rows moves their distribution by h times its size (the other rows are exact), so the test catches
    it once it is 1/h times the limit tests/README.md's table gives for the test: the path is proven as
    h^2 n rows through it alone would prove it. h >= 1/4 keeps that within 4x of the table's limit
    (n/16 rows). 4x is what the tests' own cache-path twin still clears: engine/drafters/test_ssd's twin nearest
    its limit (only cache hits misreport q, 0.15) is caught at 1.45x its threshold with 0.31 of its rows
    through the cache, so down to a share of about 0.31 / 1.45 = 0.21 < 1/4. The floor is the same for
    every test (in-process, on the real head, through the servers, push or pull); a test whose
    configuration gives less has its configuration changed, never its bound or its prompt picked. The
    path is the one the test names, for a twin the one its bias lives on: the cache hits for SSD's
    lossless tests and cache twins, every draft SSD's model sampled (`drafted`: a hit or a neural miss)
    for the top-32 cut and the unrescaled Saguaro q, which bias the drafts wherever they are sampled.

    The fallback share (rows with a round drafted by the target's own n-gram index because the
    endpoint's reply came late, through the servers) <= forgiven_late_rows / n. The target's
    DeadlineBreaker treats up to trip_after - 1 late rounds in a row as a healthy endpoint's noise and
    opens on the next; a round covers at most the target's batch of rows. So forgiven_late_rows =
    (trip_after - 1) x rows a round: a run may be as late, over all its rows, as the breaker forgives
    before acting; more is an endpoint (or a deadline) the breaker would act on, not the path the
    test names. Tests without an endpoint report no fallback share; where they do, it is 0 here."""
    failures = []
    if shares[path] < PATH_SHARE:
        failures.append(f"{path} share {shares[path]:.3f} < {PATH_SHARE} of the scored rows: a bias confined to "
                        f"the path would be caught only at {1 / shares[path] if shares[path] else float('inf'):.1f}x "
                        f"the test's limit")
    if "fallback" in shares and shares["fallback"] > forgiven_late_rows / n:
        failures.append(f"fallback share {shares['fallback']:.3f} > {forgiven_late_rows} rows / {n} = "
                        f"{forgiven_late_rows / n:.3f}: later than the deadline breaker forgives")
    assert not failures, "; ".join(failures) + f" ({shares})"
