"""Where one forward step's tokens go and what each of them sees (engine/runtime/model.py `Llama.forward`):
positions, the cache writes, the attention mask or the fused kernels' visible keys, worked out once a step
and read by every layer; and the attention over the cache that each layer's block is handed.

Row b feeds its tokens to the sequence in slots[b], whose cached length gives its start position. Rows are
right-padded to a common width; padded positions write their K/V into a scratch slot, so they never touch
a live sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specpool.engine.runtime.config import ModelConfig
from specpool.engine.runtime.kv_cache import KVCache
from specpool.engine.verification.token_tree import attention_layout, is_chain, padded

SHORT_STEP = 16  # batched decode/verify steps (at most this many tokens per row) use short_attention


def check_rows(cache: KVCache, slots: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
    """Raises ValueError where a row feeds no token or more than its cache holds."""
    for s, row in zip(slots, tokens):
        if len(row) == 0:
            raise ValueError(f"slot {s}: a row needs at least one token")
        if cache.lengths[s] + len(row) > cache.max_len:
            raise ValueError(f"slot {s}: {cache.lengths[s] + len(row)} positions exceed the cache length {cache.max_len}")


@dataclass(frozen=True, slots=True)
class StepLayout:
    slots: list[int]
    starts: list[int]  # each row's cached length before the step
    counts: list[int]  # each row's fed tokens
    ids: torch.Tensor  # [B, T] the fed tokens, rows right-padded
    pos: torch.Tensor  # [B, T] the positions RoPE sees (a tree node's: its depth past the prefix)
    write_slot: torch.Tensor  # [B, T] where each fed token's K/V go: its slot, or the scratch slot for padding
    write_pos: torch.Tensor  # [B, T]
    kv_len: int  # the cache positions a step's attention reads
    mask: torch.Tensor | None  # [B, 1, T, kv_len] additive; None: plain causal prefill or one position a row
    causal_prefill: bool
    attention_dtype: torch.dtype
    # The fused kernels' (write_slot, write_pos, slot, prefix, extra), [B*T, ...]: see `_fused_keys`.
    visible_keys: tuple[torch.Tensor, ...] | None
    contiguous: bool  # slots are consecutive: the cache's rows are read as one view
    slot_index: torch.Tensor  # [B] the slots, where they are not
    block_write: bool  # rows of one length fed from one position: their K/V are one slice of the cache

    @classmethod
    def of(cls, config: ModelConfig, cache: KVCache, slots: Sequence[int], tokens: Sequence[Sequence[int]],
           parents: Sequence[Sequence[int]] | None, attention_dtype: torch.dtype, fused: bool,
           device: torch.device) -> StepLayout:
        """`parents`: each row's token tree, or None (`Llama.forward`); `fused`: whether the fused kernels run
        the layers."""
        B, slots = len(slots), list(slots)
        counts = [len(t) for t in tokens]
        T = max(counts)
        starts = [cache.lengths[s] for s in slots]
        offsets = torch.arange(T)
        pos = torch.tensor(starts)[:, None] + offsets  # [B, T]: where each fed token's K/V go
        real = offsets[None, :] < torch.tensor(counts)[:, None]  # [B, T]
        write_slot = torch.where(real, torch.tensor(slots)[:, None], cache.scratch_slot)
        write_pos = torch.where(real, pos, offsets[None, :])
        kv_len = max(st + T for st in starts) if B > 1 else starts[0] + T
        kv_len = min(kv_len, cache.max_len)
        tree = parents is not None and not all(is_chain(p) for p in parents)
        if tree:
            base, pos, visible, key_pos = _tree_layout(config, parents, starts, counts, kv_len)
        ids, pos, write_slot, write_pos = (t.to(device, non_blocking=True)
                                           for t in (padded(tokens, T), pos, write_slot, write_pos))

        # Rows may start at different positions: an additive mask says which cached keys each query
        # sees. A lone prefill from position 0 is plain causal attention and needs none.
        # A sliding window hides the oldest keys once a step reaches past it: every query then needs a mask.
        windowed = config.windowed and kv_len > config.sliding_window
        causal_prefill = B == 1 and starts[0] == 0 and T > SHORT_STEP and not tree and not windowed
        mask = visible_keys = None
        if not fused and (tree or windowed or not causal_prefill and not (T == 1 and len(set(starts)) == 1)):
            if not tree:
                key_pos = torch.arange(kv_len, device=device)[None, None, :]
                visible = key_pos <= pos[:, :, None]  # [B, T, L]
            visible = visible.to(device)
            if windowed:
                visible &= key_pos.to(device) > pos[:, :, None] - config.sliding_window
            mask = torch.zeros(visible.shape, dtype=attention_dtype, device=device).masked_fill_(~visible, float("-inf"))
            mask = mask[:, None]  # [B, 1, T, L]
        if fused:
            visible_keys = _fused_keys(slots, real, pos, write_slot, write_pos, kv_len, device,
                                       (base, visible) if tree else None)
        contiguous = slots == list(range(slots[0], slots[0] + B))
        # Rows of one length fed from one position write their K/V as one block of the cache (a slice
        # copy); ragged rows scatter theirs (write_slot, write_pos).
        block_write = contiguous and len(set(starts)) == 1 and len(set(counts)) == 1
        return cls(slots, starts, counts, ids, pos, write_slot, write_pos, kv_len, mask, causal_prefill,
                   attention_dtype, visible_keys, contiguous, torch.tensor(slots, device=device), block_write)

    def attend(self, cache: KVCache, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Layer li's attention (engine/runtime/layer.py `Attention`): writes the step's K/V into the cache, then
        each query attends over its row's cached keys, in `attention_dtype`."""
        B, T = self.ids.shape
        slots, start = self.slots, self.starts[0]
        q = q.to(self.attention_dtype)
        if self.block_write:
            cache.k[li, slots[0] : slots[0] + B, :, start : start + T] = k.transpose(1, 2)
            cache.v[li, slots[0] : slots[0] + B, :, start : start + T] = v.transpose(1, 2)
        else:
            cache.k[li][self.write_slot, :, self.write_pos] = k.to(cache.k.dtype)
            cache.v[li][self.write_slot, :, self.write_pos] = v.to(cache.v.dtype)
        if self.contiguous:
            keys = cache.k[li, slots[0] : slots[0] + B, :, : self.kv_len]  # [B, Hkv, L, D] view
            values = cache.v[li, slots[0] : slots[0] + B, :, : self.kv_len]
        else:
            keys = cache.k[li, self.slot_index, :, : self.kv_len]
            values = cache.v[li, self.slot_index, :, : self.kv_len]
        keys, values = keys.to(self.attention_dtype), values.to(self.attention_dtype)
        if T <= SHORT_STEP and B > 1:
            return short_attention(q, keys, values, self.mask)
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=self.mask, is_causal=self.causal_prefill, enable_gqa=True
        ).transpose(1, 2)


