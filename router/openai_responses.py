"""The way back from the Target API to OpenAI's shapes (router/openai_schema.py has the way in): gRPC
statuses as OpenAI errors, the scan that ends a choice's text before its first stop string, and the
JSON of responses and stream chunks from GenerateResult. Pure, no I/O: router/openai_http.py serves
them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from specpool.common.speculation import finish_reason_name, method_name
from specpool.router.openai_schema import OpenAIError
from specpool_client.v1 import target_pb2 as pb

# -- gRPC status -> OpenAI error ---------------------------------------------------------------------------

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# The Target API's field names where OpenAI's differ; fields that are no request field map to None.
_PARAMS = {"sampling.temperature": "temperature", "sampling.top_p": "top_p", "sampling.min_p": "min_p",
           "sampling.seed": "seed", "prompt_ids": "prompt", "request": None, "authorization": None, "x-specpool-tenant": None}
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]-]*): ")


def error_from_status(code: grpc.StatusCode, details: str | None, status_details: bytes | None = None,
                      max_tokens_name: str = "max_tokens") -> OpenAIError:
    """A gRPC status as the HTTP error OpenAI's clients expect (specpool/common/errors.py writes them).
    The field at fault is the error's param: the BadRequest field violation or the ErrorInfo field in
    `status_details` (the google.rpc.Status trailer), else the start of the message ("sampling.top_p:
    must be ..."). The ErrorInfo reason is the error's code; a RetryInfo becomes Retry-After."""
    details = details or code.name
    info = _StatusDetails.of(status_details)
    match = _FIELD.match(details)
    field = info.field or (match.group(1) if match else None)
    param = _PARAMS.get(field, field)
    if param == "max_tokens":
        param = max_tokens_name
    retry_after_s = info.retry_after_s
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and retry_after_s is None:
        retry_after_s = 1.0
    retryable = code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
    return OpenAIError(_HTTP_STATUS.get(code, 500), details, param=param, code=(info.reason or code.name).lower(),
                       retry_after_s=retry_after_s if retryable else None)


@dataclass(frozen=True, slots=True)
class _StatusDetails:
    field: str | None = None  # BadRequest's first violation, else ErrorInfo's field
    reason: str | None = None  # ErrorInfo's
    retry_after_s: float | None = None  # RetryInfo's

    @staticmethod
    def of(data: bytes | None) -> _StatusDetails:
        try:
            status = status_pb2.Status.FromString(data or b"")
        except DecodeError:
            return _StatusDetails()
        violated = field = reason = delay = None
        for detail in status.details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                violated = violated or (bad.field_violations[0].field if bad.field_violations else None)
            elif detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                field, reason = info.metadata.get("field") or None, info.reason or None
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                detail.Unpack(retry)
                delay = retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9
        return _StatusDetails(violated or field, reason, delay)


# -- stop strings ------------------------------------------------------------------------------------------


class StopScanner:
    """The text a choice may show so far: it ends before the first stop string. Text that could be the
    start of a stop string is held back until the next piece settles it."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.stopped = False
        self._held = ""

    def feed(self, text: str) -> str:
        """What of `text` (appended to what was held) can be shown now; nothing once stopped."""
        if self.stopped:
            return ""
        held = self._held + text
        found = [i for i in (held.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped, self._held = True, ""
            return held[: min(found)]
        keep = max((k for s in self.stops for k in range(1, len(s)) if held.endswith(s[:k])), default=0)
        self._held = held[len(held) - keep :]
        return held[: len(held) - keep]

    def flush(self) -> str:
        """The end of the choice's text: what was held back is no stop string after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


# -- responses ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    index: int
    text: str
    finish_reason: str  # stop, length (OpenAI's); cancelled when someone cancelled the request
    speculation: dict
    token_ids: list[int] | None = None  # when the request asked for return_token_ids


def speculation_json(stats: pb.SpeculationStats) -> dict:
    """SpeculationStats as people read it: the method's name, and acceptance and hit ratios."""
    return {
        "method": method_name(stats.method),
        "target_steps": stats.target_steps,
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "acceptance": stats.accepted_tokens / stats.drafted_tokens if stats.drafted_tokens else None,
        "mean_accept_len": stats.mean_accept_len,
        "cache_hits": stats.cache_hits,
        "cache_lookups": stats.cache_lookups,
        "hit_ratio": stats.cache_hits / stats.cache_lookups if stats.cache_lookups else None,
        "fallback_rounds": stats.fallback_rounds,
        "branch_rounds": stats.branch_rounds,
        "plan_drops": stats.plan_drops,
        "local": stats.local,
    }


def finish_reason_of(completion: pb.Completion) -> str:
    return finish_reason_name(completion.finish_reason)


def usage_json(usage: pb.Usage | None) -> dict:
    prompt, completion = (usage.prompt_tokens, usage.completion_tokens) if usage is not None else (0, 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _choice_tail(choice: ChoiceResult) -> dict:
    out: dict[str, Any] = {"logprobs": None, "finish_reason": choice.finish_reason, "speculation": choice.speculation}
    if choice.token_ids is not None:
        out["token_ids"] = choice.token_ids
    return out


class CompletionShape:
    """/v1/completions: text choices."""

    id_prefix = "cmpl-"

    @staticmethod
    def response(head: dict, choices: list[ChoiceResult], usage: dict) -> dict:
        return {**head, "object": "text_completion", "usage": usage,
                "choices": [{"index": c.index, "text": c.text, **_choice_tail(c)} for c in choices]}

    @staticmethod
    def opening(head: dict, n: int) -> list[dict]:
        return []

    @staticmethod
    def text_chunk(head: dict, index: int, text: str) -> dict:
        return {**head, "object": "text_completion",
                "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": None}]}

    @staticmethod
    def finish_chunk(head: dict, choice: ChoiceResult) -> dict:
        return {**head, "object": "text_completion",
                "choices": [{"index": choice.index, "text": "", **_choice_tail(choice)}]}

    @staticmethod
    def usage_chunk(head: dict, usage: dict) -> dict:
        return {**head, "object": "text_completion", "choices": [], "usage": usage}


class ChatShape:
    """/v1/chat/completions: assistant messages; a stream opens each choice with its role."""

    id_prefix = "chatcmpl-"

    @staticmethod
    def response(head: dict, choices: list[ChoiceResult], usage: dict) -> dict:
        return {**head, "object": "chat.completion", "usage": usage, "choices": [
            {"index": c.index, "message": {"role": "assistant", "content": c.text}, **_choice_tail(c)}
            for c in choices]}

    @staticmethod
    def opening(head: dict, n: int) -> list[dict]:
        return [{**head, "object": "chat.completion.chunk", "choices": [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
            for i in range(n)]

    @staticmethod
    def text_chunk(head: dict, index: int, text: str) -> dict:
        return {**head, "object": "chat.completion.chunk", "choices": [
            {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]}

    @staticmethod
    def finish_chunk(head: dict, choice: ChoiceResult) -> dict:
        return {**head, "object": "chat.completion.chunk",
                "choices": [{"index": choice.index, "delta": {}, **_choice_tail(choice)}]}

    @staticmethod
    def usage_chunk(head: dict, usage: dict) -> dict:
        return {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage}
