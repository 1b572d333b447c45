# Over 400 lines: one exact statistical check per verification rule, sharing one Markov-chain fixture.
"""Verification must be lossless: emitted tokens are distributed exactly as plain target sampling.

Statistical tests use a small vocabulary and two *different* Markov chains over it: the target
p(x_t | x_{t-1}) and the draft q(x_t | x_{t-1}). Each check runs N independent speculative steps from
a fixed context token in one vectorised call and compares the empirical distribution of the first
emitted token and of the first two emitted tokens with the exact p(.|x0) and p(a|x0) p(b|a). The same
harness runs deliberately biased verifiers and must reject them, which shows it can see bias.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from torch import Tensor

from specpool.engine.verification import rules as ver
from specpool.engine.verification.rules import (
    VerifyResult,
    verify_candidates,
    verify_dense,
    verify_greedy,
    verify_point_mass,
    verify_sparse,
    verify_tree,
)
from specpool.engine.verification.sampling import SamplingParams, logits_to_probs, make_generator, sample
from tests.stats import TvCheck, check_tv, exact_probs, report, tv, tv_threshold
from tests.twins import temper

V = 8  # vocabulary
K = 3  # draft slots
N = 100_000  # independent trials per statistical check
X0 = 2  # context token every trial starts from
TOP_K = 3  # sparse draft support


def _chain(seed: int, scale: float) -> Tensor:
    g = make_generator(seed)
    logits = torch.randn(V, V, generator=g) * scale
    return exact_probs(logits, SamplingParams(temperature=1.0))  # [V, V], row = previous token


P = _chain(1234, 1.2)  # target p(x_t | x_{t-1}); scale keeps it peaked but far from one-hot
Q = _chain(5678, 1.2)  # draft q(x_t | x_{t-1}), a different chain


# --- harness ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Emitted:
    first: Tensor  # [N] the first emitted token
    second: Tensor  # [N] the second
    shares: dict[str, float]  # the share of rows through each part of the rule (drafted, slot 2, bonus..)


@dataclass(frozen=True)
class Check:
    first: TvCheck  # first emitted token vs p(.|x0)
    pair: TvCheck  # first two emitted tokens vs p(a|x0) p(b|a)
    shares: dict[str, float]

    @property
    def passed(self) -> bool:
        return self.first.passed and self.pair.passed


# A scenario drafts N rows, calls the verifier under test, and returns the first two emitted tokens.
Scenario = Callable[[Callable, torch.Generator], Emitted]


def check_lossless(verifier_fn: Callable, scenario: Scenario, seed: int = 0, name: str = "") -> Check:
    out = scenario(verifier_fn, make_generator(seed))
    pair = (P[X0][:, None] * P).reshape(-1)
    assert P[X0].max() < 0.5 and pair.max() < 0.5, "a near-one-hot target would hide a bias"
    return Check(
        first=check_tv(f"{name}, first token", out.first, P[X0]),
        pair=check_tv(f"{name}, first two tokens", out.first * V + out.second, pair),
        shares=out.shares,
    )


# --- scenarios -------------------------------------------------------------------------------------


def _ragged(gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """-> (num_drafts [N] uniform in 0..K, valid [N, K])."""
    num = torch.randint(0, K + 1, (N,), generator=gen)
    return num, torch.arange(K) < num[:, None]


def _target_rows(tokens: Tensor, num: Tensor) -> Tensor:
    """Target rows for context X0 + drafts: [N, K+1, V]; rows past the bonus row are NaN padding."""
    ctx = torch.cat([torch.full((N, 1), X0), tokens.clamp(min=0)], dim=1)  # [N, K+1]
    rows = P[ctx]
    return rows.masked_fill((torch.arange(K + 1) > num[:, None])[..., None], float("nan"))


def _first_two(tokens: Tensor, num: Tensor, res: VerifyResult, gen: torch.Generator) -> Emitted:
    acc, nxt = res.accepted, res.next_token
    assert bool(((acc >= 0) & (acc <= num)).all())
    first = torch.where(acc >= 1, tokens[:, 0], nxt)
    # Only one token emitted: the target simply keeps decoding from it with plain sampling.
    cont = sample(P[first], gen)
    second = torch.where(acc >= 2, tokens[:, 1], torch.where(acc == 1, nxt, cont))
    drafted = num >= 1
    return Emitted(first, second, _shares(drafted=drafted, slot_2=(num >= 2) & (acc >= 1),
                                          bonus=drafted & (acc == num)))


def _shares(**rows: Tensor) -> dict[str, float]:
    """name -> the share of rows where the [N] mask holds."""
    return {name.replace("_", " "): float(mask.float().mean()) for name, mask in rows.items()}


def _sampled_chain(gen: torch.Generator, dist: Callable[[Tensor], Tensor]) -> tuple[Tensor, Tensor]:
    """Draft K tokens, slot i sampled from dist(q(.|prev)); -> (tokens [N, K], sampling dists [N, K, V])."""
    prev, toks, dists = torch.full((N,), X0), [], []
    for _ in range(K):  # loop over draft slots, the batch stays vectorised
        d = dist(Q[prev])
        prev = sample(d, gen)
        toks.append(prev)
        dists.append(d)
    return torch.stack(toks, 1), torch.stack(dists, 1)


def dense_scenario(verifier: Callable, gen: torch.Generator) -> Emitted:
    num, valid = _ragged(gen)
    tokens, q = _sampled_chain(gen, lambda d: d)
    tokens = torch.where(valid, tokens, 0)  # padding ids may be 0
    q = q.masked_fill(~valid[..., None], float("nan"))  # and padding probabilities must never be read
    res = verifier(tokens, q, _target_rows(tokens, num), num, gen)
    return _first_two(tokens, num, res, gen)


def _top_k_raw(q: Tensor) -> tuple[Tensor, Tensor]:
    """[.., V] -> top-k ids and the *raw* (not renormalised) q there, as a drafter would ship them."""
    vals, ids = q.topk(TOP_K, dim=-1)
    return ids, vals


def sparse_scenario(verifier: Callable, gen: torch.Generator) -> Emitted:
    num, valid = _ragged(gen)

    def truncated(q: Tensor) -> Tensor:  # the draft sampler: top-k truncated, renormalised q
        ids, vals = _top_k_raw(q)
        return torch.zeros_like(q).scatter(-1, ids, vals / vals.sum(-1, keepdim=True))

    tokens, _ = _sampled_chain(gen, truncated)
    ctx = torch.cat([torch.full((N, 1), X0), tokens[:, :-1]], dim=1)  # [N, K] context of each slot
    ids, vals = _top_k_raw(Q[ctx])  # [N, K, k]
    tokens = torch.where(valid, tokens, 0)
    ids = torch.where(valid[..., None], ids, -1)
    vals = vals.masked_fill(~valid[..., None], float("nan"))
    res = verifier(tokens, ids, vals, _target_rows(tokens, num), num, gen)
    return _first_two(tokens, num, res, gen)


def point_mass_scenario(verifier: Callable, gen: torch.Generator) -> Emitted:
    """Deterministic drafts: half the rows the greedy q chain (an n-gram guess), half a fixed token
    sequence chosen independently of the verifier (a stale cache); neither was sampled from q."""
    num, valid = _ragged(gen)
    greedy, prev = [], torch.tensor(X0)
    for _ in range(K):
        prev = Q[prev].argmax()
        greedy.append(prev)
    stale = torch.randint(0, V, (N, K), generator=gen)
    tokens = torch.where((torch.arange(N) % 2 == 0)[:, None], torch.stack(greedy)[None], stale)
    tokens = torch.where(valid, tokens, 0)
    res = verifier(tokens, _target_rows(tokens, num), num, gen)
    return _first_two(tokens, num, res, gen)


def candidates_scenario(verifier: Callable, gen: torch.Generator) -> Emitted:
    """C = 3 distinct candidates after X0, ragged. Half the rows hold p's top 3 in order (a good drafter:
    likely tokens, where conditioning on earlier failures matters most), a quarter q's top 3, a quarter
    3 random tokens (often unlikely under p)."""
    num = torch.multinomial(torch.tensor([0.1, 0.1, 0.2, 0.6]), N, replacement=True, generator=gen)
    kind = torch.arange(N) % 4
    cands = torch.rand(N, V, generator=gen).argsort(-1)[:, :3]  # distinct per row
    cands = torch.where((kind < 2)[:, None], P[X0].topk(3).indices, cands)
    cands = torch.where((kind == 2)[:, None], Q[X0].topk(3).indices, cands)
    cands = torch.where(torch.arange(3) < num[:, None], cands, 0)  # padding 0 may repeat a real candidate
    idx, token = verifier(cands, num, P[X0].expand(N, V), gen)
    tried = num >= 1
    return Emitted(token, sample(P[token], gen), _shares(
        tried=tried, accepted=idx >= 0, accepted_later=idx >= 1, residual_after_tries=tried & (idx < 0)))


def tree_scenario(verifier: Callable, gen: torch.Generator) -> Emitted:
    """A two-level tree after X0: 3 root children (p's top 3, q's top 3, or random, as above), each with
    p's (in the rows whose roots are p's) or q's 2 likeliest followers; half the rows keep a random prefix of the 9 nodes (still a tree)."""
    kind = torch.arange(N) % 4
    roots = torch.rand(N, V, generator=gen).argsort(-1)[:, :3]
    roots = torch.where((kind < 2)[:, None], P[X0].topk(3).indices, roots)
    roots = torch.where((kind == 2)[:, None], Q[X0].topk(3).indices, roots)
    good = (kind < 2)[:, None, None]
    leaves = torch.where(good, P[roots].topk(2).indices, Q[roots].topk(2).indices).reshape(N, 6)  # [N, 6]:
    # the children of root child i at 2i and 2i + 1
    tokens = torch.cat([roots, leaves], 1)  # [N, 9]
    parents = torch.tensor([-1, -1, -1, 0, 0, 1, 1, 2, 2]).expand(N, 9)
    num = torch.where(torch.rand(N, generator=gen) < 0.5, 9, torch.randint(0, 9, (N,), generator=gen))
    rows = P[torch.cat([torch.full((N, 1), X0), tokens], 1)]  # [N, 10, V]
    rows = rows.masked_fill((torch.arange(10) > num[:, None])[..., None], float("nan"))  # never read
    res = verifier(torch.where(torch.arange(9) < num[:, None], tokens, 0), parents, num, rows, gen)
    at = res.path.clamp(min=0)
    first = torch.where(res.accepted >= 1, tokens.gather(1, at[:, :1]).squeeze(1), res.next_token)
    second = torch.where(res.accepted >= 2, tokens.gather(1, at[:, 1:2]).squeeze(1),
                         torch.where(res.accepted == 1, res.next_token, sample(P[first], gen)))
    return Emitted(first, second, _shares(
        branched=num >= 2, later_sibling=(res.accepted >= 1) & (at[:, 0] >= 1), depth_2=res.accepted == 2))


