"""A typed client for specpool's Target API: a router's (or one target service's) Generate, streamed or
read to its end, with TLS and a bearer token, one deadline per call, and retries with backoff while the
service says so (UNAVAILABLE; RESOURCE_EXHAUSTED with a retry hint) and nothing has been received yet.

    with TargetClient("127.0.0.1:50070", token=TOKEN, ca_cert="ca.crt") as client:
        result = client.generate(prompt="def fib(n):", max_tokens=64)
        print(result.completions[0].text)
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from specpool_client.v1 import target_pb2 as pb
from specpool_client.v1 import target_pb2_grpc

# The name a router's certificate carries (its DNS SAN): dial it by IP and still check who answers.
ROUTER_SERVER_NAME = "router.specpool"
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)

METHODS = {
    "auto": pb.SPECULATION_METHOD_UNSPECIFIED, "none": pb.SPECULATION_METHOD_NONE,
    "draft_model": pb.SPECULATION_METHOD_DRAFT_MODEL, "ngram": pb.SPECULATION_METHOD_NGRAM,
    "ssd": pb.SPECULATION_METHOD_SSD, "head": pb.SPECULATION_METHOD_HEAD,
}


@dataclass(frozen=True)
class ErrorDetails:
    """What a failed call's google.rpc.Status details say, beyond its code and message."""

    field_violations: dict[str, str] = field(default_factory=dict)  # field path -> what is wrong with it
    retry_delay_s: float | None = None  # RetryInfo: when to try again
    reason: str = ""  # ErrorInfo.reason, e.g. INVALID_FIELD, OVERLOADED

    @staticmethod
    def of(error: grpc.RpcError) -> ErrorDetails:
        status = rpc_status.from_call(error) if isinstance(error, grpc.Call) else None
        violations, delay, reason = {}, None, ""
        for detail in status.details if status else ():
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                violations.update({v.field: v.description for v in bad.field_violations})
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                info = error_details_pb2.RetryInfo()
                detail.Unpack(info)
                delay = info.retry_delay.seconds + info.retry_delay.nanos / 1e9
            elif detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason
        return ErrorDetails(violations, delay, reason)


def final_result(responses: Iterable[pb.GenerateResponse]) -> pb.GenerateResult:
    """Reads a Generate stream to its end and returns its final message's result."""
    final = None
    for response in responses:
        if response.HasField("final"):
            final = response.final
    if final is None:
        raise RuntimeError("the Generate stream ended without its final message")
    return final


def generate_result(stub: target_pb2_grpc.TargetServiceStub, request: pb.GenerateRequest, **call_options
                    ) -> pb.GenerateResult:
    """One Generate call on a stub, read to its end: the whole result, as a unary call would give it."""
    return final_result(stub.Generate(request, **call_options))


def generate_request(
    prompt: str | None = None,
    *,
    messages: Sequence[tuple[str, str]] | None = None,
    prompt_ids: Sequence[int] | None = None,
    max_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    n: int = 1,
    stop_token_ids: Sequence[int] = (),
    speculation: str = "auto",
    max_draft_tokens: int = 0,
    request_id: str = "",
    model: str = "",
) -> pb.GenerateRequest:
    """A GenerateRequest from exactly one of prompt (text), messages ((role, content) pairs) or prompt_ids."""
    if sum(x is not None for x in (prompt, messages, prompt_ids)) != 1:
        raise ValueError("give exactly one of prompt, messages, prompt_ids")
    if speculation not in METHODS:
        raise ValueError(f"speculation: one of {', '.join(METHODS)}, got {speculation!r}")
    request = pb.GenerateRequest(
        request_id=request_id or uuid.uuid4().hex, model=model, max_tokens=max_tokens, n=n,
        stop_token_ids=stop_token_ids,
        sampling=pb.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed),
        speculation=pb.SpeculationPreference(method=METHODS[speculation], max_draft_tokens=max_draft_tokens),
    )
    if prompt is not None:
        request.prompt = prompt
    elif messages is not None:
        request.messages.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in messages)
    else:
        request.prompt_ids.ids.extend(prompt_ids)
    return request


class TargetClient:
    """A connection to a router (or a target service) and the calls of its Target API.

    address: host:port. token: the tenant's bearer token. ca_cert: the CA that signed the server's
    certificate (a path or PEM bytes); None with insecure=False uses the system's roots. server_name:
    the name to check the server's certificate against (a router's: router.specpool). retries: how many
    times a call that failed with a retryable status before any response is tried again.
    """

    def __init__(self, address: str, *, token: str | None = None, ca_cert: str | Path | bytes | None = None,
                 server_name: str | None = ROUTER_SERVER_NAME, insecure: bool = False, retries: int = 4,
                 backoff_s: float = 0.25, max_backoff_s: float = 8.0):
        if insecure:
            self.channel = grpc.insecure_channel(address)
        else:
            root = Path(ca_cert).read_bytes() if isinstance(ca_cert, (str, Path)) else ca_cert
            options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
            self.channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=root),
                                               options=options)
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def stream(self, request: pb.GenerateRequest | None = None, *, timeout_s: float | None = None,
               **fields) -> Iterator[pb.GenerateResponse]:
        """Generate's responses as they come: token deltas, then the final result. `fields` build the
        request (generate_request) when none is given. Retried only until the first response arrives, so
        no token is ever delivered twice; timeout_s bounds the whole call, retries included."""
        request = request if request is not None else generate_request(**fields)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        attempt = 0
        while True:
            call = self.stub.Generate(request, timeout=_left(deadline), metadata=self.metadata)
            received = False
            try:
                for response in call:
                    received = True
                    yield response
                return
            except grpc.RpcError as e:
                wait = self._retry_wait(e, attempt, deadline) if not received else None
                if wait is None:
                    raise
            finally:
                call.cancel()  # a caller that stopped reading frees the request's slot at once
            time.sleep(wait)
            attempt += 1

    def generate(self, request: pb.GenerateRequest | None = None, *, timeout_s: float | None = None,
                 **fields) -> pb.GenerateResult:
        """The whole result of one request (see stream)."""
        return final_result(self.stream(request, timeout_s=timeout_s, **fields))

    def cancel(self, request_id: str, *, timeout_s: float = 10.0) -> bool:
        """Stops a running request of this tenant's; False when none by that id is running."""
        try:
            return self.stub.Cancel(pb.CancelRequest(request_id=request_id), timeout=timeout_s,
                                    metadata=self.metadata).cancelled
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise

    def info(self, *, timeout_s: float = 10.0) -> pb.GetInfoResponse:
        return self.stub.GetInfo(pb.GetInfoRequest(), timeout=timeout_s, metadata=self.metadata)

    def _retry_wait(self, error: grpc.RpcError, attempt: int, deadline: float | None) -> float | None:
        """Seconds to wait before the next try, or None: do not retry. The server's RetryInfo wins over
        exponential backoff with jitter; RESOURCE_EXHAUSTED is retried only when the server gave one (a
        quota would otherwise be hammered)."""
        if attempt >= self.retries or error.code() not in RETRYABLE:
            return None
        hint = ErrorDetails.of(error).retry_delay_s
        if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and hint is None:
            return None
        wait = hint if hint is not None else min(self.max_backoff_s, self.backoff_s * 2**attempt) * random.uniform(0.5, 1)
        if deadline is not None and time.monotonic() + wait >= deadline:
            return None
        return wait


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
