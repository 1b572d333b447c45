"""A token tree fed in one forward gives every node the logits its own path would get, and keeping an
accepted path leaves the cache as if that path alone had been fed."""

from __future__ import annotations

import pytest
import torch

from specpool.engine.runtime.model import Llama
from specpool.engine.verification import token_tree

# root -> a, b; a -> c, d; b -> e; d -> f  (nodes in topological order)
TOKENS = [11, 12, 13, 14, 15, 16]
PARENTS = [-1, -1, 0, 0, 1, 3]
PROMPT = [5, 9, 14, 3, 22, 7]
ROOT = 30


def _fed_parents(parents):
    return [-1] + [p + 1 for p in parents]  # the root is fed first: node i is fed at i + 1


def _path_logits(model: Llama, path: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, 64)
    slot = cache.allocate()
    model.forward(cache, [slot], [PROMPT])
    return model.forward(cache, [slot], [[ROOT] + path], all_logits=True)[0, -1]


def test_helpers():
    assert token_tree.depths(PARENTS) == [0, 0, 1, 1, 1, 2]
    assert token_tree.path_to(PARENTS, 5) == [0, 3, 5]
    assert token_tree.is_chain(token_tree.chain(4)) and not token_tree.is_chain(PARENTS)
    with pytest.raises(ValueError, match=r"parents\[1\] = 1"):
        token_tree.check_parents([-1, 1])
    assert token_tree.first_children(PARENTS) == [0, 2]


def test_the_matched_path_follows_emitted_tokens_through_siblings():
    tokens, parents = [7, 8, 9, 3, 9], [-1, -1, 0, 1, 1]  # 7 -> 9; 8 -> 3, 9
    assert token_tree.matched_path(tokens, parents, [8, 9, 5]) == [1, 4]
    assert token_tree.matched_path(tokens, parents, [7, 3]) == [0]  # 3 is a child of 8, not of 7
    assert token_tree.matched_path(tokens, parents, [5]) == []


@pytest.mark.parametrize("batch_shape", ["alone", "beside a chain"])
def test_every_node_gets_its_paths_logits(tiny_model, batch_shape):
    cache = tiny_model.new_cache(2, 64)
    slots = [cache.allocate(), cache.allocate()]
    tiny_model.forward(cache, slots, [PROMPT, PROMPT[:3]])
    feeds, parents = [[ROOT] + TOKENS], [_fed_parents(PARENTS)]
    if batch_shape == "beside a chain":
        feeds.append([4, 8, 2])
        parents.append(token_tree.chain(3))
    logits = tiny_model.forward(cache, slots[: len(feeds)], feeds, all_logits=True, parents=parents)
    torch.testing.assert_close(logits[0, 0], _path_logits(tiny_model, []), atol=1e-4, rtol=1e-4)
    for node in range(len(TOKENS)):
        path = [TOKENS[i] for i in token_tree.path_to(PARENTS, node)]
        torch.testing.assert_close(logits[0, node + 1], _path_logits(tiny_model, path), atol=1e-4, rtol=1e-4)


def test_keeping_a_path_leaves_the_cache_as_if_it_alone_was_fed(tiny_model):
    cache = tiny_model.new_cache(1, 64)
    slot = cache.allocate()
    tiny_model.forward(cache, [slot], [PROMPT])
    start = cache.lengths[slot]
    tiny_model.forward(cache, [slot], [[ROOT] + TOKENS], parents=[_fed_parents(PARENTS)])
    path = token_tree.path_to(PARENTS, 5)  # nodes 0, 3, 5: fed at 1, 4, 6
    cache.keep_path(slot, start, [0] + [n + 1 for n in path])
    after = tiny_model.forward(cache, [slot], [[40]])[0]

    fresh = tiny_model.new_cache(1, 64)
    s = fresh.allocate()
    tiny_model.forward(fresh, [s], [PROMPT + [ROOT] + [TOKENS[i] for i in path]])
    torch.testing.assert_close(after, tiny_model.forward(fresh, [s], [[40]])[0], atol=1e-4, rtol=1e-4)


def test_a_tree_grown_over_several_calls_is_the_tree_fed_at_once(tiny_model):
    cache = tiny_model.new_cache(1, 64)
    slot = cache.allocate()
    tiny_model.forward(cache, [slot], [PROMPT])
    fed = _fed_parents(PARENTS)
    first = tiny_model.forward(cache, [slot], [[ROOT] + TOKENS[:2]], all_logits=True, parents=[fed[:3]])
    rest = tiny_model.forward(cache, [slot], [TOKENS[2:]], all_logits=True, parents=[fed])
    grown = torch.cat([first[0], rest[0]])
    for node in range(len(TOKENS)):
        path = [TOKENS[i] for i in token_tree.path_to(PARENTS, node)]
        torch.testing.assert_close(grown[node + 1], _path_logits(tiny_model, path), atol=1e-4, rtol=1e-4)