# --- deliberately biased verifiers (each a copy of the real one with one rule broken) -----------


def biased_dense_residual_from_p(draft_tokens, draft_probs, target_probs, num_drafts, generator=None):
    """On rejection samples from p instead of norm(max(0, p - q))."""
    k = draft_tokens.shape[1]
    valid, tokens = ver._real_slots(draft_tokens, num_drafts)
    p_x = target_probs[:, :k].gather(-1, tokens[..., None]).squeeze(-1)
    q_x = draft_probs.gather(-1, tokens[..., None]).squeeze(-1)
    accepted = ver._accept_prefix(p_x, q_x, valid, generator)
    return VerifyResult(accepted, sample(ver._rows(target_probs, accepted), generator))  # the bug


def biased_dense_bonus_off_by_one(draft_tokens, draft_probs, target_probs, num_drafts, generator=None):
    """Correct rule, but the bonus is sampled from the last draft slot's row instead of the bonus row."""
    res = verify_dense(draft_tokens, draft_probs, target_probs, num_drafts, generator)
    bonus = (res.accepted == num_drafts) & (num_drafts > 0)
    off = sample(ver._rows(target_probs, (res.accepted - 1).clamp(min=0)).nan_to_num(), generator)
    return VerifyResult(res.accepted, torch.where(bonus, off, res.next_token))


