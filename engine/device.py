"""The one place that chooses device, weight dtype and torch.distributed backend."""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """`None`/"auto": bf16 on GPU; fp32 on CPU, where greedy output must match the fp32 oracle.

    bf16 on CPU is selectable (`--dtype bf16`): it halves the bytes each decode step reads.
    """
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"dtype must be one of fp32, bf16, auto; got {name!r}")
    return table[name]


def distributed_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"
