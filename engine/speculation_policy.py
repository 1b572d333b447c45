"""How many tokens to speculate per sequence: SSSD's hardware-aware budget, from measured costs.

A verify step of b sequences with s drafts each costs T(b, s), measured once per model, dtype and
thread count (a few seconds) and cached. A step yields E(s) tokens per sequence: measured per
draft position from recent rounds (AcceptanceEstimate), or, with one per-token acceptance alpha,
(1 - alpha^(s+1)) / (1 - alpha). The policy picks the s that maximises
b * E(s) / (T(b, s) + D(b, s)), D being the drafting time (zero for n-gram lookups), and s = 0
(plain decoding) when no s beats it. As the batch grows the target turns compute-bound, T grows
with s, and the budget shrinks, as in SSSD (s ~ I_knee / b). What real rounds take beyond the table
(RoundSlowdown, told by the decoder after each round) scales both sides of that comparison.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from specpool.engine.method import MIN_GAIN
from specpool.engine.plan import SpeculationPlan, TreeShape
from specpool.engine.runtime.device import cpu_class, kernel_isa
from specpool.engine.runtime.model import Llama

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 32)
# 3, 7 and 11 end a block of 4 rows (s + 1 = 4, 8, 12): the int4 kernel's cost steps up after each
# (engine/runtime/linear.py), and interpolating across a step would price s = 7 between two and three blocks.
DRAFT_LENS = (0, 1, 2, 3, 4, 6, 7, 8, 11, 12, 16)
STALE_TABLE = 0.75  # a cached T(1, 0) this much slower than a fresh check is re-measured


@dataclass(frozen=True)
class StepCosts:
    """Measured seconds of one forward with b sequences feeding s+1 tokens each."""

    batch_sizes: tuple[int, ...]
    draft_lens: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]  # [batch size][draft len]

    # Cached: a policy prices every length at every round, and interpolating afresh cost 0.25-0.4 ms a
    # round (2% of a 16 ms batch-1 step). A process holds a few tables for its life: nothing leaks.
    @functools.lru_cache(maxsize=4096)  # noqa: B019
    def __call__(self, batch_size: int, draft_len: int) -> float:
        """Piecewise-linear in both batch size and draft length; linear extrapolation past the table."""
        per_b = [self._along_draft_len(row, draft_len) for row in self.seconds]
        bs = self.batch_sizes
        if batch_size <= bs[-1]:
            return float(np.interp(batch_size, bs, per_b))
        slope = (per_b[-1] - per_b[-2]) / (bs[-1] - bs[-2])
        return per_b[-1] + slope * (batch_size - bs[-1])

    def _along_draft_len(self, row: tuple[float, ...], draft_len: int) -> float:
        lens = self.draft_lens
        if draft_len <= lens[-1]:
            return float(np.interp(draft_len, lens, row))
        # Long feeds (a drafter catching up on a context) are compute-bound: at least the mean
        # per-token cost of the longest measured step, whatever noise says about the local slope.
        slope = max((row[-1] - row[-2]) / (lens[-1] - lens[-2]), row[-1] / (lens[-1] + 1))
        return row[-1] + slope * (draft_len - lens[-1])


def measure_step_costs(
    model: Llama,
    batch_sizes=BATCH_SIZES,
    draft_lens=DRAFT_LENS,
    context_len: int = 128,
    repeats: int = 3,
) -> StepCosts:
    """Time verify steps on a synthetic context: the fastest of `repeats` per cell, made non-decreasing in s."""
    cache = model.new_cache(max(batch_sizes), context_len + max(draft_lens) + 1)
    slots = [cache.allocate() for _ in range(max(batch_sizes))]
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(0, model.config.vocab_size, (context_len,), generator=gen).tolist()
    def feed(rows: list[list[int]], **kwargs):
        if model.config.feature_fed:  # a draft head: any features cost the same
            kwargs["fed_features"] = torch.zeros(len(rows), len(rows[0]), model.config.d_model)
        model.forward(cache, slots[: len(rows)], rows, **kwargs)

    feed([context] * len(slots))
    cells = [(b, s) for b in batch_sizes for s in draft_lens]
    best = dict.fromkeys(cells, float("inf"))
    # Every cell is timed once per pass, so a slow spell of a shared machine slows all cells alike
    # instead of bending the table's shape; the first pass warms up allocations.
    for rep in range(repeats + 1):
        for b, s in cells:
            start = time.perf_counter()
            feed([context[: s + 1]] * b, all_logits=True)
            elapsed = time.perf_counter() - start
            for slot in slots[:b]:
                cache.truncate(slot, context_len)
            if rep:  # the fastest run: on a shared machine the others were interrupted, not slower
                best[b, s] = min(best[b, s], elapsed)
    table = [tuple(_non_decreasing([best[b, s] for s in draft_lens])) for b in batch_sizes]
    return StepCosts(tuple(batch_sizes), tuple(draft_lens), tuple(table))


def _non_decreasing(row: list[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators): feeding more tokens never costs
    less, so a dip in a measured row is noise and must not make the policy prefer it."""
    blocks: list[list[float]] = []  # [mean, count]
    for x in row:
        blocks.append([x, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def cached_step_costs(model: Llama, model_id: str, cache_dir: Path | None = None, **kwargs) -> StepCosts:
    """measure_step_costs, cached on disk per model (its name and its weights' fingerprint: a head retrained
    into the same directory is another model), weight format (q4, fp32 or bf16: a table measured with
    dense weights says nothing about the int4 kernel's), device, thread count and CPU class (a table
    measured with AVX-512 kernels says nothing about the same disk's next machine, an AVX2 one)."""
    path, key = _cache_path(model, model_id, torch.get_num_threads(), cache_dir, kwargs)
    if path.exists():
        costs = _read_costs(path)
        # A table measured while another job loaded the machine is slow throughout and would make
        # speculation look worse than it is, for good: re-measure when a quick check is clearly faster.
        now = measure_step_costs(model, (1,), (0,), kwargs.get("context_len", 128), repeats=3).seconds[0][0]
        if now >= STALE_TABLE * costs(1, 0):
            return costs
        log.info("cached step costs of %s are stale (%.1f ms now vs %.1f ms cached): measuring again",
                 model_id, now * 1e3, costs(1, 0) * 1e3)
    costs = measure_step_costs(model, **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(costs) | {"key": key}))
    return costs


def peek_step_costs(model: Llama, model_id: str, threads: int, cache_dir: Path | None = None,
                    **kwargs) -> StepCosts | None:
    """The table cached_step_costs keeps for this model at `threads` threads, read as it is (neither
    measured nor checked for staleness: other threads' tables cannot be checked from this process);
    None when none is cached."""
    path, _ = _cache_path(model, model_id, threads, cache_dir, kwargs)
    return _read_costs(path) if path.exists() else None


def _cache_path(model: Llama, model_id: str, threads: int, cache_dir: Path | None, kwargs: dict) -> tuple[Path, str]:
    fmt = model.format
    key = (f"v6|{model_id}|{model.fingerprint}|{fmt.name}|{model.dtype}|{fmt.dense_dtype}|{model.device}|{threads}"
           f"|{cpu_class()}|{kwargs}")
    if fmt.own_kernels:  # a table measured with an older build of the kernels says little about this one
        from specpool.engine.runtime import kernels

        key += f"|{kernels.build_name(kernel_isa())}"
    cache_dir = cache_dir or Path.home() / ".cache" / "specpool" / "step-costs"
    return cache_dir / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".json"), key


