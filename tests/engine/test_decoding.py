"""The speculative loop end to end on tiny models: greedy equals AR; sampling is lossless.

The statistical tests run N sequences through `specpool.engine.decoding.generate` in one batch, K = 2 drafts
in the first round, and compare the joint distribution of generated tokens 2-4 with the exact one
enumerated from the target: token 2 is slot 1 (accepted or its residual), token 3 slot 2 or the
residual after slot 1, token 4 the bonus after K = 2 (or a later round). Each test checks that the
first round drafted both slots and how often slot 2 and the bonus were reached.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from gguf import GGMLQuantizationType

from specpool.engine import decoding
from specpool.engine.decoding import Decoder, generate
from specpool.engine.drafters.base import Drafts
from specpool.engine.drafters.head import HeadDrafter
from specpool.engine.drafters.model import ModelDrafter
from specpool.engine.policy.draft_length import FixedDraftLength
from specpool.engine.runtime.config import tiny_config
from specpool.engine.runtime.gguf_loader import save_gguf
from specpool.engine.runtime.model import Llama, random_weights
from specpool.engine.verification.sampling import SamplingParams, logits_to_probs, make_generator
from tests.stats import cells, check_tv, exact_joint, report
from tests.twins import biased

V = 8
N = 100_000
K = 2
NEW = 4  # the first round drafts K: max_new_tokens - 1 (prefill) - 1 (the bonus's place)
PROMPT = [3, 1, 4, 1, 5]
TARGET = Llama.random_init(tiny_config(vocab_size=V, d_model=16), seed=11)
DRAFT = Llama.random_init(tiny_config(vocab_size=V, d_model=16, n_layers=1), seed=12)
HEAD = Llama.random_init(dataclasses.replace(tiny_config(vocab_size=V, d_model=16, n_layers=1), feature_fed=True),
                         seed=13)


class GreedyDrafter(ModelDrafter):
    """Deterministic drafts, the model's argmax chain, sent without q: the point-mass path."""

    def propose(self, seq_ids, num_tokens, params, generator):
        return Drafts(tokens=super().propose(seq_ids, num_tokens, SamplingParams(), generator).tokens)


def run(params: SamplingParams, drafter) -> list:
    return generate(TARGET, [PROMPT] * N, params, max_new_tokens=NEW, drafter=drafter, num_draft_tokens=K,
                    stop_ids=[], generator=make_generator(params.seed))


def check(name: str, params: SamplingParams, drafter):
    """-> (TV check of tokens 2-4, shares of rows whose first round drafted K / reached slot 2 / the bonus)."""
    return scored(name, params, run(params, drafter))


def scored(name: str, params: SamplingParams, results: list, target: Llama = TARGET):
    first = [r.rounds[0] for r in results]
    shares = {
        "drafted K": sum(d == K for d, _ in first) / len(results),
        "slot 2": sum(a >= 1 for _, a in first) / len(results),
        "bonus": sum(a == K for _, a in first) / len(results),
    }
    exact = exact_joint(target, PROMPT, params, 1, 3)
    assert exact.max() < 0.5, "a near-one-hot target would hide a bias"
    return check_tv(name, cells([r.token_ids for r in results], 1, 3, V), exact), shares


def test_target_and_draft_disagree_enough_to_matter():
    params = SamplingParams(temperature=3.0)  # random weights give peaked logits; flatten them
    cache_t, cache_d = TARGET.new_cache(1, 16), DRAFT.new_cache(1, 16)
    p = logits_to_probs(TARGET.forward(cache_t, [cache_t.allocate()], [PROMPT]), params)[0]
    q = logits_to_probs(DRAFT.forward(cache_d, [cache_d.allocate()], [PROMPT]), params)[0]
    assert 0.15 < 0.5 * (p - q).abs().sum() < 0.9
    assert p.max() < 0.8  # not near-greedy, so sampling bias would show


def test_greedy_speculation_equals_ar(tiny_model):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (n,), generator=gen).tolist() for n in (4, 9, 2, 13)]
    draft = Llama.random_init(tiny_config(vocab_size=64, n_layers=1), seed=7)
    params = SamplingParams()
    ar = generate(tiny_model, prompts, params, max_new_tokens=24, stop_ids=[])
    for k in (1, 4):
        spec = generate(tiny_model, prompts, params, 24, ModelDrafter(draft, 4, 64), num_draft_tokens=k, stop_ids=[])
        assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
        assert all(r.target_steps < len(r.token_ids) - 1 for r in spec) or k == 1
    # The target's own model as drafter accepts everything: K+1 tokens per step.
    self_spec = generate(tiny_model, prompts, params, 24, ModelDrafter(tiny_model, 4, 64), 4, stop_ids=[])
    assert [r.token_ids for r in self_spec] == [r.token_ids for r in ar]
    assert all(r.mean_accept_len > 4 for r in self_spec)


