"""Weight matrices in the fastest layout for the device they live on.

On CPU, oneDNN's prepacked weights stream at close to memory bandwidth for the small row counts
of decode and verify steps (measured on a 2-core host: the 30 layers + LM head of the 135M model
take ~29 ms fp32 / ~15 ms bf16 per step at 1 or 8 rows, vs ~52 / ~21 ms with plain F.linear),
and an 8-row verify step costs about the same as a 1-row decode step, once the weights are laid
out for several rows (PREPACK_ROWS).

A GGUF's 4-bit matrices can instead run through torch's weight-only int4 kernel on the file's own
blocks (Int4Linear): a quarter of bf16's bytes, at a cost that grows with the row count. Prefill steps
(a prompt's many rows, where that kernel is 1.5-2.5x slower than dense) run a dense twin of the same
weights instead: `.prefill` of every matrix here.
"""

from __future__ import annotations

import warnings
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from specpool.engine.runtime.gguf_loader import QuantizedBlocks

# The row count oneDNN lays the weights out for. Prepacked for 1 row, the layout is the plain one
# ("ab"), and every product of 2 or more rows ran a slower path: the 30 layers + head of the 135M
# model took 33 ms for 1 row but 49 for 2 and 61 for 9 on AVX2 (fp32, 2 cores), 39 -> 48 -> 61 ms on
# AVX-512. Prepacked for 16 rows (blocked, "AB16b64a"), 1 row costs the same or less and 2-9 rows
# little more: 29 / 30 / 43 ms on AVX2, 36 / 36 / 38 ms on AVX-512 (engine/policy/costs.py's
# T(1, K) at K = 0, 1, 8; AMD EPYC, measured side by side).
PREPACK_ROWS = 16


class Linear:
    """y = x @ weight.T, weight [out, in]."""

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype  # an input of another dtype is converted (fp32 activations, bf16 weights)
        self._onednn = weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
        if self._onednn:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PREPACK_ROWS)
        else:
            self.weight = weight.contiguous()

    @property
    def nbytes(self) -> int:
        """Bytes of weights one product reads."""
        return self.weight.numel() * self.weight.element_size()

    @property
    def prefill(self) -> Linear:
        """The matrix for prefill steps: this one."""
        return self

    def __call__(self, x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
        """x [..., in] -> [..., out]; with `norm`, of F.rms_norm(x, norm, eps) (the layer's norm before it)."""
        if norm is not None:
            x = F.rms_norm(x, (self.in_features,), norm, eps)
        x = x.to(self.dtype)
        if self._onednn:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, None, "none", [], "")
        return F.linear(x, self.weight)


