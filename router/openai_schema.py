"""The OpenAI API's shapes and their translation to and from the Target API (target.proto).

Pure: pydantic models of the requests, GenerateRequest from them, the JSON of responses and stream
chunks from GenerateResult, gRPC statuses as OpenAI errors, and the scan for stop strings. No I/O:
router/openai_http.py serves them.

A specpool extension rides along: a request may carry `speculation` {method, max_draft_tokens, tree}
(SpeculationPreference), and every choice carries `speculation`, the request's SpeculationStats with
the ratios people read (acceptance, hit ratio). `return_token_ids` (vLLM's name) adds each choice's
token ids.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specpool.common.speculation import (
    MAX_DRAFT_TOKENS,
    Method,
    finish_reason_name,
    method_name,
    method_to_pb,
)
from specpool_client.v1 import target_pb2 as pb

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# OpenAI's chat runs to the end of the context by default; the front cannot see the prompt's length
# (the target tokenizes), so it asks for this many, and a request that needs more says so.
CHAT_MAX_TOKENS = 512
MAX_STOP_STRINGS = 16


class OpenAIError(Exception):
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s

    @property
    def type(self) -> str:
        return _ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))} if self.retry_after_s is not None else {}


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error"}


# -- requests --------------------------------------------------------------------------------------------


class SpeculationOptions(BaseModel):
    """The specpool extension: SpeculationPreference. Ours, so an unknown key in it is a mistake."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["auto", "none", "draft_model", "ngram", "ssd", "head"] = "auto"
    max_draft_tokens: int = Field(0, ge=0, le=MAX_DRAFT_TOKENS)  # 0: the target's policy chooses
    tree: bool = False


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    """What both endpoints take. Unknown fields are ignored, as OpenAI does."""

    model_config = ConfigDict(extra="ignore")

    model: str  # "": the pool's model, when it serves one
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # None: OpenAI's default, 1
    top_p: float | None = Field(None, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)  # not OpenAI's: vLLM's and llama.cpp's extension
    seed: int | None = Field(None, ge=0, lt=2**64)
    n: int | None = Field(None, ge=1)  # the upper bound is the target's max batch: it answers, naming n
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    speculation: SpeculationOptions | None = None
    return_token_ids: bool | None = False

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    # One prompt: text or token ids (a list of one of either is taken too; batches are not).
    prompt: str | list[int] | list[str] | list[list[int]]


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens; wins over it


R = TypeVar("R", CompletionRequest, ChatRequest)

# Fields OpenAI defines that change what is generated or returned and that this front cannot honour:
# a request setting one to anything but its neutral value is refused, naming it, rather than answered
# as if it had not asked.
_NEUTRAL = {
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": lambda v: not v,
    "echo": lambda v: not v,
    "suffix": lambda v: not v,
    "best_of": lambda v: v in (None, 1),
    "logit_bias": lambda v: not v,
    "presence_penalty": lambda v: not v,
    "frequency_penalty": lambda v: not v,
    "tools": lambda v: not v,
    "functions": lambda v: not v,
    "response_format": lambda v: v is None or v == {"type": "text"},
}


def parse(kind: type[R], body: object) -> R:
    """The request in `body` (decoded JSON), or OpenAIError 400 naming the first field at fault."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    for name, neutral in _NEUTRAL.items():
        if not neutral(body.get(name)):
            raise OpenAIError(400, f"{name}: not supported by specpool", param=name, code="unsupported_parameter")
    try:
        request = kind.model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        param = _param_of(error["loc"])
        raise OpenAIError(400, f"{param}: {error['msg']}" if param else error["msg"], param=param) from None
    stops = request.stops()
    if len(stops) > MAX_STOP_STRINGS or not all(stops):
        raise OpenAIError(400, f"stop: at most {MAX_STOP_STRINGS} strings, none of them empty", param="stop")
    return request


def _param_of(loc: tuple) -> str | None:
    """pydantic's location -> "speculation.method", "messages[0].content"; a union's member type dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif out and (part[:1].isupper() or "[" in part or part in ("str", "int", "list", "bool", "float")):
            break  # pydantic names the union member it tried: not a field
        else:
            out += f".{part}" if out else part
    return out or None


def to_generate_request(request: CompletionRequest | ChatRequest, request_id: str) -> pb.GenerateRequest:
    out = pb.GenerateRequest(request_id=request_id, model=request.model, n=request.n or 1)
    if isinstance(request, ChatRequest):
        out.max_tokens = request.max_completion_tokens or request.max_tokens or CHAT_MAX_TOKENS
        out.messages.messages.extend(
            pb.ChatMessage(role="system" if m.role == "developer" else m.role, content=m.text())
            for m in request.messages)
    else:
        out.max_tokens = request.max_tokens or COMPLETIONS_MAX_TOKENS
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise OpenAIError(400, f"prompt: one prompt per request, got a list of {len(prompt)}", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            out.prompt = prompt
        else:
            out.prompt_ids.ids.extend(prompt)
    out.sampling.temperature = 1.0 if request.temperature is None else request.temperature
    out.sampling.top_p = request.top_p or 1.0
    out.sampling.min_p = request.min_p or 0.0
    if request.seed is not None:
        out.sampling.seed = request.seed
    if request.speculation is not None:
        s = request.speculation
        out.speculation.CopyFrom(pb.SpeculationPreference(
            method=method_to_pb(None if s.method == "auto" else Method(s.method)),
            max_draft_tokens=s.max_draft_tokens, tree=s.tree))
    return out


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
