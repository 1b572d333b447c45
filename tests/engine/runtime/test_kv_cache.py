"""The KV cache's slot operations: allocate, truncate, release, and fork (SSD's copy of a prefix)."""

import pytest
import torch

from specpool.engine.runtime.config import tiny_config
from specpool.engine.runtime.kv_cache import KVCache


def test_a_fork_holds_the_prefix_and_the_original_is_untouched():
    cache = KVCache(tiny_config(vocab_size=16, n_layers=2), max_slots=3, max_len=8, dtype=torch.float32,
                    device=torch.device("cpu"))
    slot = cache.allocate()
    cache.k[:, slot, :, :6] = torch.randn_like(cache.k[:, slot, :, :6])
    cache.v[:, slot, :, :6] = torch.randn_like(cache.v[:, slot, :, :6])
    cache.lengths[slot] = 6

    fork = cache.fork(slot, 4)
    assert fork != slot and cache.lengths[fork] == 4 and cache.lengths[slot] == 6
    assert torch.equal(cache.k[:, fork, :, :4], cache.k[:, slot, :, :4])
    assert torch.equal(cache.v[:, fork, :, :4], cache.v[:, slot, :, :4])
    assert cache.free_slots == 1

    cache.truncate(fork, 2)
    with pytest.raises(ValueError):
        cache.truncate(fork, 3)
    cache.release(fork)
    assert cache.free_slots == 2 and cache.lengths[slot] == 6