def _read_costs(path: Path) -> StepCosts:
    data = json.loads(path.read_text())
    return StepCosts(tuple(data["batch_sizes"]), tuple(data["draft_lens"]), tuple(map(tuple, data["seconds"])))


class AcceptanceEstimate:
    """How many tokens a draft of length s yields per verify step, from recent rounds.

    Per draft position j it keeps (decayed) counts of the rounds that reached j (drafts 1..j-1
    accepted) and of those that accepted it: a survival estimate, not one per-token alpha. Drafts
    are not i.i.d.: an n-gram draft that matches a copied run tends to keep matching, so later
    positions are accepted more often than the first, and a single alpha would underrate long
    drafts. A position seen rarely leans on the one before it (the first on `prior_alpha`), so
    lengths never drafted yet are predicted from the deepest one measured.
    """

    def __init__(self, prior_alpha: float = 0.5, prior_weight: float = 2.0, decay: float = 0.98,
                 max_len: int = 32):
        self.prior_alpha = prior_alpha
        self.prior_weight = prior_weight
        self.decay = decay
        self.reached = [0.0] * max_len
        self.accepted = [0.0] * max_len
        self.offers = self.fills = 0.0  # rounds that offered positions, and those the drafter filled

    def update(self, accepted: int, offered: int, drafted: int) -> None:
        """One sequence's round that offered the drafter `offered` positions, of which it filled
        `drafted`. An empty position (an n-gram index with no match, a short draft) counts as a
        rejection: the policy must predict what an offer yields, not what a made draft does. Rounds
        that offered nothing fade the counts back toward the prior: a policy that stopped drafting
        must try again eventually."""
        self.reached = [self.decay * r for r in self.reached]
        self.accepted = [self.decay * a for a in self.accepted]
        for j in range(min(accepted + 1, offered, len(self.reached))):
            self.reached[j] += 1
            self.accepted[j] += j < accepted
        if offered:
            self.offers = self.decay * self.offers + 1
            self.fills = self.decay * self.fills + (drafted > 0)

    @property
    def fill(self) -> float:
        """The share of offers the drafter fills at all (1 for a draft model; an n-gram index finds a
        match for only some contexts). A batch in which no row drafted costs a plain step."""
        return (self.fills + self.prior_weight) / (self.offers + self.prior_weight)

    def expected_tokens(self, draft_len: int) -> float:
        """Tokens per sequence per verify step (bonus included) for drafts of this length."""
        total, survive, p = 1.0, 1.0, self.prior_alpha
        for j in range(draft_len):
            if j < len(self.reached):
                weight = self.reached[j] + self.prior_weight
                p = (self.accepted[j] + self.prior_weight * p) / weight if weight else p
            survive *= p
            total += survive
        return total


