"""The engine's own CPU kernels (engine/runtime/csrc/cpu_kernels.cpp via engine/runtime/kernels.py): each against a
float64 reference written from its definition, each row's result independent of the rows beside it (bit
for bit), and the eager paths on a machine where the kernels cannot be built."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from specpool.engine.runtime import kernels
from specpool.engine.runtime.device import kernel_amx, kernel_isa
from specpool.engine.runtime.gguf_loader import QuantizedBlocks
from specpool.engine.runtime.linear import BlockLinear
from tests.engine.runtime.repack_reference import reference_repack

Q4_0, Q4_1, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
Q5_0, Q4_K, Q6_K = GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K
Q5_K = GGMLQuantizationType.Q5_K
FILE_FORMATS = [Q5_0, Q4_K, Q5_K, Q6_K]



@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.available(), "the engine's CPU kernels did not build: run `make setup` (needs a C++ compiler)"


def test_the_loaded_build_is_the_class_device_py_names():
    lanes, offset_8bit = torch.ops.specpool.block_layout()
    assert (lanes, offset_8bit) == ((16, True) if kernel_isa() == "avx512vnni" else (8, False)), kernel_isa()


def _blocks(kind, rows: int, cols: int, seed: int = 0) -> QuantizedBlocks:
    """Blocks as gguf quantizes a random matrix, or, for the K-quants (gguf-py quantizes neither), random
    bytes with small positive fp16 super-block scales: every 6-bit scale, offset and q is then valid."""
    rng = np.random.default_rng(seed)
    if kind in (Q4_K, Q5_K, Q6_K):
        size, scales = {Q4_K: (144, (0, 2)), Q5_K: (176, (0, 2)), Q6_K: (210, (208,))}[kind]
        raw = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
        for at in scales:
            raw[:, at : at + 2] = rng.uniform(2e-4, 2e-3, (len(raw), 1)).astype(np.float16).view(np.uint8)
        return QuantizedBlocks(kind, (rows, cols), raw.reshape(rows, -1))
    w = rng.normal(0, 0.05, (rows, cols)).astype(np.float32)
    return QuantizedBlocks(kind, (rows, cols), quantize(w, kind))


def reference_block_product(x: torch.Tensor, blocks: QuantizedBlocks) -> torch.Tensor:
    """x's rows quantized per group of 32 to int8 (scale max|x| / 127, round half to even), times the
    file's weights, in float64."""
    g = x.double().view(x.shape[0], -1, 32)
    scale = g.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(g / torch.where(scale > 0, scale, 1)), 0)
    return (q * scale).view(x.shape) @ blocks.dequantize().double().T


@pytest.mark.parametrize("kind", [Q4_0, Q4_1, Q8_0])
@pytest.mark.parametrize("cols", [576, 1536, 96])  # 18, 48 and 3 groups
def test_block_linear_is_the_quantized_product(kind, cols):
    blocks = _blocks(kind, 48, cols, seed=cols)
    lin = BlockLinear(blocks, prefill=None)
    torch.manual_seed(0)
    x = torch.randn(11, cols) * 3
    x[3] = 0  # an all-zero row: scale 0, output 0
    got, want = lin(x).double(), reference_block_product(x, blocks)
    assert got.dtype == torch.float64 and torch.equal(got[3], torch.zeros(48, dtype=torch.float64))
    assert ((got - want).abs() <= 2e-6 * want.abs().max()).all(), float((got - want).abs().max())


@pytest.mark.parametrize("kind", FILE_FORMATS)
@pytest.mark.parametrize("cols", [256, 1536])  # 1 and 6 super-blocks
def test_the_file_formats_kernels_are_the_quantized_product(kind, cols):
    """Q5_0 (5 bits a weight, as in the file) and the K-quants on their own: the file's weights exactly
    (gguf's dequantization), times the rows quantized as above."""
    blocks = _blocks(kind, 40, cols, seed=cols)  # 40: a ragged last lane too
    lin = BlockLinear(blocks)
    torch.manual_seed(0)
    x = torch.randn(11, cols) * 3
    x[3] = 0
    got, want = lin(x).double(), reference_block_product(x, blocks)
    assert torch.equal(got[3], torch.zeros(40, dtype=torch.float64))
    assert ((got - want).abs() <= 2e-6 * want.abs().max()).all(), float((got - want).abs().max())


