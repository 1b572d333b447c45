"""What a benchmark ran on: every absolute figure is reported with this."""

from __future__ import annotations

import os
import platform
import time

import torch

from specpool.engine.runtime.device import cpu_class
from specpool.engine.runtime.process_env import NO_NATIVE_BF16


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        **cpu_class(),  # cpu_capability, native_bf16, bf16_override, onednn_max_cpu_isa
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        # Constants tuned on one machine class, recorded with every figure (engine/runtime/process_env.py).
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
    }


def machine_line() -> str:
    """One line for a terminal: CPU, cores, kernel class and whether bf16 is native."""
    m = machine_info()
    bf16 = "native bf16" if m["native_bf16"] else "no native bf16 (models in fp32)"
    override = f" ({NO_NATIVE_BF16} set)" if m["bf16_override"] else ""
    return f"{m['cpu']}, {m['cores_usable']} cores, {m['cpu_capability']} kernels, {bf16}{override}"


def memory_read_gbps(megabytes: int = 512, repeats: int = 5) -> float:
    """Streaming read bandwidth (a sum over a large fp32 buffer): the decode-step floor's denominator."""
    x = torch.ones(megabytes * 2**20 // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9
