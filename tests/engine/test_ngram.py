"""N-gram drafting: suffix array, longest-suffix lookups, candidate merging, and losslessness."""

import time

import numpy as np
import pytest
import torch

from engine.config import tiny_config
from engine.decoding import generate
from engine.model import Llama
from engine.ngram import NgramDrafter, NgramIndex, SuffixArrayDatastore, merge_candidates, suffix_array
from engine.sampling import SamplingParams


@pytest.mark.parametrize("seed, n, vocab", [(0, 1, 3), (1, 50, 2), (2, 300, 5), (3, 1000, 40)])
def test_suffix_array_matches_naive_sort(seed, n, vocab):
    tokens = np.random.default_rng(seed).integers(-1, vocab, n)
    naive = sorted(range(n), key=lambda i: tokens[i:].tolist())
    assert suffix_array(tokens).tolist() == naive


def _brute_force(docs, context, length):
    """Longest suffix (<= 6) of context found in some doc, and all its continuations."""
    for n in range(min(6, len(context)), 0, -1):
        pat = list(context[-n:])
        conts = []
        for d in docs:
            for i in range(len(d) - n + 1):
                if d[i : i + n] == pat and d[i + n : i + n + length]:
                    conts.append(d[i + n : i + n + length])
        if conts:
            return n, sorted(conts)
    return 0, []


def test_datastore_finds_longest_suffix_and_its_continuations():
    rng = np.random.default_rng(4)
    docs = [rng.integers(0, 6, rng.integers(5, 40)).tolist() for _ in range(30)]
    store = SuffixArrayDatastore.build(docs)
    for _ in range(200):
        context = rng.integers(0, 6, rng.integers(1, 9)).tolist()
        n, conts = store.continuations(context, 3, max_matches=10_000)
        want_n, want = _brute_force(docs, context, 3)
        assert n == want_n
        assert sorted(conts) == want


def test_datastore_roundtrip_and_speed(tmp_path):
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 49152, 300).tolist() for _ in range(1000)]  # 300k tokens
    store = SuffixArrayDatastore.build(docs)
    store.save(tmp_path / "ds.npz")
    loaded = SuffixArrayDatastore.load(tmp_path / "ds.npz")
    context = docs[7][100:140]
    n, conts = loaded.continuations(context, 8)
    assert n == 6 and conts == [docs[7][140:148]]
    start = time.perf_counter()
    for i in range(200):
        loaded.continuations(docs[i][:50], 8)
    per_query = (time.perf_counter() - start) / 200
    print(f"datastore query: {per_query * 1e6:.0f} us over {len(loaded)} tokens")
    assert per_query < 5e-3  # generous bound for a loaded CI machine; typically ~0.1 ms


def test_request_index_prefers_longest_and_most_recent_match():
    index = NgramIndex(max_n=3)
    index.extend([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3])
    n, conts = index.continuations(2)
    assert n == 2 and conts[0] == [7, 5] and conts[1] == [9, 1]
    index.extend([4])
    assert index.continuations(2) == (0, [])


def test_merge_takes_heaviest_path():
    path = merge_candidates([(2.0, [[5, 6, 7], [5, 8]]), (1.0, [[5, 8, 1], [9]])], 3)
    assert path == [5, 8, 1]


def test_ngram_speculation_greedy_equals_ar(tiny_model):
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11], [3]]
    ar = generate(tiny_model, prompts, SamplingParams(), 20, stop_ids=[])
    store = SuffixArrayDatastore.build([r.token_ids for r in ar][:2])  # it has seen these answers before
    for drafter in (NgramDrafter(), NgramDrafter(store)):
        spec = generate(tiny_model, prompts, SamplingParams(), 20, drafter, num_draft_tokens=4, stop_ids=[])
        assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
    assert sum(r.target_steps for r in spec) < sum(r.target_steps for r in ar)


def test_ngram_sampling_matches_ar_distribution():
    """The n-gram path is the point-mass verifier; check the first drafted token's distribution too."""
    from engine.sampling import logits_to_probs, make_generator
    from tests.stats import tv, tv_threshold

    model = Llama.random_init(tiny_config(vocab_size=8, d_model=16), seed=11)
    params = SamplingParams(temperature=3.0, seed=8)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # the index will draft 3 after 2
    n = 100_000
    results = generate(model, [prompt] * n, params, 2, NgramDrafter(), num_draft_tokens=3, stop_ids=[])
    firsts = torch.tensor([r.token_ids[0] for r in results])
    seconds = torch.tensor([r.token_ids[1] for r in results])
    cache = model.new_cache(9, 16)
    p1 = logits_to_probs(model.forward(cache, [cache.allocate()], [prompt]), params)[0]
    rows = [prompt + [a] for a in range(8)]
    p2 = logits_to_probs(model.forward(cache, [cache.allocate() for _ in range(8)], rows), params)
    exact = (p1[:, None] * p2).reshape(-1)
    threshold, _ = tv_threshold(exact, n, make_generator(1))
    assert tv(torch.bincount(firsts * 8 + seconds, minlength=64), exact) < threshold