@dataclasses.dataclass(frozen=True)
class PacedLength(FixedDraftLength):
    """A fixed draft length that knows what a plain round takes."""

    plain_s: float = 1.0

    def plain_round_s(self, batch_size: int) -> float:
        return self.plain_s


@pytest.mark.parametrize("plain_s", [1e-9, 3600.0], ids=["plain is faster", "plain is slower"])
def test_a_plan_measured_slower_than_plain_decoding_falls_to_none_within_a_few_rounds(tiny_model, plain_s):
    """Drafts of a random draft model are rarely accepted: against plain rounds said to take 1 ns every
    sequence's plan falls to none after its first round and PACED_ROUNDS more, and it drafts no more;
    against plain rounds of an hour none falls. Output equals AR either way."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (n,), generator=gen).tolist() for n in (4, 9, 2, 13)]
    ar = generate(tiny_model, prompts, SamplingParams(), max_new_tokens=40, stop_ids=[])
    draft = Llama.random_init(tiny_config(vocab_size=64, n_layers=1), seed=7)
    decoder = Decoder(tiny_model, 4, 64, ModelDrafter(draft, 4, 64), PacedLength(3, plain_s=plain_s))
    results = [decoder.add(str(i), p, SamplingParams(), 40, stop_ids=[]) for i, p in enumerate(prompts)]
    while decoder.has_work:
        decoder.step()
    assert [r.token_ids for r in results] == [r.token_ids for r in ar]
    judged = decoding.PACED_ROUNDS + 1
    for r in results:
        assert all(drafted == 3 for drafted, _ in r.rounds[:judged])
        if plain_s < 1:
            assert r.plan_drops == 1 and all(drafted == 0 for drafted, _ in r.rounds[judged:]), r.rounds
        else:
            assert r.plan_drops == 0 and all(drafted > 0 for drafted, _ in r.rounds[:-1]), r.rounds


@dataclasses.dataclass(frozen=True)
class RecordingLength(FixedDraftLength):
    """A fixed draft length that records the estimate each round's lengths were asked with."""

    seen: list = dataclasses.field(default_factory=list)

    def lengths(self, batch, acceptance):
        self.seen.append(acceptance)
        return super().lengths(batch, acceptance)


def test_each_planned_method_measures_an_acceptance_of_its_own(tiny_model):
    """A draft model's acceptance is not an n-gram index's: pooled, the cheaper method always predicted faster.
    Rounds are asked with the estimate of their plans' first method in METHODS' order (the draft model's in
    a batch mixing it with n-gram), and each sequence's outcome goes to its own plan's estimate."""
    from specpool.engine.method import Method
    from specpool.engine.plan import SpeculationPlan

    length = RecordingLength(3)
    decoder = Decoder(tiny_model, 2, 64, ModelDrafter(tiny_model, 2, 64), length)  # drafts all accepted
    prior = decoder.acceptance_of(Method.NGRAM).expected_tokens(3)
    results = [decoder.add(method, [5, 6, 7, 8], SamplingParams(), 12, stop_ids=[],
                           plan=SpeculationPlan(Method(method), remote=False))
               for method in ("draft_model", "none")]
    while decoder.has_work:
        decoder.step()
    assert results[0].accepted_tokens == results[0].drafted_tokens > 0 and results[1].drafted_tokens == 0
    drafted = decoder.acceptance_of(Method.DRAFT_MODEL)
    assert length.seen[0] is drafted  # later rounds of the planned-none sequence alone: the unplanned one
    assert drafted.expected_tokens(3) > prior + 1.0
    assert decoder.acceptance_of(Method.NGRAM).expected_tokens(3) == prior, "untouched by the draft model's rounds"
    assert decoder.acceptance.expected_tokens(3) == prior and decoder.acceptance_of(None) is decoder.acceptance
    decoder.add("n", [5, 6, 7, 8], SamplingParams(), 4, stop_ids=[], plan=SpeculationPlan(Method.NGRAM, False))
    decoder.step()  # prefill
    decoder.step()
    assert length.seen[-1] is decoder.acceptance_of(Method.NGRAM)
    assert decoder.acceptance_of(Method.NGRAM).expected_tokens(3) > prior


