"""A preallocated, slot-indexed KV cache shared by every sequence a model serves.

Each sequence owns one slot while it lives; its length is the number of valid positions.
Rolling back rejected draft positions only lowers that length: stale entries beyond it are
never attended to and are overwritten by the next step.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from specpool.engine.runtime.config import ModelConfig

ALIGN = 64  # bytes: as torch's own CPU allocations


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that become resident page by page as they are written, on the CPU (numpy's zeros are calloc's:
    the OS maps zero pages lazily; torch.zeros writes every byte). A cache sized for every slot at full
    length then costs memory only where sequences reach: an endpoint drafting with the Qwen2.5-Coder 0.5B
    (64 sessions and SSD's 144 slots, 2048 positions) was 10.9 GB resident at start."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(size + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return torch.from_numpy(raw[start : start + size]).view(dtype).view(shape)


class KVCache:
    def __init__(
        self, config: ModelConfig, max_slots: int, max_len: int, dtype: torch.dtype, device: torch.device
    ):
        # Heads before positions: each (sequence, head) reads its keys as one contiguous block.
        # One slot more than asked: the scratch slot that padded positions of ragged steps write to.
        shape = (config.n_layers, max_slots + 1, config.n_kv_heads, max_len, config.head_dim)
        self.k = zeros_on_demand(shape, dtype, device)  # [L, S, Hkv, T, D]
        self.v = zeros_on_demand(shape, dtype, device)
        self.max_slots = max_slots
        self.max_len = max_len
        self.scratch_slot = max_slots  # never handed out
        self.lengths = [0] * (max_slots + 1)  # host-side: read every step, so no device sync
        self._free = list(range(max_slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"KV cache full: all {self.max_slots} slots are in use")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0
        self._free.append(slot)

    def truncate(self, slot: int, length: int) -> None:
        """Roll a sequence back to `length` valid positions (drops rejected draft tokens)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self.lengths[slot]} to {length}")
        self.lengths[slot] = length

    def fork(self, slot: int, length: int) -> int:
        """A new slot holding the first `length` positions of `slot` (SSD drafts after a likely outcome
        from a copy of the sequence's prefix)."""
        new = self.allocate()
        self.k[:, new, :, :length] = self.k[:, slot, :, :length]
        self.v[:, new, :, :length] = self.v[:, slot, :, :length]
        self.lengths[new] = length
        return new

    def keep_path(self, slot: int, start: int, fed: list[int]) -> None:
        """After a token tree was fed from position `start` (K/V in feed order): keep the fed tokens
        at feed indices `fed` (an accepted path, ascending), moved to positions start, start + 1, ..."""
        if fed != list(range(len(fed))):  # an accepted chain prefix is in place already
            src = torch.tensor(fed, device=self.k.device) + start
            self.k[:, slot, :, start : start + len(fed)] = self.k[:, slot, :, src]
            self.v[:, slot, :, start : start + len(fed)] = self.v[:, slot, :, src]
        self.lengths[slot] = start + len(fed)