def biased_sparse_no_renorm(draft_tokens, topk_ids, topk_probs, target_probs, num_drafts, generator=None):
    """Uses the shipped raw top-k probabilities as q, forgetting the draft sampled them renormalised."""
    valid, tokens = ver._real_slots(draft_tokens, num_drafts)
    q = torch.where(valid[..., None], topk_probs, 0.0)  # the bug: no renormalisation
    dense = torch.zeros(*tokens.shape, target_probs.shape[-1]).scatter_add_(
        -1, torch.where(valid[..., None], topk_ids, 0), q
    )
    return verify_dense(tokens, dense, target_probs, num_drafts, generator)


def biased_point_mass_q_as_dist(draft_tokens, target_probs, num_drafts, generator=None):
    """The classic bug: feeds the drafter's own q(.|prev) into the dense rule though x̂ was not sampled."""
    ctx = torch.cat([torch.full((draft_tokens.shape[0], 1), X0), draft_tokens[:, :-1]], dim=1)
    return verify_dense(draft_tokens, Q[ctx], target_probs, num_drafts, generator)


def biased_point_mass_keep_rejected(draft_tokens, target_probs, num_drafts, generator=None):
    """On rejection samples from p without removing the rejected token."""
    k = draft_tokens.shape[1]
    valid, tokens = ver._real_slots(draft_tokens, num_drafts)
    p_x = target_probs[:, :k].gather(-1, tokens[..., None]).squeeze(-1)
    accepted = ver._accept_prefix(p_x, torch.ones_like(p_x), valid, generator)
    return VerifyResult(accepted, sample(ver._rows(target_probs, accepted), generator))  # the bug


