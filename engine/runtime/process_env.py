"""Process settings that torch reads once, when it loads: applied by the `specpool` package before
anything imports torch. Torch-free, so importing it loads nothing. engine/runtime/device.py makes every
other device choice.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

from specpool.engine.runtime import cpu_features

log = logging.getLogger(__name__)
NO_NATIVE_BF16 = "SPECPOOL_NO_NATIVE_BF16"

# libgomp's default spin (300k rounds) keeps an idle process's OpenMP threads busy long after their
# last op, eating the turn of the other server on the same cores (a target verifying while its
# endpoint idles, and back): sd-remote ran at 76-78% of in-process sd with the default or
# OMP_WAIT_POLICY=PASSIVE (which sleeps between every two ops of a forward), 96-100% with a short
# spin (HumanEval 4, K=2). Measured on one CPU class only (2 cores of an AMD EPYC with AVX-512 and
# native bf16); benchmarks record the value they ran with.
GOMP_SPINCOUNT = "10000"


def bf16_override() -> bool:
    """True when SPECPOOL_NO_NATIVE_BF16 asks this machine to act as one without native bf16."""
    return os.environ.get(NO_NATIVE_BF16, "").strip().lower() not in ("", "0", "false", "no")


def apply() -> None:
    """Set what torch reads at load time; an operator's own settings win.

    Under SPECPOOL_NO_NATIVE_BF16, oneDNN and ATen are limited to AVX2 kernels: on an AVX-512
    machine that reproduces an AVX2 machine's behaviour (oneDNN then refuses bf16 prepacking, as
    there) and its step costs. Where the CPU advertises an instruction set it faults on (CPUID lies
    in VMs), they are limited to what executed in a child process (engine/runtime/cpu_features.py),
    with one log line. It takes effect only if torch has not loaded yet.
    """
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    if bf16_override():
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    elif lying := _advertised_but_faulting():
        onednn, aten = isa_ceilings(cpu_features.runs)
        log.warning("this CPU advertises %s but faults on executing it: torch is kept to oneDNN %s, ATen %s",
                    " and ".join(lying), onednn, aten or "as detected")
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)
        if aten:
            os.environ.setdefault("ATEN_CPU_CAPABILITY", aten)


def _advertised_but_faulting() -> list[str]:
    """The instruction sets this CPU advertises (so torch would pick them from CPUID) and faults on. Probed
    only where AVX-512 or AMX is advertised, the ones VMs have been seen to grant and then fault on."""
    if not cpu_features.advertised_flags() & {"amx_tile", "avx512f"}:
        return []
    return cpu_features.lying()


def isa_ceilings(runs) -> tuple[str, str | None]:
    """(ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY or None for no ceiling): the highest instruction sets whose
    probes `runs` (engine/runtime/cpu_features.py) passed, each level needing the ones below it."""
    if not runs("avx2"):
        return "SSE41", "default"
    if not runs("avx512"):
        return ("AVX2_VNNI" if runs("avx_vnni") else "AVX2"), "avx2"
    if not runs("avx512_vnni"):
        return "AVX512_CORE", None
    if not runs("avx512_bf16"):
        return "AVX512_CORE_VNNI", None
    return ("ALL" if runs("amx") else "AVX512_CORE_BF16"), None


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def release_freed_heap() -> None:
    """Hand the heap's free pages back to the system after a load's temporaries are gone. glibc keeps them
    mapped: after a 151,936-token vocabulary's tokenizer was built, 80 MB of freed memory stayed resident,
    and so counted in the model load's peak. Only glibc has malloc_trim: elsewhere nothing."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