class Int4Linear:
    """y = x @ weight.T with the weight in 4-bit groups of 32 along its input: torch's weight-only
    int4 CPU kernel (`_weight_int4pack_mm_for_cpu`, "tinygemm"), which computes each weight as
    w = (q - 8) * scale + zero with q in 0..15 and one (scale, zero) pair per group and output.

    Built from a GGUF's blocks, the kernel's weights are the file's, up to bf16 rounding of the
    per-group constants (fp16 in the file; the kernel reads them as bf16, relative error <= 2^-9):
      Q4_0 (w = d*(q - 8)): scale = d, zero = 0.
      Q4_1 (w = d*q + m):   scale = d, zero = m + 8d.
    Activations enter as bf16 (the kernel's fast path; with fp32 activations it runs a scalar
    loop ~20x slower), each weight is dequantized to fp32, products accumulate in fp32 along the
    input (one accumulator per output, in input order, the same for every row whatever the row
    count: a verify step's rows equal a decode step's bit for bit), and the output is rounded to bf16.

    The kernel takes rows in blocks of 4 and dequantizes the weights again for each block, so its
    cost is a step function of the row count: 1-4 rows cost about one block, 5-8 two, 9-12 three.
    For a prompt's rows that makes it slower than dense (the gate/up matrix of SmolLM2-135M, 125 rows:
    3.1 ms, vs 2.2 fp32 and 1.2 bf16 through oneDNN; AVX-512 EPYC, 2 cores), so prefill steps run
    `prefill`, the same weights dequantized and dense. Decode and verify steps never do: their rows
    must go through one kernel, so that a verify step's logits equal a decode step's bit for bit.
    """

    GROUP = 32

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, prefill: Linear):
        """q: [out, in] integers in 0..15; scale, zero: [out, in / 32]; prefill: the dense twin."""
        self.prefill = prefill
        self.out_features, self.in_features = q.shape
        self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)

    @classmethod
    def from_blocks(cls, blocks: QuantizedBlocks, prefill: Linear) -> Int4Linear:
        if blocks.kind == GGMLQuantizationType.Q4_0:
            d, q = blocks.fields()
            return cls(q, d, torch.zeros_like(d), prefill)
        if blocks.kind == GGMLQuantizationType.Q4_1:
            d, m, q = blocks.fields()
            return cls(q, d, m + 8 * d, prefill)
        raise ValueError(f"no int4 layout for {blocks.kind.name}")

    @property
    def nbytes(self) -> int:
        """Bytes of weights one decode or verify product reads: the 4-bit values and the bf16 (scale, zero)
        pairs."""
        return self.weight.nbytes + self.scales_and_zeros.nbytes

    @staticmethod
    def supports(blocks: QuantizedBlocks) -> bool:
        """Whether the kernel reads these blocks: a 4-bit format, outputs a multiple of 16."""
        return (blocks.kind in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
                and blocks.shape[0] % 16 == 0 and blocks.shape[1] % Int4Linear.GROUP == 0)

    def __call__(self, x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
        """x [..., in] in any float dtype -> [..., out] in bf16, the kernel's output: the caller's next op
        promotes it (adding it to an fp32 residual costs no separate conversion). With `norm`, of
        F.rms_norm(x, norm, eps)."""
        if norm is not None:
            x = F.rms_norm(x, (self.in_features,), norm, eps)
        rows = x.to(torch.bfloat16, memory_format=torch.contiguous_format).view(-1, self.in_features)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight, self.GROUP, self.scales_and_zeros)
        return y.view(*x.shape[:-1], self.out_features)