def test_a_re_emitted_rejected_draft_is_fed_again(tiny_model):
    """A residual that falls back to p can emit the very draft it rejected: the drafter must still
    have that token to feed, though its cache already holds it as a draft."""
    drafter = ModelDrafter(tiny_model, 1, 32)
    drafter.start("s", [5, 6, 7])
    [drafts] = drafter.propose(["s"], [3], SamplingParams(), None).tokens
    drafter.observe("s", drafts[:1])  # slot 1 "rejected", then its own token re-emitted
    [again] = drafter.propose(["s"], [2], SamplingParams(), None).tokens
    assert again == drafts[1:3]


def test_stops_at_stop_token_and_length(tiny_model):
    params = SamplingParams()
    [free] = generate(tiny_model, [[5, 6, 7]], params, max_new_tokens=12, stop_ids=[])
    stop_tok = free.token_ids[4]
    first = free.token_ids.index(stop_tok)
    [stopped] = generate(tiny_model, [[5, 6, 7]], params, 12, ModelDrafter(tiny_model, 1, 64), 3, [stop_tok])
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and free.finish_reason == "length"
    assert len(free.token_ids) == 12


class BrokenDrafter(ModelDrafter):
    """A drafter gone wrong: token ids past the vocabulary, or (sampled) a q of NaN."""

    def __init__(self, model, fault: str):
        super().__init__(model, 4, 64)
        self.fault = fault

    def propose(self, seq_ids, num_tokens, params, generator):
        drafts = super().propose(seq_ids, num_tokens, params, generator)
        if self.fault == "out-of-vocab":
            return Drafts(tokens=[[self.model.config.vocab_size] * len(row) for row in drafts.tokens])
        probs = None if drafts.probs is None else torch.full_like(drafts.probs, float("nan"))
        return Drafts(tokens=drafts.tokens, probs=probs)


@pytest.mark.parametrize("fault", ["out-of-vocab", "nan-q"])
def test_a_broken_drafter_ends_at_most_its_own_group(tiny_model, fault):
    """Out-of-vocabulary drafts are dropped before the target's forward (which would fail the batch);
    a NaN q makes the sampled group's verification raise, which ends that group's sequence with an
    error. Either way the greedy group decoded in the same batch gets exactly AR's tokens."""
    prompts = [[5, 6, 7], [9, 10, 11, 12], [13, 14]]
    ar = generate(tiny_model, prompts, SamplingParams(), max_new_tokens=16, stop_ids=[])
    decoder = Decoder(tiny_model, 4, 64, BrokenDrafter(tiny_model, fault), FixedDraftLength(2))
    greedy = [decoder.add(f"g{i}", p, SamplingParams(), 16, stop_ids=[]) for i, p in enumerate(prompts)]
    sampled = decoder.add("s", prompts[0], SamplingParams(temperature=1.0, seed=0), 16, stop_ids=[])
    while decoder.has_work:
        decoder.step()
    assert [r.token_ids for r in greedy] == [r.token_ids for r in ar]
    if fault == "out-of-vocab":
        assert all(r.drafted_tokens == 0 for r in greedy + [sampled])
        assert sampled.finish_reason == "length"
    else:
        assert all(r.drafted_tokens > 0 for r in greedy)
        assert sampled.finish_reason == "error" and "RuntimeError" in sampled.error, sampled.error
    assert decoder.cache.free_slots == 4  # every slot came back, the failed sequence's too


def test_a_seeded_request_draws_the_same_tokens_again_once_its_group_has_left(tiny_model):
    """A sampling group's random stream lives as long as a sequence with those parameters runs: the same
    seeded request sent again to a warm decoder repeats its tokens (it continued the old stream, and
    every distinct seed ever seen kept a generator)."""
    decoder = Decoder(tiny_model, 4, 64)
    params = SamplingParams(temperature=1.0, seed=7)
    runs = []
    for _ in range(2):
        result = decoder.add("s", [5, 6, 7], params, 16, stop_ids=[])
        while decoder.has_work:
            decoder.step()
        runs.append(result.token_ids)
    assert runs[0] == runs[1]
    assert not decoder._generators, "a generator outlived its group"


