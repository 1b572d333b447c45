"""Token-tree speculation end to end on tiny models: greedy equals AR, and sampling is lossless.

The statistical tests decode N sequences with a tree budget of 4 nodes in the first round and compare
the joint distribution of generated tokens 1-3 with the exact one enumerated from the target. They
check that the first round's trees really branched, that a second sibling was accepted (the path only
trees have), and that paths two deep were accepted.
"""

from __future__ import annotations

import pytest
import torch

from specpool.engine.decoding import generate
from specpool.engine.drafters.base import Drafter
from specpool.engine.drafters.head import HeadDrafter
from specpool.engine.drafters.hybrid import HybridTreeDrafter
from specpool.engine.drafters.model import ModelDrafter
from specpool.engine.drafters.suffix_store import SuffixStore
from specpool.engine.plan import TreeShape
from specpool.engine.policy.acceptance import AcceptanceEstimate
from specpool.engine.policy.costs import StepCosts
from specpool.engine.policy.draft_length import HybridDraftLength, ModelShare, Running, SpeculationPolicy
from specpool.engine.runtime.config import tiny_config
from specpool.engine.runtime.model import Llama
from specpool.engine.verification import token_tree
from specpool.engine.verification.sampling import SamplingParams, make_generator
from tests.engine.drafters.test_head import tiny_head, trained_tiny_head
from tests.engine.test_decoding import DRAFT, PROMPT, TARGET, V
from tests.stats import cells, check_tv, exact_joint, report
from tests.twins import biased

N = 50_000  # fewer rows than the chain tests: growing trees is per-row Python
SHAPE = TreeShape(branch=2, beam=2, max_depth=3)
BUDGET = 4
NEW = 6  # the first round's budget is 4: max_new_tokens - 1 (prefill) - 1 (the bonus's place)


class Recording(Drafter):
    """Wraps a drafter and keeps every tree it proposed, in order (the first round's come first)."""

    def __init__(self, drafter):
        self.drafter, self.trees, self.caps = drafter, [], drafter.caps
        self.first_round_sources: tuple[int, int] | None = None  # a hybrid's (store rows, model rows)

    def start(self, seq_id, context, **inputs):
        self.drafter.start(seq_id, context, **inputs)

    def observe(self, seq_id, tokens, **inputs):
        self.drafter.observe(seq_id, tokens, **inputs)

    def release(self, seq_id):
        self.drafter.release(seq_id)

    def propose(self, seq_ids, num_tokens, params, generator):
        drafts = self.drafter.propose(seq_ids, num_tokens, params, generator)
        self.trees += [(t, p) for t, p in zip(drafts.tokens, drafts.parents) if t]
        if self.first_round_sources is None and isinstance(self.drafter, HybridTreeDrafter):
            self.first_round_sources = (self.drafter.store_rounds, self.drafter.model_rounds)
        return drafts


@pytest.mark.parametrize("kind", ["draft model", "head"])
def test_greedy_tree_speculation_equals_ar(tiny_model, kind):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (n,), generator=gen).tolist() for n in (4, 9, 2, 13)]
    ar = generate(tiny_model, prompts, SamplingParams(), max_new_tokens=24, stop_ids=[])
    shape = TreeShape(branch=3, beam=2, max_depth=4)
    for budget in (3, 8):
        if kind == "head":
            drafter = Recording(HeadDrafter(tiny_head(), 4, 64, tree=shape))
        else:
            draft = Llama.random_init(tiny_config(vocab_size=64, n_layers=1), seed=7)
            drafter = Recording(ModelDrafter(draft, 4, 64, tree=shape))
        spec = generate(tiny_model, prompts, SamplingParams(), 24, drafter, budget, stop_ids=[])
        assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
        assert any(not token_tree.is_chain(p) for _, p in drafter.trees), "no tree branched"
        assert max(len(t) for t, _ in drafter.trees) == budget