def expected_tokens(alpha: float, draft_len: int) -> float:
    """Tokens per sequence per verify step (bonus included) with i.i.d. per-token acceptance alpha."""
    if alpha >= 1.0:
        return draft_len + 1.0
    return (1 - alpha ** (draft_len + 1)) / (1 - alpha)


Expected = Callable[[int], float]  # draft length -> tokens per sequence per verify step


def as_expected(acceptance: Expected | float) -> Expected:
    """A per-token acceptance alpha (i.i.d. drafts) or a measured curve, as a curve."""
    if callable(acceptance):
        return acceptance
    return lambda s: expected_tokens(acceptance, s)


class RoundSlowdown:
    """How much longer real rounds take than the cost table predicts, learned from the rounds run.

    The table times a bare forward; a real round also asks the drafter, samples, verifies, keeps the
    cache and updates every sequence, and each step of a draft model carries the same overheads. Near
    break-even that error decides: priced by the table alone, a draft model ran 0.94x AR at batch 1
    (q4, AMD EPYC). Learned as ratios (measured / predicted), so that they carry across draft lengths
    and batch sizes, apart for plain and for speculative rounds. The speculative ratio leans back on
    the plain one while the policy does not speculate, so that it tries again eventually, as
    AcceptanceEstimate leans back on its prior.
    """

    def __init__(self, decay: float = 0.98, prior_weight: float = 1.0):
        self.decay = decay
        self.prior_weight = prior_weight
        self._sums = [0.0, 0.0]  # decayed sums of measured / predicted, per kind of round
        self._weights = [0.0, 0.0]
        self._expected: tuple[int, float] | None = None  # (kind, predicted seconds) of the round chosen last

    def ratio(self, speculative: bool) -> float:
        """Measured / predicted seconds of a round of this kind (plain: 1 before any is measured;
        speculative: the plain ratio before any is measured)."""
        plain = (self._sums[0] + self.prior_weight) / (self._weights[0] + self.prior_weight)
        if not speculative:
            return plain
        return (self._sums[1] + self.prior_weight * plain) / (self._weights[1] + self.prior_weight)

    def expect(self, speculative: bool, seconds: float) -> None:
        """The policy's prediction for the round it has just chosen."""
        self._expected = (int(speculative), seconds)

    def observe(self, seconds: float) -> None:
        """The decoder's measurement of that round, drafting included (ignored when nothing was expected)."""
        if self._expected is None or self._expected[1] <= 0:
            return
        kind, predicted = self._expected
        self._expected = None
        self._sums = [self.decay * x for x in self._sums]
        self._weights = [self.decay * w for w in self._weights]
        self._sums[kind] += seconds / predicted
        self._weights[kind] += 1.0


