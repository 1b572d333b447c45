"""The repacking of a GGUF's blocks into the engine's kernel layouts, in torch: the reference csrc/repack.cpp is
tested against (tests/engine/runtime/test_kernels.py), and the readable statement of each layout beside the
header comment of engine/runtime/csrc/cpu_kernels.cpp. It was the engine's own repacking until the C++ one
replaced it (5.4 s and several times each matrix in temporaries for a 1.5B Q4_K_M file)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from specpool.engine.runtime.gguf_loader import QuantizedBlocks
from specpool.engine.runtime.linear import BlockLinear


def reference_repack(blocks: QuantizedBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qs, d, m) of BlockLinear(blocks), computed from QuantizedBlocks.fields()."""
    layout = BlockLinear.FORMATS[blocks.kind]
    out_features, in_features = blocks.shape
    # The kernel's layout (engine/runtime/csrc/cpu_kernels.cpp): one output per 32-bit lane, `lanes` outputs a block.
    lanes, offset_8bit = torch.ops.specpool.block_layout()
    pad = -out_features % lanes
    fields = [F.pad(f, (0, 0, 0, pad)) for f in blocks.fields()]  # zero rows: weights 0
    blocks_out, groups = (out_features + pad) // lanes, in_features // QuantizedBlocks.BLOCK

    def by_lane(v: torch.Tensor) -> torch.Tensor:  # [out, n] -> [out / lanes, n, lanes]
        return v.view(blocks_out, lanes, -1).transpose(1, 2)

    def half(v: torch.Tensor) -> torch.Tensor:  # fp32 -> fp16, which must hold it exactly
        h = v.half()
        if not torch.equal(h.float(), v):  # the file's fp16 values, or -8 times them: always exact
            raise ValueError("block scales that fp16 does not hold exactly")
        return h

    def nibbles(q: torch.Tensor) -> torch.Tensor:  # [blocks, groups, 4 vectors, lanes, 4]: w_2L low, w_2L+1 high
        t = q.view(blocks_out, lanes, groups, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
        return (t[:, :, :, 0] | (t[:, :, :, 1] << 4)).reshape(blocks_out, groups, 16 * lanes)

    def five_bits(q: torch.Tensor) -> torch.Tensor:  # q 0..31: the low nibbles, then a 32-bit word a lane whose
        high = (q >> 4).view(blocks_out, lanes, groups, 8, 4).permute(0, 2, 1, 4, 3)  # byte b holds at bit j
        word = sum(high[..., j] << j for j in range(8))  # element 4j + b's fifth bit: [.., lanes, b]
        return torch.cat([nibbles(q & 0x0F), word.reshape(blocks_out, groups, 4 * lanes)], -1).contiguous()

    if layout == BlockLinear.Q4:
        d, *rest, q = fields
        m = rest[0] if blocks.kind == GGMLQuantizationType.Q4_1 else -8 * d
        qs = nibbles(q).contiguous()
        d_out, m_out = (half(by_lane(v)).contiguous() for v in (d, m))
    elif layout == BlockLinear.Q5:  # Q5_0: d [blocks, groups, lanes]; its q - 16 back to 0..31
        d, q = fields
        qs = five_bits((q.to(torch.int16) + 16).to(torch.uint8))
        d_out, m_out = half(by_lane(d)).contiguous(), torch.zeros(0, dtype=torch.float16)
    elif layout == BlockLinear.Q8:  # [blocks, groups, 8 vectors, lanes, 4 elements]
        d, q = fields
        packed = q.view(blocks_out, lanes, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(blocks_out, groups, -1)
        if offset_8bit:  # unsigned q + 128, undone in the kernel by -128 d (exact)
            qs = (packed.to(torch.int16) + 128).to(torch.uint8).contiguous()
        else:
            qs = packed.contiguous().view(torch.uint8)
        d_out, m_out = half(by_lane(d)).contiguous(), torch.zeros(0, dtype=torch.float16)
    elif layout in (BlockLinear.Q4K, BlockLinear.Q5K):  # d [blocks, supers, (d, dmin), lanes]; m [.., groups, (sc, mn), lanes]
        d, dmin, sc, mn, q = fields
        qs = nibbles(q).contiguous() if layout == BlockLinear.Q4K else five_bits(q)
        d_out = half(torch.stack([by_lane(d), by_lane(dmin)], 2)).contiguous()
        m_out = torch.stack([by_lane(sc), by_lane(mn)], 2).contiguous()
    else:  # Q6_K: the low nibbles as 4-bit weights, then the high 2 bits four to a byte; d [blocks, supers, lanes]
        d, sc, q = fields
        high = (q >> 4).view(blocks_out, lanes, groups, 2, 4, 4).permute(0, 2, 3, 1, 5, 4)  # [.., h, lanes, b, t]
        high = high[..., 0] | (high[..., 1] << 2) | (high[..., 2] << 4) | (high[..., 3] << 6)
        qs = torch.cat([nibbles(q & 0x0F), high.reshape(blocks_out, groups, 8 * lanes)], -1).contiguous()
        d_out = half(by_lane(d)).contiguous()
        m_out = sc.view(blocks_out, lanes, groups, 2).permute(0, 2, 3, 1).contiguous()  # [blocks, groups, 2, lanes]

    return qs, d_out, m_out