class SlowRemoteDrafter(ModelDrafter):
    """Drafts like ModelDrafter, for sequences named "remote-*" as a remote endpoint would: asked in
    start_groups, ready only after `delay` checks."""

    def __init__(self, model, delay: int):
        super().__init__(model, 8, 128)
        self.delay = delay
        self.checks = 0

    def start_groups(self, requests):
        drafts = [self.propose(r.seq_ids, r.num_tokens, r.params, r.generator) for r in requests]
        waiting = {s for r in requests for s in r.seq_ids if s.startswith("remote")}
        return SimpleNamespace(drafts=drafts, waiting=waiting, ready=self._ready)

    def _ready(self) -> bool:
        self.checks += 1
        return self.checks % (self.delay + 1) == 0

    def finish_groups(self, pending):
        return pending.drafts


def test_sequences_that_wait_for_no_remote_drafts_step_while_a_round_is_out(tiny_model):
    """While a remote round is out, a plain sequence takes steps of its own instead of waiting for the
    others' drafts, and every output still equals AR."""
    prompts = {"remote-a": [5, 6, 7], "remote-b": [9, 10, 11, 12], "plain": [13, 14]}
    ar = dict(zip(prompts, generate(tiny_model, list(prompts.values()), SamplingParams(), 24, stop_ids=[])))
    drafter = SlowRemoteDrafter(tiny_model, delay=3)
    decoder = Decoder(tiny_model, 4, 64, drafter, FixedDraftLength(3))
    results = {name: decoder.add(name, p, SamplingParams(), 24, stop_ids=[]) for name, p in prompts.items()}
    while decoder.has_work:
        decoder.step()
    assert {name: r.token_ids for name, r in results.items()} == {name: r.token_ids for name, r in ar.items()}
    assert results["remote-a"].drafted_tokens > 0
    # Three side steps per remote round: the plain sequence took far more target steps than a remote one.
    assert results["plain"].target_steps > 2 * results["remote-a"].target_steps
    assert decoder.cache.free_slots == 4