def biased_candidates_unconditional(candidate_tokens, num_candidates, target_probs, generator=None):
    """Accepts candidate i with p(x_i) instead of p(x_i) / (1 - sum_{j<i} p(x_j))."""
    c = candidate_tokens.shape[1]
    valid, tokens = ver._real_slots(candidate_tokens, num_candidates)
    p_c = target_probs.gather(-1, tokens) * valid
    u = torch.rand(p_c.shape, generator=generator)
    first = ver._prefix_len(~((u < p_c) & valid))  # the bug: no conditioning on earlier failures
    hit = first < c
    tried = torch.zeros_like(target_probs).scatter_add_(-1, tokens, valid.float())
    drawn = ver._sample_next(target_probs, target_probs * (tried == 0), torch.zeros_like(hit), generator)
    picked = ver._rows(tokens, first.clamp(max=c - 1))
    return torch.where(hit, first, -1), torch.where(hit, picked, drawn)


def biased_candidates_keep_tried(candidate_tokens, num_candidates, target_probs, generator=None):
    """Correct acceptance, but the residual is p itself, tried candidates not removed."""
    idx, token = verify_candidates(candidate_tokens, num_candidates, target_probs, generator)
    return idx, torch.where(idx >= 0, token, sample(target_probs, generator))


def biased_tree_keep_tried(*args, **kwargs):
    """The real tree walk with the candidates rule that keeps tried tokens in the residual."""
    with mock.patch.object(ver, "verify_candidates", biased_candidates_keep_tried):
        return verify_tree(*args, **kwargs)


# --- statistical tests ---------------------------------------------------------------------------

