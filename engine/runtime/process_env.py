"""Process settings that torch reads once, when it loads: applied by the `specpool` package before
anything imports torch. Torch-free, so importing it loads nothing. engine/runtime/device.py makes every
other device choice.
"""

from __future__ import annotations

import os

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
    there) and its step costs. It takes effect only if torch has not loaded yet.
    """
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    if bf16_override():
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