@pytest.mark.parametrize("kind", FILE_FORMATS)
def test_the_file_formats_fields_are_gguf_s_weights(kind):
    blocks = _blocks(kind, 16, 512)
    fields = blocks.fields()
    if kind == Q5_0:
        d, q = fields
        assert int(q.min()) >= -16 and int(q.max()) <= 15
        w = d.repeat_interleave(32, 1) * q
    elif kind in (Q4_K, Q5_K):
        d, dmin, sc, mn, q = fields
        assert int(q.max()) == (15 if kind == Q4_K else 31)
        w = d.repeat_interleave(256, 1) * sc.repeat_interleave(32, 1) * q - dmin.repeat_interleave(256, 1) * mn.repeat_interleave(32, 1)
    else:
        d, sc, q = fields
        assert int(q.max()) <= 63
        w = d.repeat_interleave(256, 1) * sc.repeat_interleave(16, 1) * (q.float() - 32)
    assert torch.equal(w.float(), blocks.dequantize())


@pytest.mark.parametrize("kind", [Q4_0, Q4_1, Q8_0, *FILE_FORMATS])
def test_the_repacking_writes_each_layout_as_the_torch_reference_does(kind):
    """csrc/repack.cpp, from the file's bytes, against the layouts written in torch from the blocks' fields
    (tests/engine/runtime/repack_reference.py), the padding of a ragged last lane included."""
    blocks = _blocks(kind, 40, 512)
    lin = BlockLinear(blocks)
    for got, want in zip((lin.qs, lin.d, lin.m), reference_repack(blocks)):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("kind", FILE_FORMATS)
def test_the_file_formats_rows_do_not_depend_on_their_neighbours(kind):
    lin = BlockLinear(_blocks(kind, 48, 512))
    x, norm = torch.randn(19, 512), torch.rand(512) + 0.5
    alone = torch.cat([lin(x[i : i + 1], norm, 1e-5) for i in range(19)])
    for rows in range(1, 20):
        assert torch.equal(lin(x[:rows], norm, 1e-5), alone[:rows]), rows
    gate_up = torch.randn(19, 1024)  # the MLP's down product: silu(gate) * up fused before it
    alone = torch.cat([lin(gate_up[i : i + 1], silu_mul=True) for i in range(19)])
    assert torch.equal(lin(gate_up, silu_mul=True), alone)


def test_amx_runs_exactly_where_device_py_allows_it():
    """Row tiles of kernels.AMX_MIN_ROWS rows run on AMX's tiles where kernel_amx() says so (the AVX-512 VNNI
    build on a CPU that has executed a tile load), and nowhere else: the AVX2 and portable builds never do."""
    before = torch.ops.specpool.amx_tiles()
    BlockLinear(_blocks(Q4_K, 32, 256))(torch.randn(kernels.AMX_MIN_ROWS, 256))
    assert (torch.ops.specpool.amx_tiles() > before) == kernel_amx(), kernel_isa()


@pytest.mark.skipif(not kernel_amx(), reason="AMX does not execute here, or this is not the AVX-512 VNNI build")
@pytest.mark.parametrize("kind", [Q4_0, Q4_1, Q8_0, *FILE_FORMATS])
def test_amx_row_tiles_give_the_bits_of_the_1_row_vector_path(kind):
    """Every row tile from 2 rows up on AMX (Q6_K's from 12): rows 1-19, with the fused norm,
    silu_mul and residual, each row's outputs are those of the row alone on the vector path, bit for bit."""
    lin = BlockLinear(_blocks(kind, 48, 512))
    x, norm, residual = torch.randn(19, 512) * 2, torch.rand(512) + 0.5, torch.randn(19, 48)
    gate_up = torch.randn(19, 1024)
    down = BlockLinear(_blocks(kind, 48, 512))
    torch.ops.specpool.set_amx_rows(0)
    try:
        alone = torch.cat([lin(x[i : i + 1], norm, 1e-5) for i in range(19)])
        alone_res = torch.cat([lin(x[i : i + 1], residual=residual[i : i + 1]) for i in range(19)])
        alone_silu = torch.cat([down(gate_up[i : i + 1], silu_mul=True) for i in range(19)])
        assert torch.ops.specpool.set_amx_rows(2)
        before = torch.ops.specpool.amx_tiles()
        for rows in range(1, 20):
            assert torch.equal(lin(x[:rows], norm, 1e-5), alone[:rows]), rows
            assert torch.equal(lin(x[:rows], residual=residual[:rows]), alone_res[:rows]), rows
            assert torch.equal(down(gate_up[:rows], silu_mul=True), alone_silu[:rows]), rows
        assert torch.ops.specpool.amx_tiles() > before
    finally:
        torch.ops.specpool.set_amx_rows(kernels.AMX_MIN_ROWS)