class BlockLinear:
    """y = x @ weight.T on the GGUF's own blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) through the engine's
    kernel (engine/runtime/csrc/cpu_kernels.cpp, `block_linear`): each row of x quantized to int8 per group of 32
    (ggml's Q8_1, as llama.cpp does), integer dot products per block, the block scales applied in fp32.

    Every weight is the file's exactly (its fp16 scales kept in fp16, widened to fp32 by the kernel as it
    loads them): Q4_0's d * (q - 8) is held as d * q + m with m = -8d (exact in fp16 too). Each row's result
    depends on that row alone, by the same instructions whatever the row count, so a verify step's rows
    equal a decode step's bit for bit; and the kernel unpacks each weight block once for up to 16 rows (8
    with AVX2), so a verify step's extra rows cost their dot products, not another pass over the weights.
    Outputs come in lanes of 8 or 16: a matrix with a ragged last lane (a draft head's reduced vocabulary)
    is padded with zero weights, whose outputs are cut off. Prefill steps run `prefill`, the dense twin.
    """

    # The kernel's layout for each block format (cpu_kernels.cpp, `Layout`): 4, 5 and 8 bits a weight with fp16
    # scales per group of 32, and the K-quants' compact per-super-block ones.
    Q4, Q5, Q8, Q4K, Q5K, Q6K = 4, 5, 8, 41, 51, 61
    FORMATS: ClassVar[dict] = {GGMLQuantizationType.Q4_0: Q4, GGMLQuantizationType.Q4_1: Q4,
                               GGMLQuantizationType.Q8_0: Q8, GGMLQuantizationType.Q5_0: Q5,
                               GGMLQuantizationType.Q4_K: Q4K, GGMLQuantizationType.Q5_K: Q5K,
                               GGMLQuantizationType.Q6_K: Q6K}

    def __init__(self, blocks: QuantizedBlocks, prefill: Linear | None = None):
        """`prefill`: a dense twin that prefill steps run; None, these blocks run them too."""
        self._prefill = prefill
        self.layout = self.FORMATS[blocks.kind]
        self.out_features, self.in_features = blocks.shape
        # The kernel's layout (engine/runtime/csrc/cpu_kernels.cpp): one output per 32-bit lane, `lanes` outputs a
        # block, the last block padded with zero weights; repacked from the file's bytes by csrc/repack.cpp.
        lanes, offset_8bit = torch.ops.specpool.block_layout()
        self.pad = -self.out_features % lanes
        with warnings.catch_warnings():  # the file's read-only map: the repacking only reads it
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            raw = torch.from_numpy(np.ascontiguousarray(blocks.rows()))
        self.qs, self.d, self.m = torch.ops.specpool.repack_blocks(raw, int(blocks.kind), self.in_features, lanes,
                                                                   offset_8bit)

    # A model whose blocks are all of these formats keeps a dense twin for prefill steps (the 135M default's,
    # 98 MB: prefilling a 200-token prompt on the blocks took 1.9x the bf16 twin's time, 217 vs 116 ms, 1
    # thread, AVX-512 with native bf16). One with other formats (a K-quant file) prefills on its blocks: a twin
    # of every matrix is what made a 1.1 GB Q4_K_M file 13.7 GB resident.
    DENSE_PREFILL: ClassVar[tuple] = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)

    @property
    def prefill(self) -> Linear | BlockLinear:
        """The matrix prefill steps run: the dense twin where there is one, else these blocks."""
        return self if self._prefill is None else self._prefill

    @classmethod
    def supports(cls, blocks: QuantizedBlocks) -> bool:
        width = QuantizedBlocks.SUPER if cls.FORMATS.get(blocks.kind) in (cls.Q4K, cls.Q5K, cls.Q6K) else QuantizedBlocks.BLOCK
        return blocks.kind in cls.FORMATS and blocks.shape[1] % width == 0

    @property
    def nbytes(self) -> int:
        """Bytes of weights one product reads: the packed values and the scales (and offsets)."""
        return self.qs.nbytes + self.d.nbytes + self.m.nbytes

    def __call__(self, x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0, silu_mul: bool = False,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] in any float dtype -> [..., out] fp32, with what the kernel fuses around the product:
        `norm` [in], RMS-normalized x (x / sqrt(mean(x^2) + eps) * norm); `silu_mul`, x [..., 2 in] taken
        as (gate, up) and multiplied as silu(gate) * up; `residual` [..., out] added to the output."""
        if self.pad and residual is not None:
            residual = F.pad(residual, (0, self.pad))
        y = torch.ops.specpool.block_linear(x.float(), self.qs, self.d, self.m, self.layout, norm, eps, silu_mul,
                                            residual)
        return y[..., : self.out_features] if self.pad else y


class StackedBlockLinear:
    """Matrices stacked along their outputs whose blocks differ in format (a Q4_K_M file's q and k in Q4_K, its v
    in Q6_K), one BlockLinear each: each part quantizes the rows itself, so a row's result is still its own."""

    def __init__(self, parts: list[BlockLinear]):
        self.parts = parts
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)

    @property
    def prefill(self) -> StackedBlockLinear:
        return self

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0, silu_mul: bool = False,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        sizes = [p.out_features for p in self.parts]
        residuals = residual.split(sizes, -1) if residual is not None else [None] * len(self.parts)
        return torch.cat([p(x, norm, eps, silu_mul, r) for p, r in zip(self.parts, residuals)], -1)


class BlockEmbedding:
    """The token embedding [V, d] on the file's blocks: `F.embedding(ids, this)` (or `this(ids)`) dequantizes only
    the rows asked for, by gguf's own dequantization (the file's weights exactly, fp32), so a large vocabulary's
    table is held at the file's size (Qwen2.5-1.5B's, Q6_K: 191 MB, vs 933 MB dense fp32)."""

    def __init__(self, blocks: QuantizedBlocks):
        # The file's bytes as given: where they are its memory map, only the pages of rows looked up stay resident
        # (a copy of Qwen2.5-1.5B's table held 191 MB more, beside the head's repacked one).
        self.blocks = blocks
        self.shape = torch.Size(blocks.shape)
        self.dtype = torch.float32

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., d] fp32."""
        flat = ids.reshape(-1).cpu().numpy()
        stored = flat if self.blocks.order is None else self.blocks.order[flat]
        rows = dequantize(self.blocks.data[stored], self.blocks.kind).reshape(len(flat), self.shape[1])
        return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).view(*ids.shape, self.shape[1])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is F.embedding and isinstance(args[1], cls):
            return args[1](args[0])
        return NotImplemented

    def float(self) -> torch.Tensor:
        """The whole table, dense fp32 (a draft model's copy of its target's embedding)."""
        return self.blocks.dequantize()