def test_hybrid_trees_come_from_the_suffix_store_where_it_is_sure_and_equal_ar(tiny_model):
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 64, (n,), generator=gen).tolist() for n in (4, 9, 2, 13)]
    ar = generate(tiny_model, prompts, SamplingParams(), max_new_tokens=40, stop_ids=[])
    draft = Llama.random_init(tiny_config(vocab_size=64, n_layers=1), seed=7)
    store = SuffixStore(max_tokens=10_000)
    drafter = HybridTreeDrafter(ModelDrafter(draft, 4, 128, tree=TreeShape(branch=3, beam=2, max_depth=4)), store)
    spec = generate(tiny_model, prompts, SamplingParams(), 40, drafter, 6, stop_ids=[])
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
    # A random tiny model falls into loops: the store drafts those, the draft model the rest.
    assert drafter.store_rounds > 0 and drafter.model_rounds > 0
    assert all(store.count((p + r.token_ids)[:12]) == 1 for p, r in zip(prompts, spec))  # the documents stay


def test_the_hybrids_policy_charges_the_model_only_for_the_rows_it_drafts():
    target = StepCosts((1,), (0, 4, 8), ((0.03, 0.033, 0.036),))
    head = StepCosts((1,), (0, 8), ((0.01, 0.012),))
    policy = SpeculationPolicy(target, draft_costs=head, max_draft=8, tree=TreeShape(4, 4, 6))
    share = ModelShare()
    batch, acceptance = [Running("a", 0, 100)], AcceptanceEstimate(prior_alpha=0.6, prior_weight=1e9)
    share.value = 0.0  # the store drafts every row: as free as n-gram drafting
    assert HybridDraftLength(policy, share).lengths(batch, acceptance) == SpeculationPolicy(target).lengths(
        batch, acceptance)
    share.value = 1.0
    assert HybridDraftLength(policy, share).lengths(batch, acceptance) == policy.lengths(batch, acceptance)
    store = SuffixStore(max_tokens=100)
    drafter = HybridTreeDrafter(ModelDrafter(Llama.random_init(tiny_config(vocab_size=64, n_layers=1), seed=7), 1, 64,
                                             tree=TreeShape(2, 2, 3)), store, share=share)
    store.extend("earlier", [1, 2, 3, 4, 1, 2, 3, 4])
    drafter.start("s", [9, 1, 2])
    drafter.propose(["s"], [3], SamplingParams(), None)  # the store is sure of "3 4 1": the model sits out
    assert drafter.store_rounds == 1 and share.value == 0.9


def test_the_hybrids_policy_runs_the_decoder_and_equals_ar(tiny_model):
    """Through the decoder, as the bench's head-suffix mode runs it: the hybrid's length is a whole
    DraftLength (each round it is also asked what a plain round takes, to pace the plan)."""
    prompts = [[5, 9, 14, 3], [7, 7, 2]]
    ar = generate(tiny_model, prompts, SamplingParams(), max_new_tokens=20, stop_ids=[])
    target = StepCosts((1, 2), (0, 4, 8), ((0.03, 0.031, 0.032), (0.03, 0.031, 0.032)))
    share = ModelShare()
    policy = HybridDraftLength(SpeculationPolicy(target, max_draft=8, min_gain=1.0), share)
    drafter = HybridTreeDrafter(ModelDrafter(tiny_model, 2, 64, tree=TreeShape(2, 2, 4)), SuffixStore(100), share=share)
    spec = generate(tiny_model, prompts, SamplingParams(), 20, drafter, policy=policy, stop_ids=[])
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
    assert all(r.drafted_tokens > 0 for r in spec)


def test_the_target_drafting_for_itself_accepts_its_greedy_path(tiny_model):
    prompts = [[5, 9, 14, 3], [7, 7, 2]]
    ar = generate(tiny_model, prompts, SamplingParams(), max_new_tokens=20, stop_ids=[])
    drafter = ModelDrafter(tiny_model, 2, 64, tree=TreeShape(branch=2, beam=2, max_depth=6))
    spec = generate(tiny_model, prompts, SamplingParams(), 20, drafter, 8, stop_ids=[])
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
    # The likeliest path is always the target's own argmax path, and the budget reaches depth 4 or more.
    assert all(r.mean_accept_len >= 4 for r in spec)