REAL = [
    ("dense", verify_dense, dense_scenario),
    ("sparse", verify_sparse, sparse_scenario),
    ("point_mass", verify_point_mass, point_mass_scenario),
    ("candidates", verify_candidates, candidates_scenario),
    ("tree", verify_tree, tree_scenario),
]
BIASED = [
    ("dense_residual_from_p", biased_dense_residual_from_p, dense_scenario),
    ("dense_bonus_off_by_one", biased_dense_bonus_off_by_one, dense_scenario),
    ("sparse_no_renorm", biased_sparse_no_renorm, sparse_scenario),
    ("point_mass_q_as_dist", biased_point_mass_q_as_dist, point_mass_scenario),
    ("point_mass_keep_rejected", biased_point_mass_keep_rejected, point_mass_scenario),
    ("candidates_unconditional", biased_candidates_unconditional, candidates_scenario),
    ("candidates_keep_tried", biased_candidates_keep_tried, candidates_scenario),
    ("tree_keep_tried", biased_tree_keep_tried, tree_scenario),
]


# The least share of rows through each part of a rule (measured at seed 11: 0.75 drafted in every
# chain rule; slot 2 and the bonus 0.29 and 0.26 dense, 0.17 and 0.13 sparse, 0.058 and 0.040 point
# mass; candidates 0.90 tried, 0.43 accepted, 0.24 a later one, 0.47 the residual after tries; trees
# 0.89 branched, 0.30 through a later sibling, 0.17 depth 2).
THROUGH = {
    "dense": {"drafted": 0.7, "slot 2": 0.25, "bonus": 0.2},
    "sparse": {"drafted": 0.7, "slot 2": 0.15, "bonus": 0.1},
    "point_mass": {"drafted": 0.7, "slot 2": 0.04, "bonus": 0.03},
    "candidates": {"tried": 0.85, "accepted": 0.35, "accepted later": 0.2, "residual after tries": 0.4},
    "tree": {"branched": 0.85, "later sibling": 0.25, "depth 2": 0.12},
}


@pytest.mark.parametrize(("name", "verifier", "scenario"), REAL, ids=[r[0] for r in REAL])
def test_lossless(name, verifier, scenario):
    check = check_lossless(verifier, scenario, seed=11, name=name)
    report(check.pair, **check.shares)
    short = {path: check.shares[path] for path, least in THROUGH[name].items() if check.shares[path] < least}
    assert not short, f"{name}: too few rows through {short}"
    assert check.passed, f"{name}: {check}"


@pytest.mark.parametrize(("name", "verifier", "scenario"), BIASED, ids=[b[0] for b in BIASED])
def test_harness_catches_bias(name, verifier, scenario):
    check = check_lossless(verifier, scenario, seed=11, name=name)
    report(check.pair, twin=True)
    assert not check.passed, f"{name} slipped through: {check}"


def misreported_dense(strength: float) -> Callable:
    """The real dense rule fed q^(1 - strength), renormalised: the drafter misreports its q."""

    def verifier(draft_tokens, draft_probs, target_probs, num_drafts, generator=None):
        return verify_dense(draft_tokens, temper(draft_probs, strength), target_probs, num_drafts, generator)

    return verifier


def test_the_harness_catches_a_twin_near_its_limit():
    check = check_lossless(misreported_dense(0.12), dense_scenario, seed=11, name="dense, misreported-q 0.12")
    report(check.pair, twin=True)
    assert not check.passed, f"misreported q slipped through: {check}"


def test_chains_are_far_apart():
    # The biased checks only mean something if q really differs from p where the drafts start.
    assert 0.5 * (P[X0] - Q[X0]).abs().sum() > 0.2
    assert P[X0].max() < 0.5, "a near-one-hot target would hide a bias"


# --- exact / unit tests ------------------------------------------------------------------------


def _reference_greedy(draft: list[int], logits: Tensor, n: int) -> tuple[int, int]:
    for i in range(n):
        best = int(logits[i].argmax())
        if draft[i] != best:
            return i, best
    return n, int(logits[n].argmax())


