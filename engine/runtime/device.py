"""The one place that chooses device, weight dtype and format, and torch.distributed backend (and
keeps CPU thread pools from multiplying).

The dtype rule: bf16 only where the device computes it natively (CUDA GPUs that support it; CPUs
whose oneDNN build reports bf16 support, i.e. AVX-512 BF16/AMX or AVX-NE-CONVERT), else fp32. On
an AVX2-only CPU oneDNN refuses to prepack bf16 weights and a plain bf16 matmul is ~60x slower
than fp32 (1536x576 by one row: 8.7 vs 0.14 ms on an AMD EPYC), so asking for bf16 there gets
fp32 and one log line. No other module names a dtype for CPU models.

SPECPOOL_NO_NATIVE_BF16=1 makes a machine with native bf16 behave like one without, so the
fallback path is tested on any machine (engine/runtime/process_env.py: set before torch loads, it also
limits oneDNN and ATen to AVX2 kernels).

The format rule (`resolve_format`): "q4" runs the matrices the GGUF stores in blocks (Q4_0, Q4_1, and
the Q8_0 LM head) on those very blocks. Where the engine's own CPU kernels build (engine/runtime/kernels.py:
any x86 or other CPU with a C++ compiler; `kernel_isa` picks AVX-512 VNNI, AVX2 or portable code), each
layer of a decode or verify step is five fused kernels (engine/runtime/linear.py BlockLinear, engine/runtime/model.py
`_fused_layers`): activations quantized to int8 per group of 32 as llama.cpp does, integer dot products
on the file's weights, attention in fp32 over each query's exact keys. Where they do not build, torch's
int4 kernel runs the 4-bit matrices (the file's weights up to bf16 rounding of the per-group constants)
with fp32 activations around it, vectorized for AVX2 and AVX-512 alike (a CPU without AVX2, or a GPU:
the dense rule, one log line). Other matrices stay dense (bf16 where native, else fp32).

"auto" is the fastest format that stays lossless against its own AR on this machine: q4 on CPU where the
file has 4-bit blocks and a fast kernel runs them, else bf16 on a GPU that computes it natively, else fp32.
Whether a format's rows really are the same bits in every step kind depends on this CPU's code paths, so
every CPU model is checked as it loads (engine/runtime/row_check.py) and an automatic choice that fails
takes `WeightFormat.fallback`: bf16 dense matrices to fp32, then fp32 throughout.
Not dense bf16 on CPU: its decode and verify steps round differently (see engine/runtime/model.py), so speculation
through it would not equal its own decoding. q4's logits sit within ~1-2 of fp32's (int8 or bf16
activations), so its greedy output can leave fp32's at near-ties (tests/engine/runtime/test_quantized.py), while
speculation through q4 equals q4's own decoding bit for bit (engine/runtime/model.py). fp32 stays the reference
numerics (`--dtype fp32`), whose greedy output equals transformers' reading the same GGUF token for token.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import platform
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch
from gguf import GGMLQuantizationType

from specpool.engine.runtime import cpu_features
from specpool.engine.runtime.process_env import NO_NATIVE_BF16, bf16_override

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
    # oneDNN's answer comes from CPUID: on x86 it counts only where a bf16 instruction has run (cpu_features).
    return (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            and (not cpu_features.is_x86() or cpu_features.runs("avx512_bf16") or cpu_features.runs("amx")))


def cpu_class() -> dict:
    """What the CPU kernels this process runs are: the facts every figure and cached cost table is keyed by."""
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": native_bf16("cpu"),
        "bf16_override": bf16_override(),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL"),
        "executes": sorted(name for name, ok in cpu_features.executes().items() if ok),  # probed, not advertised
        "faults_on": cpu_features.lying(),
    }


@functools.cache
def _log_fallback(device_type: str) -> None:
    why = f"{NO_NATIVE_BF16} is set" if bf16_override() else (
        f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native bf16" if device_type == "cpu"
        else "this GPU does not support bf16")
    log.warning("bf16 requested but %s: using fp32 weights instead (bf16 would be far slower, or fail)", why)


def resolve_dtype(name: str | torch.dtype | None, device: torch.device | str) -> torch.dtype:
    """The weight dtype a model loads with on `device`.

    `None`/"auto": bf16 on a GPU that computes it natively; fp32 on CPU (the activations of
    `resolve_format`'s q4 too). "bf16" (or torch.bfloat16): bf16 where native, else fp32 with one log
    line. "fp32": fp32.
    """
    device = torch.device(device)
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" and native_bf16(device) else torch.float32
    if name == "q4":  # activations of the int4 format (resolve_format)
        return torch.float32
    if isinstance(name, torch.dtype):
        dtype = name
    elif name in DTYPES:
        dtype = DTYPES[name]
    else:
        raise ValueError(f"dtype must be one of fp32, bf16, auto, q4; got {name!r}")
    if dtype == torch.bfloat16 and not native_bf16(device):
        _log_fallback(device.type)
        return torch.float32
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be fp32 or bf16; got {dtype}")
    return dtype


@dataclass(frozen=True)
class WeightFormat:
    """How a model holds its weights and computes its activations."""

    dtype: torch.dtype  # activations, KV cache and norms
    int4: bool = False  # matrices the GGUF stores in 4-bit blocks run through the int4 kernel
    dense: torch.dtype | None = None  # every other matrix (None: `dtype`)
    # The engine's own kernels (engine/runtime/kernels.py) run the file's blocks (4-bit and Q8_0) and decode and
    # verify attention; else torch's int4 kernel and float64 attention.
    own_kernels: bool = False

    @property
    def name(self) -> str:
        return "q4" if self.int4 else "bf16" if self.dtype == torch.bfloat16 else "fp32"

    @property
    def dense_dtype(self) -> torch.dtype:
        return self.dense or self.dtype

    @property
    def label(self) -> str:
        """The name with what carries it: "q4 (engine kernels, bf16 dense)", "q4 (torch int4, fp32 dense)",
        "fp32"."""
        if not self.int4:
            return self.name
        kernels = "engine kernels" if self.own_kernels else "torch int4"
        return f"q4 ({kernels}, {'bf16' if self.dense_dtype == torch.bfloat16 else 'fp32'} dense)"

    def fallback(self) -> WeightFormat | None:
        """The next format to try where this one's rows are not the same bits in every step kind on this
        machine (engine/runtime/row_check.py): bf16 dense matrices become fp32 (the blocks stay), then
        dense fp32 throughout; None after fp32."""
        if self.int4 and self.dense_dtype == torch.bfloat16:
            return dataclasses.replace(self, dense=None)  # (q4's own dtype, of activations, is fp32)
        if self.int4 or self.dtype != torch.float32:
            return WeightFormat(torch.float32)
        return None


def int4_kernels(device: torch.device | str) -> bool:
    """Whether torch's weight-only int4 kernel runs vectorized here: on CPU, AVX2 or AVX-512 (x86) and
    NEON (aarch64) have code paths; without them it is a scalar loop, slower than dense fp32."""
    device = torch.device(device)
    if device.type != "cpu":
        return False
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in ("aarch64", "arm64")


@functools.cache
def _log_no_int4(device_type: str) -> None:
    log.warning("q4 requested but the int4 kernel has no fast path on this %s: using dense weights instead",
                device_type)


def resolve_format(name: str | torch.dtype | None, device: torch.device | str, four_bit: bool = True) -> WeightFormat:
    """The weight format a model loads with on `device`; `four_bit`: whether its file has 4-bit blocks.

    "q4": the GGUF's 4-bit blocks through the engine's own kernels, or torch's int4 kernel where those do not
    build (dense weights with one log line where neither runs fast). `None`/"auto": q4 where the file is
    4-bit and a q4 kernel runs fast on this CPU, else dense (see the module docstring). Anything else is
    dense, as `resolve_dtype` says. A model whose file has no 4-bit blocks (an fp32 GGUF, a draft
    checkpoint) is dense fp32 under q4.
    """
    from specpool.engine.runtime import kernels  # (it asks this module which instruction set to build for)

    device = torch.device(device)
    if name in (None, "auto") and four_bit and device.type == "cpu" and (kernels.available() or int4_kernels(device)):
        name = "q4"
    if name == "q4":
        if device.type == "cpu" and kernels.available():
            return WeightFormat(torch.float32, int4=True, dense=torch.bfloat16 if native_bf16(device) else None,
                                own_kernels=True)
        if int4_kernels(device):
            # The other matrices (the tied LM head, Q8_0 in the default model) stay dense, in bf16 where
            # that is native: measured for the 49152x576 head on an AVX-512 EPYC (2 cores), 1 row / 9 rows:
            # bf16 1.1 / 1.9 ms, the Q8_0 blocks as two int4 halves 1.7 / 8.6 ms, fp32 4.1 / 8.4 ms. On AVX2,
            # fp32 (4.5 / 9.4 ms) against int4 halves (3.7 / 13.2 ms): fp32, exact and flatter in rows.
            return WeightFormat(torch.float32, int4=True, dense=torch.bfloat16 if native_bf16(device) else None)
        _log_no_int4(device.type)
        name = "auto"
    return WeightFormat(resolve_dtype(name, device))


def draft_format(name: str | None, device: torch.device | str) -> tuple[str, GGMLQuantizationType | None]:
    """How a draft checkpoint (the draft model or a head: dense fp32 on disk) loads: (the dtype or format
    `Llama` gets, the block format to quantize its matrices to first, or None).

    `None`/"auto": Q8_0 blocks through the engine's own kernels where they build (a draft step at one row
    reads every weight once and computes little: the head's forward took 1.82 ms in fp32, 1.00 in bf16
    and 0.38 on Q8_0 blocks, a quarter of fp32's bytes, on a 2-core AVX-512 EPYC; 1.44 fp32 and 0.39 Q8_0
    with the AVX2 kernels), else bf16 where native, else fp32. A draft's numerics only move its
    acceptance: the target verifies every token, and a sampled draft's q is the q its tokens were drawn
    from. "bf16" and "fp32" are dense, as `resolve_dtype` says.
    """
    from specpool.engine.runtime import kernels

    device = torch.device(device)
    if name not in (None, "auto"):
        return name, None
    if device.type == "cpu" and kernels.available():
        return "q4", GGMLQuantizationType.Q8_0  # (the block format: its name says 4-bit, it runs Q8_0 too)
    return ("bf16" if native_bf16(device) else "fp32"), None


def kernel_isa() -> str:
    """The instruction set the engine's own CPU kernels are compiled for (engine/runtime/kernels.py):
    "avx512vnni" where torch runs its AVX-512 kernels and the CPU executes AVX-512 VNNI (int8 dot
    products), "avx2" where it runs AVX2 (or AVX-512 without VNNI; SPECPOOL_NO_NATIVE_BF16 included), else
    "portable". Executes, not advertises: each is probed in a child process first (cpu_features).
    SPECPOOL_KERNEL_ISA names one instead (on a CPU that has it)."""
    forced = os.environ.get("SPECPOOL_KERNEL_ISA", "")
    if forced in ("avx512vnni", "avx2", "portable"):  # an operator's (or a test's) choice
        return forced
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512" and cpu_features.runs("avx512") and cpu_features.runs("avx512_vnni"):
        return "avx512vnni"
    return "avx2" if capability in ("AVX2", "AVX512") and cpu_features.runs("avx2") else "portable"


def kernel_amx() -> bool:
    """Whether the engine's CPU kernels may run verify steps' row tiles on AMX's int8 tiles: an AVX-512 VNNI
    build on a CPU that has executed a tile load (cpu_features; VMs have advertised AMX and faulted on it)."""
    return kernel_isa() == "avx512vnni" and cpu_features.runs("amx")


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
