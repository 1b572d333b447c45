"""Choosing s each round: the policy that maximises b * E(s) / (T(b, s) + D(b, s)) (see the package's
docstring), a fixed length, and the hybrid drafter's, which charges drafting only for its model's rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from specpool.engine.method import MIN_GAIN, Method
from specpool.engine.plan import SpeculationPlan, TreeShape
from specpool.engine.policy.acceptance import AcceptanceEstimate, Expected, as_expected
from specpool.engine.policy.costs import StepCosts


class _Ratios:
    """Decayed sums of measured / predicted seconds, per kind of round (plain 0, speculative 1)."""

    def __init__(self, decay: float):
        self.decay = decay
        self.sums = [0.0, 0.0]
        self.weights = [0.0, 0.0]

    def add(self, kind: int, ratio: float, chosen: bool) -> None:
        for k in (0, 1) if chosen else (kind,):  # a plain round the policy had no say in tells nothing of speculation
            self.sums[k] *= self.decay
            self.weights[k] *= self.decay
        self.sums[kind] += ratio
        self.weights[kind] += 1.0

    def leaned(self, kind: int, prior: float, prior_weight: float) -> float:
        return (self.sums[kind] + prior_weight * prior) / (self.weights[kind] + prior_weight)


def batch_bucket(batch_size: int) -> int:
    """1, 2, 3-4, 5-8, ...: batch sizes whose rounds are learned together."""
    return max(0, batch_size - 1).bit_length()


class RoundSlowdown:
    """How much longer real rounds take than the cost table predicts, learned from the rounds run.

    The table times a bare forward; a real round also asks the drafter, samples, verifies, keeps the
    cache and updates every sequence, and each step of a draft model carries the same overheads. Near
    break-even that error decides: priced by the table alone, a draft model ran 0.94x AR at batch 1
    (q4, AMD EPYC). Learned as ratios (measured / predicted), so that they carry across draft lengths,
    apart for plain and for speculative rounds. The speculative ratio leans back on the plain one while
    the policy declines to speculate, so that it tries again eventually, as AcceptanceEstimate leans back
    on its prior; but not over rounds of requests planned to plain decoding, which the policy had no say
    in: a target's AR requests (128 rounds each in `make run`) wiped what its n-gram rounds had measured
    (1.24x their table, 1.11x AR on the Qwen pair), so its heartbeat priced n-gram at 1.4-1.6x again and
    routers planned it over the draft model (issue 51).

    Learned per batch-size bucket too (batch_bucket), each leaning on the ratios of all batches while it
    has few rounds: through the servers, the Qwen pair's plain rounds at batch 4 ran further over their
    table than batch 1's, and learned into one ratio they priced plain decoding at batch 1 slower than it
    runs: the heartbeat predicted the draft model 1.28x and n-gram 1.37x at batch 1, and routers planned
    them into batches where they ran 0.58-0.8x routed AR.
    """

    def __init__(self, decay: float = 0.98, prior_weight: float = 1.0, bucket_weight: float = 2.0):
        self.decay = decay
        self.prior_weight = prior_weight
        self.bucket_weight = bucket_weight  # rounds of its own before a bucket's ratio is mostly its own
        self._all = _Ratios(decay)
        self._buckets: dict[int, _Ratios] = {}
        # (kind, predicted seconds, whether the policy chose the kind, bucket) of the round asked for last
        self._expected: tuple[int, float, bool, int | None] | None = None

    def ratio(self, speculative: bool, batch_size: int | None = None) -> float:
        """Measured / predicted seconds of a round of this kind (plain: 1 before any is measured;
        speculative: the plain ratio before any is measured), at this batch size (None: all batches)."""
        plain = self._all.leaned(0, 1.0, self.prior_weight)
        spec = self._all.leaned(1, plain, self.prior_weight)
        bucket = self._buckets.get(batch_bucket(batch_size)) if batch_size is not None else None
        if bucket is None:
            return spec if speculative else plain
        bucket_plain = bucket.leaned(0, plain, self.bucket_weight)
        if not speculative:
            return bucket_plain
        # Speculative rounds' overhead over plain ones carries to a bucket that has run few speculative rounds:
        # as measured in the bucket that has run the most.
        most = max(self._buckets.values(), key=lambda b: b.weights[1])
        overhead = (most.leaned(1, spec, self.bucket_weight) / most.leaned(0, plain, self.bucket_weight)
                    if most.weights[1] else spec / plain)
        return bucket.leaned(1, bucket_plain * overhead, self.bucket_weight)

    def forget(self) -> None:
        """The round asked for now teaches nothing (a draft catching up: not a steady round)."""
        self._expected = None

    def expect(self, speculative: bool, seconds: float, chosen: bool = True, batch_size: int | None = None) -> None:
        """The policy's prediction for the round it has just been asked for; `chosen` False: a plain round
        it had no choice over (every sequence planned to plain decoding)."""
        bucket = batch_bucket(batch_size) if batch_size is not None else None
        self._expected = (int(speculative), seconds, chosen, bucket)

    def observe(self, seconds: float) -> None:
        """The decoder's measurement of that round, drafting included (ignored when nothing was expected)."""
        if self._expected is None or self._expected[1] <= 0:
            return
        kind, predicted, chosen, bucket = self._expected
        self._expected = None
        self._all.add(kind, seconds / predicted, chosen)
        if bucket is not None:
            self._buckets.setdefault(bucket, _Ratios(self.decay)).add(kind, seconds / predicted, chosen)


