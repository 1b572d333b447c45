"""The error every input check raises where input enters a process: it names the field, and the gRPC
status a server answers it with."""

from __future__ import annotations

from enum import StrEnum


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
