"""The suffix store: exact counts, proposals against a brute-force reference, eviction, tenant isolation."""

import heapq
import random
import time
from collections import Counter, OrderedDict

import pytest

from specpool.engine.drafters.suffix_store import SuffixStore, SuffixStores, TreeDraft
from specpool.engine.verification.token_tree import check_tree, path_to


def occurrences(docs, pattern):
    n = len(pattern)
    return sum(d[i : i + n] == pattern for d in docs for i in range(len(d) - n + 1))


def substrings(docs, max_depth):
    return {tuple(d[i : i + n]) for d in docs for n in range(1, max_depth + 1) for i in range(len(d) - n + 1)}


def next_token_shares(docs, context, max_depth):
    """Shares of the tokens that followed the longest suffix (< max_depth tokens) of context that
    was followed by anything: the distribution the store should draft each node from."""
    for n in range(min(len(context), max_depth - 1), 0, -1):
        pattern = list(context[-n:])
        after = Counter(d[i + n] for d in docs for i in range(len(d) - n) if d[i : i + n] == pattern)
        if after:
            total = sum(after.values())
            return {t: c / total for t, c in after.items()}
    return {}


def reference_probs(docs, context, budget, max_depth, min_prob=0.0):
    """The `budget` highest path probabilities, best-first by brute force (ties in any order: the
    multiset of values does not depend on them)."""
    heap, out = [(-1.0, ())], []
    while heap and len(out) < budget + 1:
        neg, path = heapq.heappop(heap)
        out.append(-neg)
        for t, share in next_token_shares(docs, list(context) + list(path), max_depth).items():
            if -neg * share >= min_prob:
                heapq.heappush(heap, (neg * share, path + (t,)))
    return out[1:]  # the first is the root


def random_docs(seed, n_docs=12, vocab=4, length=(5, 40)):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(*length))] for _ in range(n_docs)]


def build(docs, max_depth, max_tokens=10**6, chunks_seed=None):
    store = SuffixStore(max_tokens, max_depth)
    rng = random.Random(chunks_seed)
    pending = {i: list(d) for i, d in enumerate(docs)}
    while pending:  # interleaved, in random chunks when a seed is given
        i = rng.choice(sorted(pending)) if chunks_seed is not None else min(pending)
        k = rng.randint(1, 7) if chunks_seed is not None else len(pending[i])
        store.extend(i, pending[i][:k])
        pending[i] = pending[i][k:]
        if not pending[i]:
            del pending[i]
    return store


@pytest.mark.parametrize("seed, max_depth", [(0, 2), (1, 5), (2, 8)])
def test_counts_and_nodes_match_brute_force(seed, max_depth):
    docs = random_docs(seed)
    store = build(docs, max_depth, chunks_seed=seed)
    subs = substrings(docs, max_depth)
    assert store.num_tokens == sum(map(len, docs))
    assert store.num_nodes == len(subs)
    for pattern in subs:
        assert store.count(list(pattern)) == occurrences(docs, list(pattern))


@pytest.mark.parametrize(
    "seed, max_depth, budget, min_prob", [(3, 3, 8, 0.0), (4, 5, 12, 0.0), (5, 6, 16, 0.05), (6, 16, 5, 0.2)]
)
def test_proposals_are_best_first_trees_matching_the_reference(seed, max_depth, budget, min_prob):
    docs = random_docs(seed)
    store = build(docs, max_depth, chunks_seed=seed)
    rng = random.Random(seed)
    for _ in range(60):
        doc = rng.choice(docs)
        context = doc[: rng.randint(1, len(doc))]  # often the tail of an indexed document
        draft = store.propose(context, budget, min_prob=min_prob)
        check_tree(draft.tokens, draft.parents)
        assert len(draft.tokens) <= budget
        assert draft.probs == sorted(draft.probs, reverse=True)  # best first: parents, then siblings by share
        assert all(p >= min_prob for p in draft.probs)
        for i, (token, parent) in enumerate(zip(draft.tokens, draft.parents)):
            path = [draft.tokens[j] for j in path_to(draft.parents, parent)]
            parent_prob = 1.0 if parent < 0 else draft.probs[parent]
            shares = next_token_shares(docs, context + path, max_depth)
            assert draft.probs[i] == pytest.approx(parent_prob * shares[token])
        want = reference_probs(docs, context, budget, max_depth, min_prob)
        assert draft.probs == pytest.approx(want)
        assert draft.score == pytest.approx(sum(want))


def test_frequent_continuation_comes_first_and_min_prob_cuts_the_rare():
    store = SuffixStore(1000, max_depth=8)
    for i, last in enumerate([7, 7, 8, 7]):
        store.extend(i, [1, 2, 3, 4, last])
    draft = store.propose([9, 2, 3, 4], budget=2)
    assert draft == TreeDraft(tokens=[7, 8], parents=[-1, -1], probs=[0.75, 0.25])
    assert draft.score == 1.0
    assert store.propose([9, 2, 3, 4], budget=2, min_prob=0.3).tokens == [7]
    assert store.propose([9, 2, 3, 4], budget=0) == TreeDraft([], [], [])
    assert store.propose([5, 6], budget=4) == TreeDraft([], [], [])  # never seen
    store.extend("empty", [])
    assert "empty" not in store


def test_drafts_go_deeper_than_the_trie_by_rematching():
    store = SuffixStore(1000, max_depth=4)  # a match leaves room for at most 3 tokens in the trie
    store.extend("a", list(range(1, 13)))
    draft = store.propose([0, 5, 6, 7], budget=8)
    assert draft.tokens == [8, 9, 10, 11, 12] and draft.parents == [-1, 0, 1, 2, 3]
    assert draft.probs == [1.0] * 5


