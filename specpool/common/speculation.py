"""The speculation vocabulary on the wire: the protobuf forms of a method, a finish reason, a tensor
backend, sampling params and q, and the only place they are mapped.

The Target API (target.proto, SpeculationMethod) and the Speculation API (speculation.proto,
DrafterKind) name drafters with enums of their own; in Python there is one `Method`
(specpool/engine/method.py, with the limits of a round), and a request that names none (UNSPECIFIED)
carries `None`: the server's default.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from specpool.common.errors import FieldError
from specpool.engine.method import Method
from specpool_client.v1 import speculation_pb2 as spec_pb
from specpool_client.v1 import target_pb2

if TYPE_CHECKING:  # the router speaks this vocabulary too, and never loads torch or the engine
    import torch

    from specpool.engine.verification.sampling import SamplingParams

# Sparse q (a top-k sampler's draft distribution) travels inline in gRPC rounds up to this many tokens a
# row: 8 drafts x 256 x 8 bytes is 16 KB a sequence. A wider support goes dense on the tensor channel.
SPARSE_Q_MAX_K = 256


def _by_name(enum, prefix: str, methods) -> dict[Method, int]:
    """Each method's value of a wire enum, named PREFIX + its NAME; a method the protos lack stays off the wire."""
    return {m: enum.Value(prefix + m.name) for m in methods if prefix + m.name in enum.DESCRIPTOR.values_by_name}


_METHOD_PB = _by_name(target_pb2.SpeculationMethod, "SPECULATION_METHOD_", Method)
_DRAFTER_PB = _by_name(spec_pb.DrafterKind, "DRAFTER_KIND_", [m for m in Method if m.row.drafter is not None])


def _method_from(table: dict[Method, int], value: int, field: str, names) -> Method:
    for method, number in table.items():
        if number == value:
            return method
    raise FieldError(field, f"unknown value {value}; one of " + ", ".join(names.keys()))


def method_from_pb(value: int, field: str = "speculation.method") -> Method | None:
    """Target API enum -> Method; None for UNSPECIFIED. proto3 enums take any number, so unknown ones raise."""
    if value == target_pb2.SPECULATION_METHOD_UNSPECIFIED:
        return None
    return _method_from(_METHOD_PB, value, field, target_pb2.SpeculationMethod)


def method_to_pb(method: Method | None) -> int:
    return target_pb2.SPECULATION_METHOD_UNSPECIFIED if method is None else _METHOD_PB[method]


def method_name(value: int) -> str:
    """A SpeculationStats or capacity method as people read it: "ngram", "draft_model"."""
    return next((m.value for m, number in _METHOD_PB.items() if number == value), "unspecified")


_FINISH_PB = {"stop": target_pb2.FINISH_REASON_STOP, "length": target_pb2.FINISH_REASON_LENGTH,
              "cancelled": target_pb2.FINISH_REASON_CANCELLED}


def finish_reason_to_pb(reason: str) -> int:
    """The engine's finish reason (stop, length, cancelled) -> FinishReason."""
    return _FINISH_PB[reason]


def finish_reason_name(value: int) -> str:
    return next((name for name, number in _FINISH_PB.items() if number == value), "unspecified")


def drafter_from_pb(value: int, field: str = "drafter") -> Method | None:
    """Speculation API enum -> Method; None for UNSPECIFIED (the endpoint's best for the model)."""
    if value == spec_pb.DRAFTER_KIND_UNSPECIFIED:
        return None
    return _method_from(_DRAFTER_PB, value, field, spec_pb.DrafterKind)


def on_the_wire(method: Method) -> bool:
    """Whether the Speculation API names this drafter (a method added to the table without a DrafterKind
    value runs in process only: an endpoint builds it but offers it to no target)."""
    return method in _DRAFTER_PB


def drafter_to_pb(method: Method | None) -> int:
    """Method.NONE has no drafter: asking for one is a bug of the caller's."""
    if method is None:
        return spec_pb.DRAFTER_KIND_UNSPECIFIED
    if method not in _DRAFTER_PB:
        raise ValueError(f"{method} is not a drafter the endpoint runs")
    return _DRAFTER_PB[method]


_BACKEND_PB = {"gloo": spec_pb.TENSOR_BACKEND_GLOO, "nccl": spec_pb.TENSOR_BACKEND_NCCL}


def backend_to_pb(name: str) -> int:
    """A torch.distributed backend name (gloo, nccl) -> TensorBackend."""
    return _BACKEND_PB[name]


def backend_from_pb(value: int) -> str:
    for name, number in _BACKEND_PB.items():
        if number == value:
            return name
    raise ValueError(f"tensor channel offer: unknown backend {value}")


def sampling_from_pb(msg: target_pb2.SamplingParams, field: str = "sampling") -> SamplingParams:
    """Checked where it enters a process: a bad value raises FieldError naming it."""
    from specpool.engine.verification.sampling import SamplingParams

    check_sampling(msg, field)
    return SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.top_p > 0 else 1.0,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
    )


def check_sampling(msg: target_pb2.SamplingParams, field: str = "sampling") -> None:
    """Torch-free, for the router too."""
    if not math.isfinite(msg.temperature) or msg.temperature < 0:
        raise FieldError(f"{field}.temperature", f"must be a finite number >= 0 (0: greedy), got {msg.temperature}")
    if not 0.0 <= msg.top_p <= 1.0:  # NaN fails too
        raise FieldError(f"{field}.top_p", f"must be in [0, 1] (0 or 1: no nucleus truncation), got {msg.top_p}")
    if msg.top_k < 0:
        raise FieldError(f"{field}.top_k", f"must be >= 0 (0: no top-k truncation), got {msg.top_k}")
    if not 0.0 <= msg.min_p <= 1.0:  # NaN fails too
        raise FieldError(f"{field}.min_p", f"must be in [0, 1] (0: no min-p truncation), got {msg.min_p}")


def sampling_to_pb(params: SamplingParams) -> target_pb2.SamplingParams:
    msg = target_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                    min_p=params.min_p)
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def q_travels_dense(params: SamplingParams, method: Method, dense_asked: bool = False) -> bool:
    """Whether a session's q crosses on the tensor channel: sampled draft-model drafts, unless top-k bounds
    the support to SPARSE_Q_MAX_K tokens (inline then) and the caller did not ask for dense rows. Greedy
    and n-gram drafts (point masses) carry no q; SSD's q is always sparse."""
    if params.greedy or not method.row.dense_q:
        return False
    return dense_asked or not 0 < params.top_k <= SPARSE_Q_MAX_K


def sparse_q_to_pb(ids: list[int], probs: list[float], k: int) -> spec_pb.SparseDistribution:
    """Row-major [rows, k] ids and probabilities."""
    return spec_pb.SparseDistribution(k=k, ids=ids, probs=probs)


def sparse_q_from_pb(msg: spec_pb.SparseDistribution, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ids [rows, k], probs [rows, k]), or None when the message's sizes do not say that."""
    import torch

    k = msg.k
    if k < 1 or len(msg.ids) != rows * k or len(msg.probs) != rows * k:
        return None
    return (torch.tensor(msg.ids, dtype=torch.long).view(rows, k),
            torch.tensor(msg.probs, dtype=torch.float32).view(rows, k))
