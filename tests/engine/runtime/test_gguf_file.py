"""engine/runtime/gguf_file.py reads what gguf-py's GGUFReader reads (every value type, every array item type,
tensors of element and block types, GGUF v2 and v3, a custom alignment, the real 1.5B Qwen file's header), and
refuses each kind of malformed file with a ModelFileError naming the file and the key or tensor at fault."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf import GGUFValueType as V
from gguf.constants import GGML_QUANT_SIZES

from specpool.engine.runtime.gguf_file import GGUFFile
from specpool.engine.runtime.hf_config import ModelFileError

SCALARS = {  # key -> (value, type): each type at an edge of its range
    "test.u8": (255, V.UINT8), "test.i8": (-128, V.INT8), "test.u16": (65535, V.UINT16),
    "test.i16": (-32768, V.INT16), "test.u32": (2**32 - 1, V.UINT32), "test.i32": (-(2**31), V.INT32),
    "test.f32": (0.1, V.FLOAT32), "test.bool": (True, V.BOOL), "test.string": ("héllo ☃", V.STRING),
    "test.u64": (2**64 - 1, V.UINT64), "test.i64": (-(2**63), V.INT64), "test.f64": (-1e300, V.FLOAT64),
}
ARRAYS = {  # key -> (items, item type)
    "test.array.u8": ([0, 7, 255], V.UINT8), "test.array.i8": ([-128, 127], V.INT8),
    "test.array.u16": ([1, 65535], V.UINT16), "test.array.i16": ([-32768, 5], V.INT16),
    "test.array.u32": ([3, 2**32 - 1], V.UINT32), "test.array.i32": ([-1, 2**31 - 1], V.INT32),
    "test.array.f32": ([0.5, -0.1, 3e38], V.FLOAT32), "test.array.bool": ([True, False, True], V.BOOL),
    "test.array.string": (["a", "", "ü ☃ <0x0A>"], V.STRING), "test.array.u64": ([2**64 - 1, 0], V.UINT64),
    "test.array.i64": ([-(2**63), 9], V.INT64), "test.array.f64": ([1e-300, 2.5], V.FLOAT64),
    "test.array.nested": ([[1, 2], [3, 4, 5]], V.ARRAY),  # inner items INT32 (the writer's type for an int)
}


def _blocks(kind: Q, rows: int, blocks: int) -> np.ndarray:
    """Random bytes: `rows` rows of `blocks` blocks of `kind` (the writer takes their shape from the bytes)."""
    nbytes = GGML_QUANT_SIZES[kind][1]
    return np.random.default_rng(int(kind)).integers(0, 256, (rows, blocks * nbytes), dtype=np.uint8)


rng = np.random.default_rng(0)
TENSORS = [  # (name, data, the type blocks are of): names found nowhere else in the file
    ("blk.f32", rng.standard_normal((3, 64), dtype=np.float32), None),
    ("blk.f32.4d", rng.standard_normal((2, 3, 4, 5), dtype=np.float32), None),
    ("blk.f16", rng.standard_normal(40).astype(np.float16), None),
    ("blk.f64", rng.standard_normal((2, 3)), None),
    ("blk.i8", np.arange(-10, 10, dtype=np.int8).reshape(4, 5), None),
    ("blk.i16", np.arange(20, dtype=np.int16), None),
    ("blk.i32", np.arange(20, dtype=np.int32).reshape(2, 10), None),
    ("blk.i64", np.arange(6, dtype=np.int64), None),
    ("blk.bf16", _blocks(Q.BF16, 4, 64), Q.BF16),
    ("blk.q4_0", _blocks(Q.Q4_0, 3, 2), Q.Q4_0),
    ("blk.q8_0", _blocks(Q.Q8_0, 2, 3), Q.Q8_0),
    ("blk.q4_k", _blocks(Q.Q4_K, 2, 1), Q.Q4_K),
    ("blk.q6_k", _blocks(Q.Q6_K, 2, 2), Q.Q6_K),
    ("blk.iq2_xxs", _blocks(Q.IQ2_XXS, 1, 1), Q.IQ2_XXS),
]


def write_file(path: Path, alignment: int | None = None) -> Path:
    writer = GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (value, kind) in SCALARS.items():
        writer.add_key_value(key, value, kind)
    for key, (items, kind) in ARRAYS.items():
        writer.add_key_value(key, items, V.ARRAY, sub_type=kind)
    for name, data, kind in TENSORS:
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _flat(value):
    """A value as GGUFReader's contents() gives it: arrays of arrays flattened."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list) and value and not isinstance(value[0], str):
        return [x for item in value for x in _flat(item)]
    return value