def test_block_linear_fuses_the_layers_rms_norm():
    blocks = _blocks(Q4_1, 32, 576)
    lin = BlockLinear(blocks, prefill=None)
    torch.manual_seed(3)
    x, norm = torch.randn(5, 576) * 4, 1 + 0.1 * torch.randn(576)
    normed = F.rms_norm(x.double(), (576,), norm.double(), 1e-5).float()
    got, want = lin(x, norm, 1e-5).double(), reference_block_product(normed, blocks)
    assert ((got - want).abs() <= 1e-4 * want.abs().max()).all(), float((got - want).abs().max())


def test_block_linear_rows_do_not_depend_on_their_neighbours():
    """Every row count from 1 to 19 (tiles of 8 or 4 rows and their remainders): a row's outputs are the
    bits it gets alone."""
    lin = BlockLinear(_blocks(Q4_1, 64, 576), prefill=None)
    x = torch.randn(19, 576)
    norm = torch.rand(576) + 0.5
    alone = torch.cat([lin(x[i : i + 1]) for i in range(19)])
    normed = torch.cat([lin(x[i : i + 1], norm, 1e-5) for i in range(19)])
    for rows in range(1, 20):
        assert torch.equal(lin(x[:rows]), alone[:rows]), rows
        assert torch.equal(lin(x[:rows], norm, 1e-5), normed[:rows]), rows
    head = BlockLinear(_blocks(Q8_0, 32, 576), prefill=None)
    assert torch.equal(head(x), torch.cat([head(x[i : i + 1]) for i in range(19)]))


@pytest.mark.parametrize("kind", [Q4_1, Q8_0])
def test_a_ragged_last_lane_gives_the_bits_of_those_rows_in_a_wider_matrix(kind):
    """Outputs come in lanes of 8 or 16; a matrix with fewer in its last lane (a draft head's reduced
    vocabulary may have any size) is padded with zero weights: its outputs are those rows' of a matrix that needs
    no padding, bit for bit, with a residual too."""
    blocks = _blocks(kind, 32, 576)
    ragged_blocks = QuantizedBlocks(kind, (21, 576), blocks.data[:21])
    assert BlockLinear.supports(ragged_blocks)
    ragged, wide = BlockLinear(ragged_blocks, prefill=None), BlockLinear(blocks, prefill=None)
    x, norm, residual = torch.randn(5, 576), torch.rand(576) + 0.5, torch.randn(5, 32)
    assert ragged(x).shape == (5, 21)
    assert torch.equal(ragged(x), wide(x)[:, :21])
    assert torch.equal(ragged(x, norm, 1e-5), wide(x, norm, 1e-5)[:, :21])
    assert torch.equal(ragged(x, residual=residual[:, :21]), wide(x, residual=residual)[:, :21])


def test_block_linear_refuses_bad_shapes():
    assert not BlockLinear.supports(QuantizedBlocks(GGMLQuantizationType.Q3_K, (16, 256), np.zeros((16, 110))))
    assert not BlockLinear.supports(QuantizedBlocks(Q4_K, (16, 288), np.zeros((16, 162))))  # not whole super-blocks
    lin = BlockLinear(_blocks(Q4_1, 16, 64), prefill=None)
    with pytest.raises(RuntimeError, match="64"):
        lin(torch.randn(2, 96))
    with pytest.raises(RuntimeError, match="rows of 64 weights are 40 bytes, not 36"):  # a row cut short
        torch.ops.specpool.repack_blocks(torch.zeros(16, 36, dtype=torch.uint8), int(Q4_1), 64, 16, True)
    with pytest.raises(RuntimeError, match="no kernel layout for ggml type 10"):  # Q2_K
        torch.ops.specpool.repack_blocks(torch.zeros(16, 84, dtype=torch.uint8), 10, 256, 16, True)


