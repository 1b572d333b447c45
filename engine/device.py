"""The one place that chooses device, weight dtype and torch.distributed backend (and keeps
CPU thread pools from multiplying).

The dtype rule: bf16 only where the device computes it natively (CUDA GPUs that support it; CPUs
whose oneDNN build reports bf16 support, i.e. AVX-512 BF16/AMX or AVX-NE-CONVERT), else fp32. On
an AVX2-only CPU oneDNN refuses to prepack bf16 weights and a plain bf16 matmul is ~60x slower
than fp32 (1536x576 by one row: 8.7 vs 0.14 ms on an AMD EPYC), so asking for bf16 there gets
fp32 and one log line. No other module names a dtype for CPU models.

SPECPOOL_NO_NATIVE_BF16=1 makes a machine with native bf16 behave like one without, so the
fallback path is tested on any machine (engine/process_env.py: set before torch loads, it also
limits oneDNN and ATen to AVX2 kernels).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from specpool.engine.process_env import NO_NATIVE_BF16, bf16_override

T = TypeVar("T")
log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def native_bf16(device: torch.device | str) -> bool:
    """Whether bf16 matmuls run natively (at least as fast as fp32) on this device."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu" or bf16_override():
        return False
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def cpu_class() -> dict:
    """What the CPU kernels this process runs are: the facts every figure and cached cost table is keyed by."""
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": native_bf16("cpu"),
        "bf16_override": bf16_override(),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL"),
    }


@functools.cache
def _log_fallback(device_type: str) -> None:
    why = f"{NO_NATIVE_BF16} is set" if bf16_override() else (
        f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native bf16" if device_type == "cpu"
        else "this GPU does not support bf16")
    log.warning("bf16 requested but %s: using fp32 weights instead (bf16 would be far slower, or fail)", why)


def resolve_dtype(name: str | torch.dtype | None, device: torch.device | str) -> torch.dtype:
    """The weight dtype a model loads with on `device`.

    `None`/"auto": bf16 on a GPU that computes it natively; fp32 on CPU, where greedy output must
    match the fp32 oracle. "bf16" (or torch.bfloat16): bf16 where native, else fp32 with one log
    line. "fp32": fp32.
    """
    device = torch.device(device)
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" and native_bf16(device) else torch.float32
    if isinstance(name, torch.dtype):
        dtype = name
    elif name in DTYPES:
        dtype = DTYPES[name]
    else:
        raise ValueError(f"dtype must be one of fp32, bf16, auto; got {name!r}")
    if dtype == torch.bfloat16 and not native_bf16(device):
        _log_fallback(device.type)
        return torch.float32
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be fp32 or bf16; got {dtype}")
    return dtype


def distributed_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def off_main_thread(fn: Callable[[], T]) -> T:
    """fn() on a thread that exits when it returns; its result, or its exception re-raised.

    OpenMP keeps a pool of worker threads per thread that ran a parallel region, for as long as
    that thread lives. A server that loaded its model on the main thread and decoded on another
    kept two pools, and AR decoding on the second thread measured ~20% slower than with the
    model loaded on a thread that had exited. Servers do their heavy setup here so that the
    decode thread's pool is the only one.
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="setup") as pool:
        return pool.submit(fn).result()
