"""Builds the llama.cpp peer (llama-cpp-python, from PyPI's source) for the instruction sets this CPU
really executes, never for what it advertises.

llama.cpp's default build is `-march=native`: on an Intel Xeon VM that advertises AMX, that build died
with SIGILL in its AMX matmul (issue 48). Here every x86 extension is named explicitly (GGML_NATIVE off)
from engine/runtime/cpu_features.py's probes, and AMX is never built in: on that very VM a child process
executes a tile load cleanly (the probe passes, and torch's oneDNN runs its bf16 matmuls on AMX), yet
llama.cpp's AMX path still dies at `tilezero %tmm4`. ggml loads the tile configuration once per thread
and relies on it persisting across calls. One way it does not: in a process that also runs torch (the
bench's, the tests'), a oneDNN AMX matmul in between releases it, and the next tile instruction faults
(reproduced with the two in one process). llama.cpp also died in a process where oneDNN ran nothing, so
that is not the whole cause, and no probe of this CPU can promise ggml's assumption: the peer runs
AVX-512 VNNI where it would have run AMX (ggml's own single-row path is AVX-512 VNNI either way). The wheel is cached per set of flags
(~/.cache/specpool/llamacpp/<key>/), so a machine of another class builds its own (about 5 minutes on
2 cores, once) and switching back reinstalls in seconds. BUILD_RECORD, beside the installed package,
says which build runs; the bench records it with every llama.cpp figure.

llama.cpp's own draft-model speculation (the bench's llamacpp-sd) is its `llama-speculative-simple` example,
which the wheel does not ship: `speculative_binary()` builds it from the llama.cpp vendored in the same pinned
sdist, with the same ISA flags (static, one file), cached under ~/.cache/specpool/llamacpp/<key>/bin.

    python -m specpool.bench.llamacpp_build     # install the build for this machine (no-op when current)
    python -m specpool.bench.llamacpp_build --speculative   # and build llama-speculative-simple
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from specpool.engine.runtime import cpu_features
from specpool.engine.runtime.process_env import bf16_override

PIN = "llama-cpp-python==0.3.36"
# Only the library: its tools, examples and servers are not the peer.
BASE_FLAGS = ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
              "-DLLAMA_BUILD_SERVER=OFF", "-DMTMD_BUILD=OFF", "-DLLAVA_BUILD=OFF", "-DGGML_NATIVE=OFF"]
# Where llama.cpp keeps AMX: the instructions a build without it must not contain.
AMX_INSTRUCTIONS = ("tileloadd", "tdpbssd", "ldtilecfg")


# llama-speculative-simple: the example alone, linked statically (one file to cache), without HTTPS.
SPECULATIVE_TARGET = "llama-speculative-simple"
SPECULATIVE_FLAGS = ["-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_APP=OFF",
                     "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF", "-DCMAKE_BUILD_TYPE=Release"]


def cache_root() -> Path:
    return Path(os.environ.get("SPECPOOL_LLAMACPP_CACHE", Path.home() / ".cache" / "specpool" / "llamacpp"))


def record_path() -> Path:
    return Path(sys.prefix) / "llamacpp-build.json"


def isa_flags(runs: Callable[[str], bool], avx2_class: bool = False) -> dict[str, bool]:
    """ggml's x86 options from the probes `runs` passed. `avx2_class`: SPECPOOL_NO_NATIVE_BF16's emulation
    of an AVX2-only machine, whose peer gets no AVX-512 either."""
    avx2 = runs("avx2")
    avx512 = avx2 and runs("avx512") and not avx2_class
    return {
        "GGML_AVX": avx2, "GGML_AVX2": avx2, "GGML_FMA": avx2, "GGML_F16C": avx2, "GGML_BMI2": avx2,
        "GGML_AVX_VNNI": avx2 and runs("avx_vnni") and not avx2_class,
        "GGML_AVX512": avx512,
        "GGML_AVX512_VNNI": avx512 and runs("avx512_vnni"),
        "GGML_AVX512_BF16": avx512 and runs("avx512_bf16"),
        "GGML_AMX_TILE": False, "GGML_AMX_INT8": False, "GGML_AMX_BF16": False,  # never: see the module docstring
    }


def planned() -> dict:
    """The build this machine gets: pin, CMake flags, and the key its wheel is cached under."""
    isa = isa_flags(cpu_features.runs, avx2_class=bf16_override())
    flags = BASE_FLAGS + [f"-D{name}={'ON' if on else 'OFF'}" for name, on in isa.items()]
    key = hashlib.sha256("|".join([PIN, *flags]).encode()).hexdigest()[:12]
    return {"pin": PIN, "cmake_args": flags, "key": key, "amx": isa["GGML_AMX_TILE"],
            "isa": sorted(name.removeprefix("GGML_").lower() for name, on in isa.items() if on)}


def installed() -> dict | None:
    """The build record of the installed peer, or None where none was installed by this module."""
    try:
        return json.loads(record_path().read_text())
    except (OSError, ValueError):
        return None


def library_files() -> list[Path]:
    """The installed peer's shared libraries (llama_cpp/lib/*.so)."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return []
    return sorted(Path(spec.origin).parent.glob("lib/*.so*"))