def _tree_layout(config: ModelConfig, parents: Sequence[Sequence[int]], starts: list[int], counts: list[int],
                 kv_len: int):
    """A token-tree step's (base [B, 1]: each tree's first cache position, pos [B, T], visible [B, T, L],
    key_pos [B, 1, L]: each key's position, or None where no window needs it). A node sees the prefix and its
    ancestors; a key's position is its cache index before the tree, past it by its node's depth."""
    B, T = len(parents), max(counts)
    offsets = torch.arange(T)
    sizes = [len(p) for p in parents]
    if any(n < c or st + c < n for n, c, st in zip(sizes, counts, starts)):
        raise ValueError("a row's tree must end with its fed tokens and start within its cache")
    n = max(sizes)
    depth, anc = attention_layout(parents, n)  # [B, n], [B, n, n]
    base = torch.tensor([st + c - size for st, c, size in zip(starts, counts, sizes)])[:, None]  # [B, 1]
    node = (torch.tensor(sizes)[:, None] - torch.tensor(counts)[:, None] + offsets).clamp(max=n - 1)  # [B, T]
    rel = torch.arange(kv_len)[None, None, :] - base[:, :, None]  # [B, 1, L]: tree index of a key
    anc = anc.gather(1, node[:, :, None].expand(B, T, n))  # [B, T, n]: the fed nodes' rows
    in_tree = anc.gather(-1, rel.clamp(0, n - 1).expand(B, T, kv_len))
    visible = (rel < 0) | ((rel < n) & in_tree)  # [B, T, L]
    key_pos = None
    if config.windowed:
        key_node = rel.clamp(0, n - 1)[:, 0]  # [B, L]
        key_pos = torch.where(rel < 0, torch.arange(kv_len), (base + depth.gather(1, key_node))[:, None])
    return base, base + depth.gather(1, node), visible, key_pos


def _fused_keys(slots: list[int], real: torch.Tensor, pos: torch.Tensor, write_slot: torch.Tensor,
                write_pos: torch.Tensor, kv_len: int, device: torch.device,
                tree: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
    """The fused layers' attention takes, per query, where its K/V go and the keys it sees: its slot, a prefix
    of positions, and a tree node's ancestors after it (in feed order, so a path's keys come in the order its
    own decoding would see them). `tree`: (base, visible) of `_tree_layout`."""
    B, T = real.shape
    slot_col = torch.tensor(slots)[:, None].expand(B, T)
    if tree is not None:
        base, visible = tree
        after = torch.arange(kv_len)[None, None, :] >= base[:, :, None]
        extra = torch.where(visible & after, torch.arange(kv_len), kv_len)  # [B, T, L], kv_len: none
        extra = extra.sort(-1).values[..., : int((visible & after).sum(-1).max())]
        extra = extra.masked_fill(extra == kv_len, -1)
        prefix = torch.where(real, base, 0)
    else:
        extra = torch.empty(B, T, 0, dtype=torch.long)
        prefix = torch.where(real, pos + 1, 0)
    return tuple(t.reshape(B * T, *t.shape[2:]).to(device) for t in (write_slot, write_pos, slot_col, prefix, extra))


def short_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None):
    """Attention for a few queries per row over the cache, grouped-query without repeating K/V.

    q [B, T, H, D], keys/values [B, Hkv, L, D], mask [B, 1, T, L] additive or None -> [B, T, H, D].
    Two batched matmuls: for small T and several rows this beats SDPA on CPU (10x at batch 32 in
    bf16); a single row is faster through SDPA.
    """
    B, T, H, D = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    G = H // Hkv
    qg = q.view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * D**-0.5  # [B, Hkv, G*T, L]
    if mask is not None:
        scores = (scores.view(B, Hkv, G, T, L) + mask[:, :, None]).view(B, Hkv, G * T, L)
    out = torch.matmul(scores.softmax(-1), values)  # [B, Hkv, G*T, D]
    return out.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H, D)