def assert_agrees(path: Path, whole_tensors: bool = True) -> GGUFFile:
    """GGUFFile.read(path) has GGUFReader's keys, values and value types, tensors (name, type, shape, where,
    bytes) and data offset; `whole_tensors` False compares each tensor's first and last rows only."""
    ref, ours = GGUFReader(path), GGUFFile.read(path)
    assert ours.version == ref.fields["GGUF.version"].contents()
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # GGUFReader lists the counts as fields too
    assert list(ours.fields) == keys
    for key in keys:
        field, value = ref.fields[key], ours.fields[key]
        assert ours.types[key] == tuple(field.types), key
        assert _flat(value) == field.contents(), key
        if not isinstance(value, (np.ndarray, list)):  # Python's own int, float, bool, str
            assert type(value) is type(field.contents()), key
    assert (ours.alignment, ours.data_offset) == (ref.alignment, ref.data_offset)
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert (mine.type, mine.shape, mine.offset, mine.n_bytes) == \
            (t.tensor_type, tuple(reversed(t.shape.tolist())), t.data_offset, t.n_bytes), t.name
        assert (mine.data.dtype, mine.data.shape) == (t.data.dtype, t.data.shape), t.name
        assert not mine.data.flags.writeable, t.name
        if whole_tensors:
            assert mine.data.tobytes() == t.data.tobytes(), t.name
        else:
            assert mine.data[:1].tobytes() == t.data[:1].tobytes() and mine.data[-1:].tobytes() == t.data[-1:].tobytes()
    return ours


def test_every_value_and_tensor_type_reads_as_gguf_py_reads_it(tmp_path):
    ours = assert_agrees(write_file(tmp_path / "all.gguf"))
    assert ours.fields["test.string"] == "héllo ☃" and ours.fields["test.u64"] == 2**64 - 1
    assert ours.fields["test.array.nested"][1].tolist() == [3, 4, 5]
    assert ours.tensors["blk.q4_k"].data.shape == (2, 144) and ours.tensors["blk.f32"].shape == (3, 64)
    for name, data, kind in TENSORS:
        if kind is None:  # element types: the values written
            assert np.array_equal(ours.tensors[name].data, data), name


def test_a_version_2_file_and_a_custom_alignment_read_as_gguf_py_reads_them(tmp_path):
    path = write_file(tmp_path / "v2.gguf", alignment=256)
    raw = bytearray(path.read_bytes())
    raw[4:8] = struct.pack("<I", 2)  # v2's layout is v3's (v3 added big-endian files)
    path.write_bytes(raw)
    ours = assert_agrees(path)
    assert ours.version == 2 and ours.alignment == 256 and ours.data_offset % 256 == 0


@pytest.mark.slow
def test_the_real_1_5b_header_reads_as_gguf_py_reads_it():
    """151,936 tokens and ~151k merges, 339 tensors (GGUFReader takes ~8 s over them)."""
    from specpool.engine.runtime.chunked_models import ModelNotAssembled, model_path

    try:
        path = Path(model_path("qwen2.5-coder-1.5b"))
    except ModelNotAssembled as e:
        pytest.skip(str(e))
    ours = assert_agrees(path, whole_tensors=False)
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 151936 and len(ours.tensors) == 339