def ensure() -> dict:
    """Installs the peer built for this machine unless it is already in place; its build record."""
    plan = planned()
    if (current := installed()) and current.get("key") == plan["key"] and library_files():
        return current
    directory = cache_root() / plan["key"]
    wheel = next(directory.glob("llama_cpp_python-*.whl"), None)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    if wheel is None:
        print(f"building {PIN} for {', '.join(plan['isa']) or 'no x86 extensions'} (about 5 minutes on 2 cores, "
              f"once per machine class)", flush=True)
        started = time.perf_counter()
        env = os.environ | {"CMAKE_ARGS": " ".join(plan["cmake_args"]),
                            "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
        # pip's own wheel cache is keyed by the source alone: a build for another class would come back.
        subprocess.run([*pip, "wheel", "--no-deps", "--no-cache-dir", "--no-binary", "llama-cpp-python",
                        "-w", str(directory), PIN], env=env, check=True)
        wheel = next(directory.glob("llama_cpp_python-*.whl"))
        print(f"built in {time.perf_counter() - started:.0f} s: {wheel}", flush=True)
    subprocess.run([*pip, "install", str(wheel)], check=True)  # with its dependencies (numpy, diskcache, jinja2)
    subprocess.run([*pip, "install", "--no-deps", "--force-reinstall", str(wheel)], check=True)  # this build
    record_path().write_text(json.dumps(plan, indent=1) + "\n")
    return plan


def sdist() -> Path:
    """The pinned source archive, downloaded from PyPI once (its vendor/llama.cpp is what the wheel builds)."""
    directory = cache_root() / "sdist"
    name, version = PIN.split("==")
    archive = directory / f"{name.replace('-', '_')}-{version}.tar.gz"
    if not archive.exists():
        directory.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "download", "--no-deps",
                        "--no-binary", ":all:", "-d", str(directory), PIN], check=True)
        if not archive.exists():
            raise FileNotFoundError(f"pip downloaded {PIN} but {archive} is not there: see {directory}")
    return archive


def speculative_plan() -> dict:
    """The llama-speculative-simple build this machine gets: the wheel's ISA flags, examples on, static."""
    wheel = planned()
    flags = [f for f in wheel["cmake_args"] if not f.startswith("-DLLAMA_BUILD_EXAMPLES=")] + SPECULATIVE_FLAGS
    key = hashlib.sha256("|".join([PIN, SPECULATIVE_TARGET, *flags]).encode()).hexdigest()[:12]
    return wheel | {"cmake_args": flags, "key": key, "target": SPECULATIVE_TARGET}


def amx_instructions(binary: Path) -> set[str]:
    """The AMX instructions objdump finds in `binary` (a build without AMX must show none)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        raise FileNotFoundError("objdump (Debian's binutils) is needed to check a llama.cpp build for AMX")
    listing = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(binary)], capture_output=True, text=True,
                             timeout=600, check=True).stdout
    return {op for op in AMX_INSTRUCTIONS if f"\t{op} " in listing}


def speculative_binary() -> Path:
    """llama.cpp's `llama-speculative-simple` for this machine, built from the pinned sdist on first use (about
    4 minutes on 2 cores) and cached per set of flags; the build is refused if it holds an AMX instruction."""
    plan = speculative_plan()
    directory = cache_root() / plan["key"] / "bin"
    binary = directory / SPECULATIVE_TARGET
    if binary.exists():
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise FileNotFoundError(f"building {SPECULATIVE_TARGET} needs {tool}: install cmake and a C++ compiler")
    archive = sdist()
    say = lambda text: print(f"[{SPECULATIVE_TARGET}] {text}", file=sys.stderr, flush=True)
    say(f"building from {archive.name} for {', '.join(plan['isa']) or 'no x86 extensions'} (about 4 minutes on "
        f"2 cores, once per machine class)")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="llamacpp-spec-") as work:
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
            tar.extractall(work, members=members, filter="data")
        source = next(Path(work).glob("*/vendor/llama.cpp"))
        build = Path(work) / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        jobs = str(os.cpu_count() or 1)
        say("configuring")
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), *generator, *plan["cmake_args"]],
                       check=True, stdout=subprocess.DEVNULL)
        say(f"compiling on {jobs} jobs")
        subprocess.run(["cmake", "--build", str(build), "--target", SPECULATIVE_TARGET, "-j", jobs],
                       check=True, stdout=subprocess.DEVNULL)
        built = build / "bin" / SPECULATIVE_TARGET
        if found := amx_instructions(built):  # see the module docstring: AMX must not be in any peer
            raise RuntimeError(f"{built} holds AMX instructions {sorted(found)} despite {plan['cmake_args']}")
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f".{SPECULATIVE_TARGET}.partial"
        shutil.copy2(built, partial)
        partial.rename(binary)  # whole or absent: an interrupted copy is never taken for a build
    (directory / "build.json").write_text(json.dumps(plan, indent=1) + "\n")
    say(f"built in {time.perf_counter() - started:.0f} s: {binary}")
    return binary


if __name__ == "__main__":
    build = ensure()
    print(f"llama.cpp peer: {build['pin']}, {', '.join(build['isa'])}, AMX {'on' if build['amx'] else 'off'}")
    if "--speculative" in sys.argv[1:]:
        print(f"llama.cpp speculative: {speculative_binary()}")