def test_the_context_own_final_occurrence_is_no_continuation():
    store = SuffixStore(1000, max_depth=8)
    store.extend("self", [1, 2, 3, 9, 1, 2, 3])
    # [1, 2, 3] occurs twice, but the second occurrence is the context's own end: 9 has it all.
    assert store.propose([1, 2, 3, 9, 1, 2, 3], budget=1) == TreeDraft([9], [-1], [1.0])
    store.extend("alone", [5, 6, 7])
    assert store.propose([5, 6, 7], budget=4).tokens == []
    # The longest suffix that occurs ([0, 2, 3, 4], only here) is passed over for the longest one
    # that was followed by something.
    store.extend("other", [1, 2, 3, 4, 5])
    store.extend("request", [0, 2, 3, 4])
    assert store.propose([0, 2, 3, 4], budget=1) == TreeDraft([5], [-1], [1.0])


def test_eviction_leaves_the_store_its_survivors_would_build():
    max_tokens, max_depth = 60, 5
    store = SuffixStore(max_tokens, max_depth)
    survivors: OrderedDict[int, list[int]] = OrderedDict()  # the eviction policy, simulated
    rng = random.Random(7)
    written = []
    for _ in range(150):
        doc_id, tokens = rng.randrange(8), [rng.randrange(4) for _ in range(rng.randint(1, 25))]
        written.append(tokens)
        store.extend(doc_id, tokens)
        doc = survivors.pop(doc_id, [])
        if len(doc) + len(tokens) > max_tokens:  # too long to fit whole: restarts from its newest tokens
            doc, tokens = [], tokens[-max_tokens:]
        while survivors and sum(map(len, survivors.values())) + len(doc) + len(tokens) > max_tokens:
            survivors.popitem(last=False)
        survivors[doc_id] = doc + tokens
        assert store.num_tokens == sum(map(len, survivors.values())) <= max_tokens
        assert all((i in store) == (i in survivors) for i in range(8))

    fresh = SuffixStore(max_tokens, max_depth)
    for doc_id, tokens in survivors.items():
        fresh.extend(doc_id, tokens)
    docs = list(survivors.values())
    assert store.num_nodes == fresh.num_nodes == len(substrings(docs, max_depth))
    for pattern in substrings(written, max_depth):
        assert store.count(list(pattern)) == fresh.count(list(pattern)) == occurrences(docs, list(pattern))
    for tokens in written:
        for end in range(1, len(tokens) + 1):
            assert store.propose(tokens[:end], 10) == fresh.propose(tokens[:end], 10)

    for doc_id in list(survivors):
        store.remove(doc_id)
    assert store.num_tokens == store.num_nodes == 0


def test_tenants_see_only_their_own_text_or_their_model_pool():
    # Tenant k writes tokens 100k..100k+9 only, so any drafted token says whose text shaped it.
    tenants = [
        ("m1", False),
        ("m1", False),
        ("m1", True),
        ("m1", True),
        ("m2", True),
        ("m2", False),
        ("m1", True),
    ]
    stores = SuffixStores(max_tokens=10_000, max_stores=100, max_depth=6)
    texts = {}
    rng = random.Random(8)
    for k, (model, share) in enumerate(tenants):
        texts[k] = [100 * k + rng.randrange(10) for _ in range(200)]
        stores.for_tenant(model, f"t{k}", share=share).extend(f"t{k}/0", texts[k])
    for k, (model, share) in enumerate(tenants):
        readable = {k} | {j for j, (m, s) in enumerate(tenants) if share and s and m == model}
        store = stores.for_tenant(model, f"t{k}", share=share)
        for j, text in texts.items():
            drafted = {t // 100 for end in range(5, 200, 13) for t in store.propose(text[:end], 8).tokens}
            assert drafted <= readable, (k, j)
            assert (drafted == {j}) == (j in readable)  # and what it may read, it does draft from
    assert len(stores) == 2 + 3  # pools of m1 and m2, and the three private tenants


def test_tenant_stores_are_bounded_least_recently_used_first():
    stores = SuffixStores(max_tokens=100, max_stores=3)
    first = stores.for_tenant("m", "t0")
    first.extend("r", [1, 2, 3])
    second = stores.for_tenant("m", "t1")
    stores.for_tenant("m", "t2")
    assert stores.for_tenant("m", "t0") is first  # used again: t1 is now the least recent
    stores.for_tenant("m", "t3")
    assert stores.for_tenant("m", "t0") is first
    for k in range(4, 10):
        stores.for_tenant("m", f"t{k}")
        assert len(stores) == 3
    assert stores.for_tenant("m", "t1") is not second
    evicted = stores.for_tenant("m", "t0")
    assert evicted is not first and evicted.num_tokens == 0


def test_speed():
    rng = random.Random(9)
    store = SuffixStore(max_tokens=200_000, max_depth=16)
    # Text-like data: phrases of a few hundred tokens reused with variations, over a 32k vocabulary.
    phrases = [[rng.randrange(32_000) for _ in range(rng.randint(3, 12))] for _ in range(400)]
    docs = [[t for _ in range(60) for t in rng.choice(phrases)] for _ in range(200)]
    start = time.perf_counter()
    for i, doc in enumerate(docs):
        store.extend(i, doc[:500])
    per_extend = (time.perf_counter() - start) / len(docs)
    start = time.perf_counter()
    drafts = [store.propose(doc[: rng.randint(20, 500)], 16) for doc in docs]
    per_propose = (time.perf_counter() - start) / len(docs)
    print(f"extend 500 tokens: {per_extend * 1e3:.1f} ms, propose budget 16: {per_propose * 1e6:.0f} us")
    assert sum(len(d.tokens) for d in drafts) > 10 * len(docs)
    assert per_extend < 0.25 and per_propose < 0.01  # generous bounds for a loaded CI machine