def _greedy_batch(seed: int, b: int = 256, k: int = 4, v: int = 10):
    g = make_generator(seed)
    logits = torch.randn(b, k + 1, v, generator=g)
    best = logits.argmax(-1)[:, :k]
    # Mostly follow the argmax so long accepted prefixes and bonuses occur.
    draft = torch.where(torch.rand(b, k, generator=g) < 0.8, best, torch.randint(0, v, (b, k), generator=g))
    num = torch.randint(0, k + 1, (b,), generator=g)
    num[:8] = 0
    num[8:16] = k
    draft[8:16] = best[8:16]  # all accepted -> bonus from row K
    return logits, draft, num, g


def test_greedy_matches_reference():
    logits, draft, num, _ = _greedy_batch(0)
    res = verify_greedy(draft, logits, num)
    for b in range(draft.shape[0]):
        assert (res.accepted[b].item(), res.next_token[b].item()) == _reference_greedy(
            draft[b].tolist(), logits[b], int(num[b])
        )
    assert (res.accepted[:8] == 0).all() and (res.next_token[:8] == logits[:8, 0].argmax(-1)).all()
    assert (res.accepted[8:16] == 4).all() and (res.next_token[8:16] == logits[8:16, 4].argmax(-1)).all()


def test_sampling_verifiers_reduce_to_greedy_on_one_hot_target():
    logits, draft, num, g = _greedy_batch(1)
    p = logits_to_probs(logits, SamplingParams(temperature=0.0))  # one-hot argmax
    want = verify_greedy(draft, logits, num)
    q = torch.rand(*draft.shape, logits.shape[-1], generator=g).softmax(-1)
    ids = q.argsort(-1, descending=True)
    for res in (
        verify_dense(draft, q, p, num, g),
        verify_sparse(draft, ids, q.gather(-1, ids), p, num, g),
        verify_point_mass(draft, p, num, g),
    ):
        assert torch.equal(res.accepted, want.accepted) and torch.equal(res.next_token, want.next_token)


def test_candidates_greedy_accepts_the_argmax():
    g = make_generator(2)
    b, c, v = 512, 3, 10
    logits = torch.randn(b, v, generator=g)
    p = logits_to_probs(logits, SamplingParams(temperature=0.0))
    cands = torch.rand(b, v, generator=g).argsort(-1)[:, :c]
    num = torch.randint(0, c + 1, (b,), generator=g)
    idx, token = verify_candidates(cands, num, p, g)
    best = logits.argmax(-1)
    assert torch.equal(token, best)
    is_best = (cands == best[:, None]) & (torch.arange(c) < num[:, None])
    assert torch.equal(idx, torch.where(is_best.any(-1), is_best.long().argmax(-1), -1))


def test_candidates_invariants():
    g = make_generator(10)
    b, c = 20_000, 3
    probs = torch.rand(b, V, generator=g).pow(3).softmax(-1)
    cands = torch.rand(b, V, generator=g).argsort(-1)[:, :c]
    num = torch.randint(0, c + 1, (b,), generator=g)
    real = torch.arange(c) < num[:, None]
    idx, token = verify_candidates(torch.where(real, cands, 0), num, probs, g)
    hit = idx >= 0
    assert bool(((idx >= -1) & (idx < num)).all()) and bool(hit.any()) and bool((~hit).any())
    assert torch.equal(cands.gather(1, idx.clamp(min=0)[:, None]).squeeze(1)[hit], token[hit])
    was_tried = ((token[:, None] == cands) & real).any(-1)
    assert not bool(was_tried[~hit].any())  # the residual never re-emits a tried candidate