def _check(name: str, params: SamplingParams, drafter: Recording):
    results = generate(TARGET, [PROMPT] * N, params, max_new_tokens=NEW, drafter=drafter,
                       num_draft_tokens=BUDGET, stop_ids=[], generator=make_generator(params.seed))
    rounds = [r.rounds[0] for r in results]
    shares = {
        "branched": sum(not token_tree.is_chain(p) for _, p in drafter.trees[:N]) / N,
        "second sibling": _second_sibling_share(results, drafter),
        "depth 2": sum(a >= 2 for _, a in rounds) / N,
    }
    if drafter.first_round_sources is not None:  # every row's first round is one call: its trees' sources
        shares["store rows"], shares["model rows"] = (n / N for n in drafter.first_round_sources)
    exact = exact_joint(TARGET, PROMPT, params, 1, 3)
    return check_tv(name, cells([r.token_ids for r in results], 1, 3, V), exact), shares


def _second_sibling_share(results, drafter: Recording) -> float:
    """Rows whose first round accepted a root child that was not the tree's first."""
    hits = 0
    for r, (tokens, parents) in zip(results, drafter.trees[:N]):
        roots = [t for t, p in zip(tokens, parents) if p == -1]
        hits += r.rounds[0][1] >= 1 and r.token_ids[1] in roots[1:]
    return hits / N


TREE_SHARES = {"branched": 1.0, "second sibling": 0.02, "depth 2": 0.1}  # a model's trees: always branched
PATHS = {  # name: (sampling, drafter, the twin that breaks this path, the least share of each path it must reach)
    "draft-model tree": (SamplingParams(temperature=3.0, seed=6),
                         lambda: ModelDrafter(DRAFT, N, 16, tree=SHAPE), ("leaky-siblings", 0.05), TREE_SHARES),
    "head tree": (SamplingParams(temperature=2.0, top_p=0.95, seed=7),
                  lambda: HeadDrafter(trained_tiny_head(TARGET, greedy_paths=False), N, 16, tree=SHAPE),
                  ("leaky-siblings", 0.02), TREE_SHARES),
    # The merged drafter: the store's trees where it expects 2.5 accepted tokens (its copies of the prompt
    # continue most first tokens), the head's elsewhere; both through the one tree rule.
    "suffix-store + head tree": (SamplingParams(temperature=2.0, top_p=0.95, seed=7),
                                 lambda: HybridTreeDrafter(HeadDrafter(trained_tiny_head(TARGET, greedy_paths=False), N,
                                                                       16, tree=SHAPE), SuffixStore(1_000_000), threshold=2.5),
                                 ("leaky-siblings", 0.02),
                                 {"store rows": 0.5, "model rows": 0.1, "branched": 0.1, "second sibling": 0.005,
                                  "depth 2": 0.1}),
}


# These two follow test_decoding's lossless and twin tests on purpose: the same harness, over trees.
@pytest.mark.slow
@pytest.mark.parametrize("name", PATHS)
def test_tree_speculation_is_lossless(name):
    params, make_drafter, _, least = PATHS[name]
    result, shares = _check(name, params, Recording(make_drafter()))
    report(result, **shares)
    assert all(shares[path] >= share for path, share in least.items()), shares
    assert result.passed, result


@pytest.mark.slow
@pytest.mark.parametrize("name", PATHS)
def test_the_harness_catches_a_tree_twin(name):
    params, make_drafter, (kind, strength), _ = PATHS[name]
    with biased(kind, strength):
        twin, shares = _check(f"{name}, {kind} {strength}", params, Recording(make_drafter()))
    report(twin, twin=True, **shares)
    assert not twin.passed, f"biased twin slipped through: {twin}"