class Probe:
    """Rounds that draft although the estimate says plain decoding: an estimate that never drafts never
    learns. The acceptance prior (0.5) priced the Qwen2.5-Coder 0.5B drafting for its 1.5B at 1.07x, under
    MIN_GAIN, so the policy never drafted, though that pair measured 1.48x at a fixed length of 4. `first`:
    the policy's first plain round probes too (a target's draft-model policy: target_service/draft_length.py)."""

    def __init__(self, every: int = 16, first: bool = False):
        self.every = every  # a probe after this many plain rounds in a row
        self._plain = every - 1 if first else 0

    def due(self, plain: bool) -> bool:
        """Whether the round the estimate chose (`plain` or not) probes instead."""
        self._plain = self._plain + 1 if plain else 0
        if self._plain < self.every:
            return False
        self._plain = 0
        return True


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
    probe: Probe = field(default_factory=Probe, compare=False)

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
        extra = self.catch_up_s(batch_size, catch_up)
        if extra > 0 and remaining / best_rate + extra >= remaining / plain_rate:
            return 0
        return best_len

    def catch_up_s(self, batch_size: int, catch_up: float) -> float:
        """The seconds a draft model's first step takes beyond a steady one, feeding `catch_up` tokens a
        sequence (steady state already charges a one-token feed per draft step)."""
        if self.draft_costs is None or catch_up <= 1:
            return 0.0
        return self.draft_costs(batch_size, round(catch_up) - 1) - self.draft_costs(batch_size, 0)

    def plain_round_s(self, batch_size: int) -> float:
        """DraftLength: the table's plain step, times what real plain rounds measured beyond it."""
        return self.step_time(batch_size, 0) * self.slowdown.ratio(False, batch_size)

    def plain_rate(self, batch_size: int) -> float:
        """Tokens/s per sequence of plain decoding at this batch size, as real plain rounds run."""
        return 1.0 / self.plain_round_s(batch_size)

    def speedup(self, batch_size: int, acceptance: Expected | float, fill: float = 1.0) -> tuple[int, float]:
        """(the fastest draft length, its predicted speedup over plain decoding at this batch size): the
        cost table, the drafter's fill and the slowdown real rounds measured. The one estimate: the
        policy chooses by it, and the target's heartbeat tells it to routers, which plan by it."""
        best_len, best_rate = self.fastest(batch_size, acceptance, fill)
        return best_len, best_rate / self.slowdown.ratio(True, batch_size) / self.plain_rate(batch_size)

    def lengths(self, batch: Sequence[Running], acceptance: AcceptanceEstimate) -> list[int]:
        """DraftLength: one length for the whole batch, chosen from its mean catch-up and remaining tokens."""
        n = len(batch)
        if not n:
            return []
        # Sequences whose plan fell to none (the decoder's pacing) are offered nothing, whatever the length.
        if all(r.plan is not None and r.plan.method is Method.NONE for r in batch):
            self.slowdown.expect(False, self.step_time(n, 0), chosen=False, batch_size=n)
            return [0] * n
        catch_up = sum(r.unseen for r in batch) / n
        remaining = sum(r.remaining for r in batch) / n
        length = self.choose(n, acceptance.expected_tokens, catch_up, remaining, acceptance.fill)
        if self.draft_costs is not None and self.probe.due(plain=length == 0) and self.could_pay(n):
            length = self.fastest(n, acceptance.expected_tokens, acceptance.fill)[0]  # a model drafter's prior
        # A round that starts drafting also feeds the draft what it has not seen: not a steady round, so it is
        # not learned from. Its catch-up's price, extrapolated from the table, was up to 5x what such rounds
        # took (the Qwen pair at batch 4), and learned as a speedup it priced drafting at 1.9x where it ran 0.75x.
        if length and self.catch_up_s(n, catch_up):
            self.slowdown.forget()
        else:
            self.slowdown.expect(length > 0, self.step_time(n, length, acceptance.fill), batch_size=n)
        return [length] * n

    def could_pay(self, batch_size: int) -> bool:
        """Whether drafting could pay at this batch size were every draft accepted: only then is a probe worth
        its catch-up. At batch 16 the Qwen pair's probes (every 16th round, each sequence catching up on its
        16+ tokens) ran its draft-model plan at 0.72x AR, though it drafted 0.04 tokens a step: verifying
        one more token a sequence there costs 1.86x a plain step."""
        return self.speedup(batch_size, lambda s: s + 1.0)[1] > self.min_gain

    def observe(self, seconds: float) -> None:
        self.slowdown.observe(seconds)

    def fastest(self, batch_size: int, acceptance: Expected | float, fill: float = 1.0) -> tuple[int, float]:
        """(draft length s >= 1, its expected tokens/s per sequence): the fastest speculative step."""
        expected = as_expected(acceptance)
        return max(((s, expected(s) / self.step_time(batch_size, s, fill)) for s in range(1, self.max_draft + 1)),
                   key=lambda pair: pair[1])


@dataclass
class ModelShare:
    """The share of drafted rows whose tree the model grew: a moving average, `value` (a prior) at first."""

    value: float = 0.5

    def add(self, model_rows: int, rows: int) -> None:
        self.value += 0.1 * (model_rows / rows - self.value)


@dataclass
class HybridDraftLength:
    """The draft-length policy of a hybrid drafter: the model's drafting is charged only for the
    share of rows the model drafts (the store's trees cost no forward)."""

    policy: SpeculationPolicy
    share: ModelShare

    @property
    def max_draft(self) -> int:
        return self.policy.max_draft

    def lengths(self, batch: Sequence[Running], acceptance: AcceptanceEstimate) -> list[int]:
        charged = replace(self.policy, drafting_share=self.share.value)
        return charged.lengths(batch, acceptance)

    def observe(self, seconds: float) -> None:
        self.policy.observe(seconds)

    def plain_round_s(self, batch_size: int) -> float:
        return self.policy.plain_round_s(batch_size)