def reference_attention(q, k, v, slot, prefix, extra):
    """float64, from the definition: softmax(q . k / sqrt(D)) v over each query's visible keys."""
    N, H, D = q.shape
    group = H // k.shape[1]
    out = torch.zeros(N, H, D, dtype=torch.float64)
    for n in range(N):
        keys = list(range(int(prefix[n]))) + [int(e) for e in extra[n] if e >= 0]
        if not keys:
            continue
        kk = k[slot[n], :, keys].double().repeat_interleave(group, 0)  # [H, n_keys, D]
        vv = v[slot[n], :, keys].double().repeat_interleave(group, 0)
        scores = (q[n].double()[:, None] @ kk.transpose(-1, -2))[:, 0] / D**0.5
        out[n] = (scores.softmax(-1)[:, None] @ vv)[:, 0]
    return out


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_visible_attention_against_the_definition_and_alone(two_threads):
    """On 2 threads six queries run one task per key-value head (its 3 heads together) and a query alone
    one task per head: the two ways give the same bits."""
    torch.manual_seed(1)
    q, k, v = torch.randn(6, 9, 64), torch.randn(4, 3, 50, 64), torch.randn(4, 3, 50, 64)
    slot = torch.tensor([0, 1, 1, 2, 3, 3])
    prefix = torch.tensor([10, 1, 50, 17, 0, 0])
    extra = torch.tensor([[-1, -1], [-1, -1], [-1, -1], [20, 22], [5, 3], [-1, -1]])
    got = torch.ops.specpool.visible_attention(q, k, v, slot, prefix, extra)
    want = reference_attention(q, k, v, slot, prefix, extra)
    assert (got.double() - want).abs().max() < 1e-5
    assert torch.equal(got[5], torch.zeros(9, 64))  # no visible key: zeros
    for n in range(6):  # alone, and beside a column of padding (-1: no key)
        for extra_n in (extra[n : n + 1], torch.cat([extra[n : n + 1], torch.tensor([[-1]])], 1)):
            one = torch.ops.specpool.visible_attention(q[n : n + 1], k, v, slot[n : n + 1], prefix[n : n + 1], extra_n)
            assert torch.equal(one[0], got[n]), n


def test_a_tree_path_sees_the_same_keys_as_its_chain():
    """Keys at other cache positions but in the same order give the same bits: a tree node's ancestors
    (written in feed order after the prefix) against the same tokens decoded as a chain."""
    torch.manual_seed(2)
    k, v = torch.randn(2, 3, 40, 64), torch.randn(2, 3, 40, 64)
    chain = list(range(12)) + [30, 33, 35]  # the path's three nodes sit at 30, 33 and 35 in slot 1
    k[0, :, :15], v[0, :, :15] = k[1, :, chain], v[1, :, chain]
    q = torch.randn(1, 9, 64)
    as_chain = torch.ops.specpool.visible_attention(q, k, v, torch.tensor([0]), torch.tensor([15]),
                                                    torch.empty(1, 0, dtype=torch.long))
    as_tree = torch.ops.specpool.visible_attention(q, k, v, torch.tensor([1]), torch.tensor([12]),
                                                   torch.tensor([[30, 33, 35]]))
    assert torch.equal(as_chain, as_tree)


def test_visible_attention_validates_its_indices():
    q, k = torch.randn(1, 9, 64), torch.randn(2, 3, 8, 64)
    with pytest.raises(RuntimeError, match="slot or prefix out of range"):
        torch.ops.specpool.visible_attention(q, k, k, torch.tensor([2]), torch.tensor([1]), torch.empty(1, 0).long())
    with pytest.raises(RuntimeError, match="extra position out of range"):
        torch.ops.specpool.visible_attention(q, k, k, torch.tensor([0]), torch.tensor([1]), torch.tensor([[8]]))