PATHS = {  # name: (sampling, drafter, the twin that breaks this path)
    "dense q": (SamplingParams(temperature=3.0, seed=1), lambda: ModelDrafter(DRAFT, N, 16), ("misreported-q", 0.05)),
    "sparse top-k q": (SamplingParams(temperature=3.0, top_k=4, seed=2), lambda: ModelDrafter(DRAFT, N, 16),
                       ("misreported-q", 0.05)),  # 0.04 sat at the limit (0.0135): caught at 1.03x
    "point mass": (SamplingParams(temperature=2.5, top_p=0.9, seed=3), lambda: GreedyDrafter(TARGET, N, 16),
                   ("leaky-residual", 0.015)),  # 0.01 sat below the limit (0.0109): caught at 0.0118, missed at 0.0086
    "feature-fed head, dense q": (SamplingParams(temperature=3.0, seed=5), lambda: HeadDrafter(HEAD, N, 16),
                                  ("misreported-q", 0.12)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", PATHS)
def test_speculative_sampling_is_lossless(name):
    params, make_drafter, _ = PATHS[name]
    result, shares = check(name, params, make_drafter())
    report(result, **shares)
    assert shares["drafted K"] == 1.0 and shares["slot 2"] > 0.2 and shares["bonus"] > 0.05, shares
    assert result.passed, result


@pytest.mark.slow
def test_speculative_sampling_is_lossless_on_the_default_format(tmp_path):
    """The TV check on q4 as `auto` loads a 4-bit GGUF: the engine's kernels verify the drafts (fused
    verify rows), and the exact joint is enumerated through the same prefill and verify kernels."""
    config = tiny_config(vocab_size=V, d_model=32)  # the kernels' shapes: inputs by 32, outputs by 16
    path = save_gguf(tmp_path / "tiny-q4_1.gguf", config, random_weights(config, seed=11),
                     quantize_layers=GGMLQuantizationType.Q4_1)
    target, _ = Llama.from_gguf(path, device="cpu")
    assert target.format.name == "q4" and target.fused
    params = SamplingParams(temperature=3.0, seed=1)
    rows = 30_000  # under q4 each prompt prefills alone (~3 ms a row here): N would take 5 minutes
    results = generate(target, [PROMPT] * rows, params, max_new_tokens=NEW, drafter=ModelDrafter(DRAFT, rows, 16),
                       num_draft_tokens=K, stop_ids=[], generator=make_generator(params.seed))
    result, shares = scored("dense q, q4 target", params, results, target)
    report(result, **shares)
    assert shares["drafted K"] == 1.0 and shares["slot 2"] > 0.2 and shares["bonus"] > 0.05, shares
    assert result.passed, result


# The fourth class cuts q with min-p (tokens under 0.2 of the most probable's mass): the drafter's dense q
# and the target's p are both taken after the cut, as engine/verification/sampling.py composes the four.
MIXED = [PATHS["dense q"][0], PATHS["sparse top-k q"][0], SamplingParams(temperature=2.5, top_p=0.9),
         SamplingParams(temperature=3.0, min_p=0.2)]
MIXED_TWIN_ROWS = 5000  # a class: a group verified under another's parameters is far off


def mixed_batch(rows: int) -> list:
    """One batch of `rows` rows of each MIXED class, interleaved, one drafter -> (TV check, shares) a class."""
    decoder = Decoder(TARGET, rows * len(MIXED), len(PROMPT) + NEW + K + 1, ModelDrafter(DRAFT, rows * len(MIXED), 16),
                      FixedDraftLength(K), make_generator(6))
    results: list[list] = [[] for _ in MIXED]
    for i in range(rows):
        for c, params in enumerate(MIXED):
            results[c].append(decoder.add(f"{c}-{i}", PROMPT, params, NEW, []))
    while decoder.has_work:
        decoder.step()
    return [scored(f"mixed batch, {params}", params, r) for params, r in zip(MIXED, results)]


@pytest.mark.slow
def test_a_batch_mixing_sampling_parameters_is_lossless_per_row():
    """Four sampling classes in one batch with one drafter (dense q, sparse top-k q, top-p q, min-p q): the
    decoder verifies each group under its own parameters, so each class matches its exact joint."""
    for result, shares in mixed_batch(N // len(MIXED)):
        report(result, **shares)
        assert shares["drafted K"] == 1.0 and shares["slot 2"] > 0.2 and shares["bonus"] > 0.05, shares
        assert result.passed, result


@pytest.mark.slow
def test_the_harness_catches_a_batch_verified_under_one_rows_parameters():
    real = decoding.verify_round

    def under_the_first_class(drafts, target_logits, params, generator):
        return real(drafts, target_logits, MIXED[0], generator)

    with mock.patch.object(decoding, "verify_round", under_the_first_class):
        checks = mixed_batch(MIXED_TWIN_ROWS)
    for twin, shares in checks[1:]:
        report(twin, twin=True, at_n=N // len(MIXED), **shares)
        assert not twin.passed, f"biased twin slipped through: {twin}"


@pytest.mark.slow
def test_no_drafter_is_plain_sampling():
    result, shares = check("no drafter", SamplingParams(temperature=3.0, seed=4), None)
    report(result, **shares)
    assert shares["drafted K"] == 0.0
    assert result.passed, result


@pytest.mark.slow
@pytest.mark.full_power
@pytest.mark.parametrize("name", PATHS)
def test_the_harness_catches_a_twin_near_its_limit(name):
    params, make_drafter, (kind, strength) = PATHS[name]
    with biased(kind, strength):
        twin, shares = check(f"{name}, {kind} {strength}", params, make_drafter())
    report(twin, twin=True, **shares)
    assert not twin.passed, f"biased twin slipped through: {twin}"


def test_a_run_of_rejections_does_not_drop_a_plan_that_has_paid():
    """PlanPace judges a plan on its last PACED_ROUNDS rounds and on all its rounds so far. The Qwen pair paid 1.45x
    on average, yet 4 rounds of rejections in a row dropped it within most of `make run`'s answers; a plan slower
    from its start still drops as soon as it is judged, and one that stays slow after paying drops in time."""
    plain_s = 0.040  # a plain round: one token in 40 ms
    good, bad = (4, 0.095), (1, 0.095)  # a drafted round: 4 tokens (~1.7x), or 1 (~0.4x)

    def rounds_until_dropped(rounds) -> int | None:
        pace = decoding.PlanPace()
        return next((i for i, (tokens, s) in enumerate(rounds) if pace.slower(tokens, s, plain_s)), None)

    assert rounds_until_dropped([good] * 20 + [bad] * decoding.PACED_ROUNDS + [good] * 20) is None
    assert rounds_until_dropped([bad] * 20) == decoding.PACED_ROUNDS  # the first round, then PACED_ROUNDS more
    assert rounds_until_dropped([good] * 10 + [bad] * 40) is not None  # an endpoint turned slow for good