def test_zero_drafts_sample_target_row0():
    g = make_generator(3)
    row0 = P[X0]
    target = torch.full((N, K + 1, V), float("nan"))  # only row 0 may be read
    target[:, 0] = row0
    tokens = torch.zeros(N, K, dtype=torch.long)
    num = torch.zeros(N, dtype=torch.long)
    threshold = tv_threshold(row0, N).value
    for res in (
        verify_dense(tokens, torch.full((N, K, V), float("nan")), target, num, g),
        verify_sparse(
            tokens, torch.full((N, K, TOP_K), -1), torch.full((N, K, TOP_K), float("nan")), target, num, g
        ),
        verify_point_mass(tokens, target, num, g),
    ):
        assert (res.accepted == 0).all()
        assert tv(torch.bincount(res.next_token, minlength=V), row0) < threshold
    idx, token = verify_candidates(tokens, num, row0.expand(N, V), g)
    assert (idx == -1).all() and tv(torch.bincount(token, minlength=V), row0) < threshold
    assert torch.equal(verify_greedy(tokens, target.nan_to_num(), num).next_token, row0.argmax().expand(N))


def test_no_drafts_at_all():
    g = make_generator(4)
    target = P[X0].expand(16, 1, V)
    empty = torch.zeros(16, 0, dtype=torch.long)
    num = torch.zeros(16, dtype=torch.long)
    for res in (
        verify_greedy(empty, target, num),
        verify_dense(empty, torch.zeros(16, 0, V), target, num, g),
        verify_sparse(empty, torch.zeros(16, 0, 2, dtype=torch.long), torch.zeros(16, 0, 2), target, num, g),
        verify_point_mass(empty, target, num, g),
    ):
        assert (res.accepted == 0).all() and res.next_token.shape == (16,)
    idx, token = verify_candidates(empty, num, target[:, 0], g)
    assert (idx == -1).all() and token.shape == (16,)


def test_degenerate_residual_falls_back_to_p():
    # p slightly under-normalised (rounding) so that max(0, p - q) is all zero yet rejection can happen.
    g = make_generator(5)
    b = 4000
    p = torch.zeros(b, 2, V)
    p[:, :, 0], p[:, :, 1] = 0.4, 0.5
    q = torch.zeros(b, 1, V)
    q[:, :, 0], q[:, :, 1] = 0.5, 0.5
    tok = torch.zeros(b, 1, dtype=torch.long)
    one = torch.ones(b, dtype=torch.long)
    res = verify_dense(tok, q, p, one, g)
    assert ((res.accepted == 0).sum() > 0) and bool((res.next_token <= 1).all())
    res = verify_sparse(tok, torch.tensor([0, 1]).expand(b, 1, 2), torch.full((b, 1, 2), 0.5), p, one, g)
    assert ((res.accepted == 0).sum() > 0) and bool((res.next_token <= 1).all())

    pm = torch.zeros(b, 2, V)
    pm[:, :, 3] = 0.9  # p(x̂) < 1 only by rounding: nothing else to sample on rejection
    res = verify_point_mass(torch.full((b, 1), 3), pm, one, g)
    assert ((res.accepted == 0).sum() > 0) and bool((res.next_token == 3).all())

    pc = torch.zeros(b, V)
    pc[:, 0], pc[:, 1] = 0.45, 0.45  # the candidates cover all of p's mass
    idx, token = verify_candidates(torch.tensor([0, 1]).expand(b, 2), torch.full((b,), 2), pc, g)
    assert ((idx == -1).sum() > 0) and bool((token <= 1).all())