NO_COMPILER = """
import specpool, json, logging, sys
logging.basicConfig(level=logging.WARNING)
from specpool.engine.runtime import kernels
from specpool.engine.runtime.device import kernel_isa
from specpool.engine.runtime.device import resolve_format
from specpool.engine.runtime.device import draft_format, native_bf16
fmt = resolve_format("q4", "cpu")
drafts = draft_format("auto", "cpu") == ("bf16" if native_bf16("cpu") else "fp32", None)
print(json.dumps({"available": kernels.available(), "own_kernels": fmt.own_kernels, "int4": fmt.int4,
                  "dense_drafts": drafts}))
"""


def test_without_a_compiler_the_eager_paths_run_after_one_log_line(tmp_path):
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "SPECPOOL_KERNEL_CACHE": str(tmp_path / "k")}
    out = subprocess.run([sys.executable, "-c", NO_COMPILER], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"available": False, "own_kernels": False, "int4": True,
                                                             "dense_drafts": True}
    warnings = [line for line in out.stderr.splitlines() if "could not be built" in line]
    assert len(warnings) == 1, out.stderr


def test_cache_attention_ropes_writes_and_attends():
    """The fused layer op: q and k rotated as adjacent pairs, k and v written where asked, then attention
    over the visible keys (the new ones included)."""
    torch.manual_seed(4)
    H, Hkv, D, N = 9, 3, 64, 3
    qkv = torch.randn(N, (H + 2 * Hkv) * D)
    angles = torch.rand(N, D // 2) * 6
    cos, sin = angles.cos(), angles.sin()
    k, v = torch.randn(2, Hkv, 16, D), torch.randn(2, Hkv, 16, D)
    k_before, v_before = k.clone(), v.clone()
    write_slot, write_pos = torch.tensor([1, 1, 0]), torch.tensor([5, 6, 15])
    slot, prefix, extra = write_slot, torch.tensor([6, 7, 16]), torch.empty(N, 0, dtype=torch.long)
    out = torch.ops.specpool.cache_attention(qkv, cos, sin, k, v, write_slot, write_pos, slot, prefix, extra)

    def rotate(x):  # [N, heads, D]: (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos) per adjacent pair
        x0, x1 = x[..., 0::2], x[..., 1::2]
        c, s = cos[:, None], sin[:, None]
        return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).flatten(-2)

    heads = qkv.view(N, H + 2 * Hkv, D)
    q, k_new, v_new = rotate(heads[:, :H]), rotate(heads[:, H : H + Hkv]), heads[:, H + Hkv :]
    k_before[write_slot, :, write_pos], v_before[write_slot, :, write_pos] = k_new, v_new
    assert torch.allclose(k, k_before, atol=1e-6) and torch.equal(v, v_before)
    want = reference_attention(q, k_before, v_before, slot, prefix, extra)
    assert out.shape == (N, H * D) and (out.double() - want.view(N, H * D)).abs().max() < 1e-5
    with pytest.raises(RuntimeError, match="writes outside the cache"):
        torch.ops.specpool.cache_attention(qkv, cos, sin, k, v, torch.tensor([0, 0, 2]), write_pos, slot, prefix, extra)


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_the_other_classes_builds_pass_these_tests(isa):
    """The AVX2 build (8 lanes, signed 8-bit weights) and the portable C++ one (a CPU without AVX2), each
    run through this file's tests in a fresh process (but the AMX bits test: those builds never run AMX)."""
    env = {**os.environ, "SPECPOOL_KERNEL_ISA": isa}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "not other_classes and not without_a_compiler and not amx_row_tiles"], env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-3000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-500:]


@pytest.mark.parametrize("kind", FILE_FORMATS)
def test_an_embedding_on_blocks_looks_up_the_file_s_rows(kind):
    from specpool.engine.runtime.linear import BlockEmbedding, StackedBlockLinear

    blocks = _blocks(kind, 50, 512)
    ids = torch.tensor([[3, 7, 49], [0, 3, 3]])
    assert torch.equal(F.embedding(ids, BlockEmbedding(blocks)), F.embedding(ids, blocks.dequantize()))
    other = _blocks(Q4_K if kind != Q4_K else Q6_K, 16, 512)  # a stack of two formats: each part's own bits
    stacked, x = StackedBlockLinear([BlockLinear(blocks), BlockLinear(other)]), torch.randn(3, 512)
    assert torch.equal(stacked(x), torch.cat([BlockLinear(blocks)(x), BlockLinear(other)(x)], -1))
