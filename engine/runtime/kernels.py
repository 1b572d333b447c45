"""The engine's own CPU kernels (engine/runtime/csrc/cpu_kernels.cpp): weight-block products for the few rows of
decode and verify steps, and attention over each query's exact visible keys; and the repacking of a GGUF's blocks
into their layouts at load (csrc/repack.cpp).

They are compiled once per machine class (engine/runtime/device.py's `kernel_isa`: AVX-512 with VNNI, AVX2, or
portable C++) with the C++ compiler torch's extension builder finds, into a cache that `make setup`
fills (`python -m specpool.engine.runtime.kernels`). A process that finds no build compiles it on first use; one
where compiling fails runs the eager paths (torch's int4 kernel, float64 attention) after one log line. The
AVX-512 VNNI build also carries an AMX path, which loading turns on where device.py's `kernel_amx` allows it:
verify steps' row tiles of AMX_MIN_ROWS rows and up then take their integer sums from AMX's int8 tiles, with
the very same results, bit for bit.

    python -m specpool.engine.runtime.kernels                              # build this machine's class
    SPECPOOL_NO_NATIVE_BF16=1 python -m specpool.engine.runtime.kernels    # and the AVX2 class's
    python -m specpool.engine.runtime.kernels --isa portable               # any class, by name (one per process)
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

import torch

from specpool.engine.runtime.device import kernel_amx, kernel_isa

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("csrc") / name for name in ("cpu_kernels.cpp", "repack.cpp")]
# What each class compiles for: the instructions every machine of that class has, never -march=native,
# so a build (or a container image) moves between machines of one class.
ISA_FLAGS = {
    "avx512vnni": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "portable": [],
}


# Row tiles of at least this many rows run on AMX where kernel_amx() says it may (Q6_K's from 12: cpu_kernels.cpp).
# A tile product costs about as much as 5 rows of the vector path's dot products whatever the rows, while each
# row's float work stays: AMX's time over the vector path's, 2048x1536, 1 thread, Xeon family 6 model 207:
# Q4_K 1.14 at 5 rows, 1.0 at 6, 0.94 at 8, 0.86 at 9, 0.79 at 12; Q5_0 and Q8_0 0.96 at 6, 0.78 at 9. In a whole
# step, where the weights stream from memory, it gains less: Qwen2.5-Coder-1.5B Q4_K_M's T(1, 8), 1 thread, 157
# -> 143 ms before the kernels prefetched their weights, 106 -> 104 ms since.
AMX_MIN_ROWS = 6


def cache_dir() -> Path:
    return Path(os.environ.get("SPECPOOL_KERNEL_CACHE", Path.home() / ".cache" / "specpool" / "kernels"))


def build_name(isa: str) -> str:
    """The build of this source, these flags and this torch for `isa`: its cache entry's name, and what a
    table of measured step costs is keyed by."""
    digest = hashlib.sha256("|".join([*(s.read_text() for s in SOURCES), *_flags(isa), torch.__version__]).encode()).hexdigest()[:12]
    return f"specpool_cpu_kernels_{isa}_{digest}"


def _flags(isa: str) -> list[str]:
    return ["-O3", "-fopenmp", *ISA_FLAGS[isa]]


def build(isa: str) -> None:
    """Load the kernels compiled for `isa` into this process, compiling them first if this source, these
    flags and this torch have no build yet (the name says which: a read-only cache, as in the image, serves)."""
    flags = _flags(isa)
    name = build_name(isa)
    directory = cache_dir() / name
    library = directory / f"{name}.so"
    if library.exists():
        torch.ops.load_library(str(library))
        return
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name=name, sources=[str(s) for s in SOURCES], build_directory=str(directory), extra_cflags=flags,
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)


@functools.cache
def available() -> bool:
    """Whether torch.ops.specpool's kernels are loaded (built first if need be); False, with one log line,
    where they cannot be (no compiler, a failed build, not a CPU process)."""
    isa = kernel_isa()
    start = time.perf_counter()
    try:
        build(isa)
    except Exception as e:  # noqa: BLE001 - any build failure means the eager paths
        log.warning("the engine's CPU kernels (%s) could not be built, running the eager paths instead: %s",
                    isa, str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return False
    amx = kernel_amx() and torch.ops.specpool.set_amx_rows(AMX_MIN_ROWS)
    log.info("engine CPU kernels (%s%s) ready in %.1f s", isa, ", AMX" if amx else "", time.perf_counter() - start)
    return True


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Build the engine's CPU kernels for one instruction set class.")
    ap.add_argument("--isa", choices=sorted(ISA_FLAGS), default=kernel_isa(), help="default: this machine's")
    isa = ap.parse_args().isa
    started = time.perf_counter()
    build(isa)
    print(f"engine CPU kernels: {isa} ready in {time.perf_counter() - started:.1f} s under {cache_dir()}")
