"""The OpenAI API's requests and their translation to the Target API (target.proto); OpenAIError, the
shape every refusal takes.

Pure: pydantic models of the requests, what is refused (naming the param), and GenerateRequest from
them. No I/O: router/openai_http.py serves them; router/openai_responses.py is the way back (the
JSON of responses and stream chunks, gRPC statuses as OpenAI errors, the scan for stop strings).

A specpool extension rides along: a request may carry `speculation` {method, max_draft_tokens, tree}
(SpeculationPreference), and every choice carries `speculation`, the request's SpeculationStats with
the ratios people read (acceptance, hit ratio). `return_token_ids` (vLLM's name) adds each choice's
token ids.
"""

from __future__ import annotations

import math
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specpool.common.speculation import method_to_pb
from specpool.engine.method import MAX_DRAFT_TOKENS, Method
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