# -- malformed files ---------------------------------------------------------------------------------------


def _after(raw: bytearray, name: str) -> int:
    """The byte after the one place `name` (a key or tensor name) is written."""
    at = raw.index(name.encode())
    assert raw.find(name.encode(), at + 1) == -1, name
    return at + len(name)


def _put(raw: bytearray, at: int, fmt: str, value) -> None:
    raw[at : at + struct.calcsize(fmt)] = struct.pack(fmt, value)


def _tensor_info(raw: bytearray, name: str) -> tuple[int, int]:
    """(where the tensor's type is, where its data offset is) in its info."""
    n_dims = struct.unpack_from("<I", raw, _after(raw, name))[0]
    at = _after(raw, name) + 4 + 8 * n_dims
    return at, at + 4


HEADER = "GGUF header"
# why -> (an edit of the intact file's bytes, given its GGUFFile: the new bytes, or None for an edit in place;
# the field the error names; what it says)
MALFORMED = {
    "bad magic": (lambda r, f: r.__setitem__(slice(0, 4), b"GGML"), HEADER, "magic b'GGML', not b'GGUF'"),
    "version 1": (lambda r, f: _put(r, 4, "<I", 1), HEADER, "version 1 is not supported (supported: 2, 3)"),
    "big-endian": (lambda r, f: _put(r, 4, ">I", 3), HEADER, "version 0x03000000: a big-endian file, not supported"),
    "cut in the counts": (lambda r, f: r[:20], HEADER, "the key count runs past the end of the file"),
    "cut in a key's name": (lambda r, f: r[: _after(r, "test.u16") - 2], HEADER, "the name of key 4 of 26 runs past"),
    "cut in a value": (lambda r, f: r[: _after(r, "test.f64") + 6], "test.f64", "the value runs past the end"),
    "cut in a string array": (lambda r, f: r[: _after(r, "test.array.string") + 25], "test.array.string",
                              "the array of 3 strings runs past the end"),
    "cut in a tensor info": (lambda r, f: r[: _after(r, "blk.q8_0") + 9], "blk.q8_0", "the shape runs past the end"),
    "string past the end": (lambda r, f: _put(r, _after(r, "test.string") + 4, "<Q", 2**40), "test.string",
                            f"the string runs past the end of the file ({2**40} bytes at byte"),
    "array past the end": (lambda r, f: _put(r, _after(r, "test.array.u32") + 8, "<Q", 2**40), "test.array.u32",
                           f"the array of {2**40} UINT32 runs past the end"),
    "array of strings past the end": (lambda r, f: _put(r, _after(r, "test.array.string") + 8, "<Q", 2**40),
                                      "test.array.string", f"the array of {2**40} strings runs past the end"),
    "string in an array past the end": (lambda r, f: _put(r, _after(r, "test.array.string") + 16, "<Q", 2**40),
                                        "test.array.string", "string [0] of 3 runs past the end"),
    "tensor data past the end": (lambda r, f: r[: f.tensors["blk.iq2_xxs"].offset + 30], "blk.iq2_xxs",
                                 "IQ2_XXS [1, 256] data (bytes"),
    "tensor offset past the end": (lambda r, f: _put(r, _tensor_info(r, "blk.i16")[1], "<Q", 2**40), "blk.i16",
                                   "runs past the end of the file"),
    "unknown value type": (lambda r, f: _put(r, _after(r, "test.u8"), "<I", 13), "test.u8", "unknown value type 13"),
    "unknown array item type": (lambda r, f: _put(r, _after(r, "test.array.i8") + 4, "<I", 99), "test.array.i8",
                                "unknown array item type 99"),
    "unknown tensor type": (lambda r, f: _put(r, _tensor_info(r, "blk.q4_0")[0], "<I", 99), "blk.q4_0",
                            "unknown tensor type 99"),
    "too many dimensions": (lambda r, f: _put(r, _after(r, "blk.f32.4d"), "<I", 5), "blk.f32.4d", "5 dimensions"),
    "rows not whole blocks": (lambda r, f: _put(r, _after(r, "blk.q4_0") + 4, "<Q", 48), "blk.q4_0",
                              "rows of 48 weights are not whole Q4_0 blocks of 32"),
    "not UTF-8": (lambda r, f: r.__setitem__(_after(r, "test.string") + 12, 0xFF), "test.string", "not UTF-8"),
    "a key twice": (lambda r, f: r.__setitem__(slice(_after(r, "test.i16") - 3, _after(r, "test.i16")), b"u16"),
                    "test.u16", "a second value for this key"),
    "a tensor twice": (lambda r, f: r.__setitem__(slice(_after(r, "blk.i16") - 3, _after(r, "blk.i16")), b"i32"),
                       "blk.i32", "a second tensor of this name"),
    "empty": (lambda r, f: r[:0], HEADER, "the file is empty"),
}


