"""How a request ended, as the router's and the targets' requests_total counters label it (`outcome`).

From the gRPC status it ended with: ok; cancelled (the client cancelled or went away); invalid (the
request cannot be served as sent: a bad field, bytes or a body that do not parse, a duplicate request
id); not_found (no live target serves the model it names: a wrong name, or a model whose every replica
is gone; NOT_FOUND); unauthenticated (no credentials the server knows: refused by its interceptor, or
by the router's HTTP front) and permission_denied (a replica's answer passed on); rejected (no room:
admission, a full queue; RESOURCE_EXHAUSTED); unavailable (no live replica, or draining); expired (its
deadline passed, queued or running); error (anything else, INTERNAL and FAILED_PRECONDITION included).
"""

from __future__ import annotations

import grpc

OK, CANCELLED, INVALID, NOT_FOUND, REJECTED, UNAVAILABLE, EXPIRED, ERROR = (
    "ok", "cancelled", "invalid", "not_found", "rejected", "unavailable", "expired", "error")
UNAUTHENTICATED, PERMISSION_DENIED = "unauthenticated", "permission_denied"
# The model label of a request refused before it had one (bad metadata, admission, no placement).
UNKNOWN_MODEL = "unknown"

_BY_CODE = {
    grpc.StatusCode.OK: OK,
    grpc.StatusCode.CANCELLED: CANCELLED,
    grpc.StatusCode.INVALID_ARGUMENT: INVALID,
    grpc.StatusCode.NOT_FOUND: NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS: INVALID,
    grpc.StatusCode.OUT_OF_RANGE: INVALID,
    grpc.StatusCode.UNAUTHENTICATED: UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: REJECTED,
    grpc.StatusCode.UNAVAILABLE: UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: EXPIRED,
}


def of_code(code: grpc.StatusCode | None) -> str:
    """None: the call ended by an exception that set no status (a bug), which gRPC answers UNKNOWN."""
    return _BY_CODE.get(code, ERROR)


def of_call(context: grpc.ServicerContext) -> str:
    """The outcome of a call that ends otherwise than by returning: expired or cancelled once its client
    has gone (its deadline passed or not), else what context.abort set (nothing: error)."""
    if not context.is_active():
        return EXPIRED if deadline_passed(context) else CANCELLED
    return of_code(context.code())


def deadline_passed(context: grpc.ServicerContext) -> bool:
    remaining = context.time_remaining()  # no deadline: a huge number; a passed one: 0
    return remaining is not None and remaining <= 0