def test_padding_is_ignored_and_accepted_bounded():
    g = make_generator(6)
    b, k, v = 2000, 4, 10
    num = torch.randint(0, k + 1, (b,), generator=g)
    valid = torch.arange(k) < num[:, None]
    q = torch.rand(b, k, v, generator=g).softmax(-1)
    tokens = sample(q.reshape(-1, v), g).reshape(b, k)
    target = torch.rand(b, k + 1, v, generator=g).softmax(-1)
    ids = q.argsort(-1, descending=True)[..., :5]
    vals = q.gather(-1, ids)

    clean_tok = torch.where(valid, tokens, 0)
    junk_tok = torch.where(valid, tokens, -7)
    pad_rows = (torch.arange(k + 1) > num[:, None])[..., None]
    junk_target = target.masked_fill(pad_rows, float("nan"))
    junk_q = q.masked_fill(~valid[..., None], float("nan"))
    junk_ids = torch.where(valid[..., None], ids, 10_000)
    junk_vals = vals.masked_fill(~valid[..., None], float("nan"))

    def same(f_clean, f_junk):
        a, z = f_clean(make_generator(9)), f_junk(make_generator(9))
        assert torch.equal(a.accepted, z.accepted) and torch.equal(a.next_token, z.next_token)
        assert bool(((a.accepted >= 0) & (a.accepted <= num)).all())

    same(
        lambda gg: verify_greedy(clean_tok, target, num), lambda gg: verify_greedy(junk_tok, junk_target, num)
    )
    same(
        lambda gg: verify_dense(clean_tok, q, target, num, gg),
        lambda gg: verify_dense(junk_tok, junk_q, junk_target, num, gg),
    )
    same(
        lambda gg: verify_sparse(clean_tok, ids, vals, target, num, gg),
        lambda gg: verify_sparse(junk_tok, junk_ids, junk_vals, junk_target, num, gg),
    )
    same(
        lambda gg: verify_point_mass(clean_tok, target, num, gg),
        lambda gg: verify_point_mass(junk_tok, junk_target, num, gg),
    )


def test_sparse_exact_equivalences():
    g = make_generator(7)
    b, k, v = 4000, 3, 10
    num = torch.randint(0, k + 1, (b,), generator=g)
    target = torch.rand(b, k + 1, v, generator=g).softmax(-1)
    q = torch.rand(b, k, v, generator=g).softmax(-1)
    vals, ids = q.topk(4, dim=-1)
    renorm = vals / vals.sum(-1, keepdim=True)
    tokens = ids.gather(-1, sample(renorm.reshape(-1, 4), g).reshape(b, k, 1)).squeeze(-1)

    # Raw top-k probabilities and renormalised ones describe the same draft sampler.
    a = verify_sparse(tokens, ids, vals, target, num, make_generator(1))
    z = verify_sparse(tokens, ids, renorm, target, num, make_generator(1))
    assert torch.equal(a.accepted, z.accepted) and torch.equal(a.next_token, z.next_token)

    # Sparse over the renormalised support is the dense rule on the scattered q.
    dense_q = torch.zeros_like(q).scatter(-1, ids, renorm)
    d = verify_dense(tokens, dense_q, target, num, make_generator(1))
    assert torch.equal(a.accepted, d.accepted) and torch.equal(a.next_token, d.next_token)


def test_point_mass_is_dense_rule_with_one_hot_q():
    g = make_generator(8)
    b, k, v = 4000, 3, 10
    num = torch.randint(0, k + 1, (b,), generator=g)
    tokens = torch.randint(0, v, (b, k), generator=g)
    target = torch.rand(b, k + 1, v, generator=g).softmax(-1)
    one_hot = torch.nn.functional.one_hot(tokens, v).float()
    a = verify_point_mass(tokens, target, num, make_generator(1))
    d = verify_dense(tokens, one_hot, target, num, make_generator(1))
    assert torch.equal(a.accepted, d.accepted) and torch.equal(a.next_token, d.next_token)


def test_seeded_runs_reproduce():
    logits, draft, num, _ = _greedy_batch(9)
    p = logits.softmax(-1)
    q = torch.rand(*draft.shape, logits.shape[-1], generator=make_generator(0)).softmax(-1)
    a = verify_dense(draft, q, p, num, make_generator(42))
    z = verify_dense(draft, q, p, num, make_generator(42))
    assert torch.equal(a.accepted, z.accepted) and torch.equal(a.next_token, z.next_token)


def test_emitted_tokens():
    draft = torch.tensor([[5, 6, 7], [1, 2, 3], [9, 9, 9]])
    res = VerifyResult(accepted=torch.tensor([2, 0, 3]), next_token=torch.tensor([4, 8, 0]))
    assert res.emitted(draft) == [[5, 6, 4], [8], [9, 9, 9, 0]]