@pytest.mark.parametrize("why", list(MALFORMED))
def test_a_malformed_file_is_refused_naming_the_file_and_the_key_or_tensor(tmp_path, why):
    intact = write_file(tmp_path / "intact.gguf")
    raw = bytearray(intact.read_bytes())
    edit, field, says = MALFORMED[why]
    edited = edit(raw, GGUFFile.read(intact))
    path = tmp_path / "bad.gguf"
    path.write_bytes(raw if edited is None else edited)
    with pytest.raises(ModelFileError) as error:
        GGUFFile.read(path)
    assert (error.value.path, error.value.field) == (path, field), str(error.value)
    assert str(error.value).startswith(f"{path}: {field}: ") and says in str(error.value), str(error.value)


def test_a_power_of_two_alignment_in_a_uint32_only(tmp_path):
    path = write_file(tmp_path / "bad.gguf", alignment=64)
    raw = bytearray(path.read_bytes())
    _put(raw, _after(raw, "general.alignment") + 4, "<I", 48)
    path.write_bytes(raw)
    with pytest.raises(ModelFileError, match="bad.gguf: general.alignment: 48 of type UINT32: must be a power of two"):
        GGUFFile.read(path)


def test_arrays_nested_more_than_8_deep_are_refused(tmp_path):
    """A bound on the recursion, so that a crafted file fails as a ModelFileError."""

    def nested(levels: int) -> Path:
        value = [1]
        for _ in range(levels - 1):
            value = [value]
        writer = GGUFWriter(str(tmp_path / f"deep{levels}.gguf"), "llama")
        writer.add_key_value("test.deep", value, V.ARRAY)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        return tmp_path / f"deep{levels}.gguf"

    assert assert_agrees(nested(8)).types["test.deep"] == (V.ARRAY,) * 8 + (V.INT32,)
    with pytest.raises(ModelFileError, match="deep9.gguf: test.deep: arrays nested more than 8 deep"):
        GGUFFile.read(nested(9))


def test_tensor_views_are_of_the_memory_map_the_loader_releases(tmp_path):
    """gguf_loader.release_file_pages finds the np.memmap under a tensor's data and drops the pages a read
    touched: how a model's load keeps the file's pages from staying resident beside its repacked copy."""
    from specpool.engine.runtime.gguf_loader import release_file_pages

    def resident_file_kb() -> int:
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssFile:"))

    writer = GGUFWriter(str(tmp_path / "big.gguf"), "llama")
    writer.add_tensor("big", np.ones((1024, 4096), np.float32))  # 16 MB
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = np.asarray(GGUFFile.read(tmp_path / "big.gguf").tensors["big"].data)
    before = resident_file_kb()
    assert data.sum() == data.size
    touched = resident_file_kb()
    release_file_pages(data)
    assert touched - before > 12_000 and touched - resident_file_kb() > 12_000, (before, touched)
