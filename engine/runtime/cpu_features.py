"""Which x86 instruction sets this CPU really executes: each one run once in a child process.

CPUID and XCR0 lie in VMs. An Intel Xeon VM here advertised AMX (cpuid flags, XCR0 bits 17-18), granted
`arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)`, and then died with SIGILL at the first `tileloadd`
(llama.cpp's native build, issue 48). So a feature counts only after a child process has executed one of
its instructions and exited cleanly; a fault kills the child, never the caller. The instructions are a
few bytes of machine code copied into an executable page and called through ctypes: no compiler needed.

Results are cached per process and handed to child processes in SPECPOOL_CPU_FEATURES, so a server that
a launcher starts does not probe again. engine/runtime/device.py and process_env.py make the choices
that follow (kernel ISA, oneDNN's and ATen's ceilings, native bf16); bench/llamacpp_build.py builds the
llama.cpp peer for what passes here. Torch-free: process_env reads it before torch loads.

    python -m specpool.engine.runtime.cpu_features     # what this machine advertises and what runs
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys

CACHE_ENV = "SPECPOOL_CPU_FEATURES"  # "name=1,name=0,...": this machine's probes, inherited by children
PROBE_TIMEOUT_S = 20

# Each probe: the /proc/cpuinfo flags that advertise it, and machine code (System V x86-64) ending in
# `vzeroupper; ret` or `ret`. AMX's takes (rdi = 64-byte tile config, rsi = a 1 KiB buffer).
_VZEROUPPER_RET = b"\xc5\xf8\x77\xc3"
PROBES: dict[str, tuple[tuple[str, ...], bytes]] = {
    "avx2": (("avx2", "fma"), b"\xc4\xe2\x75\xb8\xc2" + _VZEROUPPER_RET),  # vfmadd231ps ymm0, ymm1, ymm2
    "avx512": (("avx512f", "avx512bw", "avx512vl"),
               b"\x62\xf1\x75\x48\xfe\xc2" + _VZEROUPPER_RET),  # vpaddd zmm0, zmm1, zmm2
    "avx512_vnni": (("avx512_vnni",), b"\x62\xf2\x75\x48\x50\xc2" + _VZEROUPPER_RET),  # vpdpbusd zmm0, zmm1, zmm2
    "avx512_bf16": (("avx512_bf16",), b"\x62\xf2\x76\x48\x52\xc2" + _VZEROUPPER_RET),  # vdpbf16ps zmm0, zmm1, zmm2
    "avx_vnni": (("avx_vnni",), b"\xc4\xe2\x75\x50\xc2" + _VZEROUPPER_RET),  # {vex} vpdpbusd ymm0, ymm1, ymm2
    "amx": (("amx_tile", "amx_int8", "amx_bf16"),
            (b"\xc4\xe2\x78\x49\x07"  # ldtilecfg [rdi]
            b"\x48\xc7\xc0\x40\x00\x00\x00"  # mov rax, 64
            b"\xc4\xe2\x7b\x4b\x04\x06"  # tileloadd tmm0, [rsi + rax]
            b"\xc4\xe2\x78\x49\xc0"  # tilerelease
            b"\xc3")),  # ret
}
# Linux keeps AMX's tile data off until a process asks (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158


def advertised_flags() -> set[str]:
    """The CPU's own claims (/proc/cpuinfo flags): what is worth probing, never proof."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:  # not Linux
        return set()


def _execute(name: str, code: bytes) -> None:
    """Runs probe `name`'s instructions `code` in this process (a child's): returns, or dies by a signal."""
    import ctypes
    import mmap

    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    if name == "amx":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
            sys.exit(3)  # the kernel refuses the tile state: no AMX, and nothing faulted
        config = (ctypes.c_uint8 * 64)()
        config[0] = 1  # palette 1; tile 0: 16 rows of 64 bytes
        config[16], config[48] = 64, 16
        tile = (ctypes.c_uint8 * 1024)()
        ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(address)(ctypes.addressof(config),
                                                                          ctypes.addressof(tile))
    else:
        ctypes.CFUNCTYPE(None)(address)()


def _run_probes(probes: dict[str, bytes]) -> dict[str, bool]:
    """Each probe (name -> its code) in a child of its own, all at once (a fault ends only that child)."""
    children = {name: subprocess.Popen([sys.executable, "-S", "-c", _CHILD, name, code.hex()],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                       env={"PATH": os.environ.get("PATH", "")})
                for name, code in probes.items()}
    results = {}
    for name, child in children.items():
        try:
            results[name] = child.wait(timeout=PROBE_TIMEOUT_S) == 0
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            results[name] = False
    return results


# The child imports this file by path (not the package: -S and a bare environment keep it fast and inert).
_CHILD = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("cpu_features", {__file__!r})
module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
module._execute(sys.argv[1], bytes.fromhex(sys.argv[2]))
"""


@functools.cache
def executes() -> dict[str, bool]:
    """Probe name -> whether this CPU ran it: advertised and executed in a child without a fault.
    Not advertised is False without a probe; a non-x86 machine is False throughout."""
    inherited = _parse(os.environ.get(CACHE_ENV, ""))
    if inherited is not None:
        return inherited
    if not is_x86():
        results = dict.fromkeys(PROBES, False)
    else:
        flags = advertised_flags()
        claimed = {name: code for name, (needs, code) in PROBES.items() if all(flag in flags for flag in needs)}
        results = dict.fromkeys(PROBES, False) | _run_probes(claimed)
    os.environ[CACHE_ENV] = ",".join(f"{name}={int(ok)}" for name, ok in results.items())
    return results


def _parse(value: str) -> dict[str, bool] | None:
    """SPECPOOL_CPU_FEATURES as a parent wrote it; None where absent or not for this probe set."""
    try:
        pairs = dict(item.split("=") for item in value.split(",")) if value else {}
    except ValueError:
        return None
    if set(pairs) != set(PROBES) or not set(pairs.values()) <= {"0", "1"}:
        return None
    return {name: pairs[name] == "1" for name in PROBES}


def is_x86() -> bool:
    """Whether these probes apply: they are x86-64 machine code."""
    return platform.machine().lower() in ("x86_64", "amd64")


def runs(name: str) -> bool:
    return executes()[name]


def lying() -> list[str]:
    """The probes this CPU advertises but faulted on: what the log line of a fallback names."""
    flags = advertised_flags()
    return [name for name, (needs, _) in PROBES.items() if all(f in flags for f in needs) and not runs(name)]


if __name__ == "__main__":
    flags = advertised_flags()
    for name, (needs, _) in PROBES.items():
        claimed = all(flag in flags for flag in needs)
        print(f"{name:12} advertised {'yes' if claimed else 'no ':3}  executes {'yes' if runs(name) else 'no'}")
