"""The KV cache's slot operations: allocate, truncate, release, and fork (SSD's copy of a prefix), and its memory."""

import os

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


def _resident_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_cache_is_resident_only_where_it_is_written():
    """Sized for every slot at full length (here 2 x 512 MiB), a cache costs memory as sequences reach into it:
    its zeros are the OS's zero pages until written."""
    config = tiny_config(vocab_size=64, n_layers=4, d_model=256)
    before = _resident_bytes()
    cache = KVCache(config, max_slots=63, max_len=8192, dtype=torch.float32, device=torch.device("cpu"))
    assert cache.k.nbytes + cache.v.nbytes >= 2**30
    assert _resident_bytes() - before < 64 * 2**20
    assert cache.k.data_ptr() % 64 == 0 and cache.v.data_ptr() % 64 == 0
    cache.k[:, 3, :, :16] = 1.0
    assert cache.k[:, 3].sum() == cache.k[:, 3, :, :16].numel() and cache.k[:, 4].abs().sum() == 0
