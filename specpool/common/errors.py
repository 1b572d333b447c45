"""How input is refused and calls fail, in one place: the FieldError every input check raises where
input enters a process (it names the field), and the google.rpc.Status every server ends a failed call
with: the code, a message that starts with the field, and details clients can act on.

Every status carries an ErrorInfo (domain specpool.v1, a reason, metadata field=<the field>);
INVALID_ARGUMENT a BadRequest with the field violation; UNAVAILABLE and RESOURCE_EXHAUSTED a RetryInfo.
README "Errors" lists each reason.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NoReturn

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "specpool.v1"
RETRY_AFTER_S = 1.0  # the hint of an UNAVAILABLE or RESOURCE_EXHAUSTED that names none


class StatusCode(StrEnum):
    """The gRPC status a FieldError maps to (names of grpc.StatusCode)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"


class FieldError(ValueError):
    """Bad input, named by its field path (`sessions[3].sampling.top_p`): the message starts with it."""

    def __init__(self, field: str, message: str, code: StatusCode = StatusCode.INVALID_ARGUMENT):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.code = code


# ErrorInfo.reason when the caller names none: what the code means in this API.
_REASONS = {
    grpc.StatusCode.INVALID_ARGUMENT: "INVALID_FIELD",
    grpc.StatusCode.NOT_FOUND: "NOT_FOUND",
    grpc.StatusCode.ALREADY_EXISTS: "ALREADY_RUNNING",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "OVERLOADED",
    grpc.StatusCode.UNAVAILABLE: "UNAVAILABLE",
    grpc.StatusCode.FAILED_PRECONDITION: "FAILED_PRECONDITION",
    grpc.StatusCode.UNAUTHENTICATED: "UNAUTHENTICATED",
    grpc.StatusCode.PERMISSION_DENIED: "PERMISSION_DENIED",
    grpc.StatusCode.CANCELLED: "CANCELLED",
}


def error_status(code: grpc.StatusCode, field: str, message: str, *, reason: str | None = None,
                 retry_after_s: float | None = None) -> grpc.Status:
    """The status of a failed call: message "<field>: <message>" and the details above."""
    status = status_pb2.Status(code=code.value[0], message=f"{field}: {message}")
    status.details.add().Pack(error_details_pb2.ErrorInfo(
        reason=reason or _REASONS.get(code, code.name), domain=DOMAIN, metadata={"field": field}))
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=field, description=message)]))
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
        delay = RETRY_AFTER_S if retry_after_s is None else retry_after_s
        status.details.add().Pack(error_details_pb2.RetryInfo(
            retry_delay=duration_pb2.Duration(seconds=int(delay), nanos=int(delay % 1 * 1e9))))
    return rpc_status.to_status(status)


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, field: str, message: str, *,
          reason: str | None = None, retry_after_s: float | None = None) -> NoReturn:
    """Ends the call with error_status(...)."""
    context.abort_with_status(error_status(code, field, message, reason=reason, retry_after_s=retry_after_s))
    raise AssertionError("grpc context.abort_with_status returned")  # it always raises