@dataclass(frozen=True, slots=True)
class Running:
    """A running sequence, as a draft-length policy sees it."""

    seq_id: str
    unseen: int  # tokens its drafter holds but has not run its model over (its catch-up)
    remaining: int  # tokens it may still emit
    plan: SpeculationPlan | None = None  # how it speculates (None: as the decoder's drafter does)


class DraftLength(Protocol):
    """The one owner of how many tokens each running sequence may draft in a round."""

    max_draft: int  # the longest it ever chooses: the KV room every sequence keeps

    def lengths(self, batch: Sequence[Running], acceptance: AcceptanceEstimate) -> list[int]:
        """Per sequence of the batch, in order: the positions offered to the drafter (0: none)."""
        ...

    def observe(self, seconds: float) -> None:
        """The measured seconds of the round it last chose lengths for, drafting included."""
        ...

    def plain_round_s(self, batch_size: int) -> float | None:
        """The seconds a plain round of this batch size takes, as real ones run (None: not known, and
        no sequence's plan is dropped for measuring slower than it)."""
        ...


@dataclass(frozen=True)
class FixedDraftLength:
    """The same length every round (0: plain decoding)."""

    max_draft: int

    def lengths(self, batch: Sequence[Running], acceptance: AcceptanceEstimate) -> list[int]:
        return [self.max_draft] * len(batch)

    def observe(self, seconds: float) -> None:
        pass

    def plain_round_s(self, batch_size: int) -> float | None:
        return None  # a length forced on the decoder is kept, whatever it costs


PLAIN_DECODING = FixedDraftLength(0)


@dataclass(frozen=True)
class SpeculationPolicy:
    target_costs: StepCosts
    draft_costs: StepCosts | None = None  # None: drafting costs nothing measurable (n-gram)
    max_draft: int = 16
    min_gain: float = MIN_GAIN
    # A remote drafter's round trip beyond its drafting (wire, serialisation), measured by the caller.
    round_s: float = 0.0
    # The share of rounds whose drafting is on the critical path: SSD's misses (its hits were drafted
    # while the target verified).
    drafting_share: float = 1.0
    # The drafter grows token trees of this shape (the draft length is then the node budget): a draft
    # forward per level, the root's one token then up to `beam` nodes a level, not one per token.
    tree: TreeShape | None = None
    # What real rounds cost beyond the table, learned from them: shared by the copies a caller makes
    # with dataclasses.replace (a remote round's wire time, SSD's miss share), so each learns from all.
    slowdown: RoundSlowdown = field(default_factory=RoundSlowdown, compare=False)

    def step_time(self, batch_size: int, draft_len: int, fill: float = 1.0) -> float:
        """Expected seconds of a round offering draft_len positions per sequence, when the drafter fills
        a share `fill` of the offers: with no row drafted, the target runs a plain step."""
        if draft_len <= 0:
            return self.target_costs(batch_size, 0)
        drafting = self.round_s
        if self.draft_costs is not None:
            drafting += self.drafting_share * self.drafting_time(batch_size, draft_len)
        verify = self.target_costs(batch_size, draft_len)
        if fill < 1.0 and draft_len > 0:
            none_drafted = (1.0 - fill) ** batch_size
            verify = (1 - none_drafted) * verify + none_drafted * self.target_costs(batch_size, 0)
        return verify + drafting

    def drafting_time(self, batch_size: int, draft_len: int) -> float:
        """Seconds of the draft forwards that make drafts of this length (chains: one 1-token step a token)."""
        if self.tree is None:
            return draft_len * self.draft_costs(batch_size, 0)
        levels = min(draft_len, self.tree.max_depth)
        width = min(self.tree.beam, draft_len)
        return self.draft_costs(batch_size, 0) + (levels - 1) * self.draft_costs(batch_size, width - 1)

    def choose(self, batch_size: int, acceptance: Expected | float, catch_up: float = 0.0,
               remaining: float = float("inf"), fill: float = 1.0) -> int:
        """The draft length maximising expected tokens/s at this batch size (0: do not speculate).
        `acceptance`: AcceptanceEstimate.expected_tokens, or a per-token alpha of i.i.d. drafts;
        `fill`: the share of offers the drafter fills (AcceptanceEstimate.fill).

        A draft model that sat out earlier rounds must first absorb the `catch_up` tokens per
        sequence it has not seen (the prompt, or tokens decoded while speculation paid nothing);
        starting pays only if the faster steps win that time back over the `remaining` tokens.
        """
        plain_rate = self.plain_rate(batch_size)
        best_len, gain = self.speedup(batch_size, acceptance, fill)
        if gain <= self.min_gain:
            return 0
        best_rate = gain * plain_rate
        if self.draft_costs is not None and catch_up > 1:
            # Steady state already charges a one-token feed per draft step; the extra is the rest.
            extra = self.draft_costs(batch_size, round(catch_up) - 1) - self.draft_costs(batch_size, 0)
            if remaining / best_rate + extra >= remaining / plain_rate:
                return 0
        return best_len

    def plain_round_s(self, batch_size: int) -> float:
        """DraftLength: the table's plain step, times what real plain rounds measured beyond it."""
        return self.step_time(batch_size, 0) * self.slowdown.ratio(speculative=False)

    def plain_rate(self, batch_size: int) -> float:
        """Tokens/s per sequence of plain decoding at this batch size, as real plain rounds run."""
        return 1.0 / self.plain_round_s(batch_size)

    def speedup(self, batch_size: int, acceptance: Expected | float, fill: float = 1.0) -> tuple[int, float]:
        """(the fastest draft length, its predicted speedup over plain decoding at this batch size): the
        cost table, the drafter's fill and the slowdown real rounds measured. The one estimate: the
        policy chooses by it, and the target's heartbeat tells it to routers, which plan by it."""
        best_len, best_rate = self.fastest(batch_size, acceptance, fill)
        return best_len, best_rate / self.slowdown.ratio(speculative=True) / self.plain_rate(batch_size)

    def lengths(self, batch: Sequence[Running], acceptance: AcceptanceEstimate) -> list[int]:
        """DraftLength: one length for the whole batch, chosen from its mean catch-up and remaining tokens."""
        n = len(batch)
        if not n:
            return []
        catch_up = sum(r.unseen for r in batch) / n
        remaining = sum(r.remaining for r in batch) / n
        length = self.choose(n, acceptance.expected_tokens, catch_up, remaining, acceptance.fill)
        self.slowdown.expect(length > 0, self.step_time(n, length, acceptance.fill))
        return [length] * n

    def observe(self, seconds: float) -> None:
        self.slowdown.observe(seconds)

    def fastest(self, batch_size: int, acceptance: Expected | float, fill: float = 1.0) -> tuple[int, float]:
        """(draft length s >= 1, its expected tokens/s per sequence): the fastest speculative step."""
        expected = as_expected(acceptance)
        return max(((s, expected(s) / self.step_time(batch_size, s, fill)) for s in range(1, self.max_draft + 1)),
                   key=lambda pair: pair[1])
