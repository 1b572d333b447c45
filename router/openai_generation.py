"""One OpenAI request's Generate call to this router's own gRPC port over loopback (router/openai_http.py
serves the front): the call read to its final message as the text each choice may show, each
choice ending before its first stop string; once every choice has stopped so, the request is
cancelled with Cancel, so that its final message still brings usage and speculation statistics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from specpool.common.security import Security, server_name
from specpool.common.serving import MESSAGE_SIZE_OPTIONS
from specpool.router.openai_responses import (
    ChoiceResult,
    StopScanner,
    error_from_status,
    finish_reason_of,
    speculation_json,
    usage_json,
)
from specpool.router.openai_schema import OpenAIError
from specpool_client.v1 import cluster_pb2_grpc, target_pb2_grpc
from specpool_client.v1 import target_pb2 as pb

log = logging.getLogger("specpool.router.http")

# After Cancel (every choice met a stop string) the final message comes within a decode step; this
# bounds the wait should it not (the call is then cancelled and usage counts what was received).
FINAL_AFTER_CANCEL_S = 5.0


class RouterApi:
    """This router's own Target API and ClusterStateService over loopback (grpc.aio, in the front's loop)."""

    def __init__(self, address: str, credentials: Security):
        options = list(MESSAGE_SIZE_OPTIONS)
        if credentials.enabled:
            options.append(("grpc.ssl_target_name_override", server_name("router")))
            self.channel = grpc.aio.secure_channel(
                address, grpc.ssl_channel_credentials(root_certificates=credentials.ca), options=options)
        else:
            self.channel = grpc.aio.insecure_channel(address, options=options)
        self.target = target_pb2_grpc.TargetServiceStub(self.channel)
        self.cluster = cluster_pb2_grpc.ClusterStateServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()


def _error(e: grpc.aio.AioRpcError, max_tokens_name: str = "max_tokens") -> OpenAIError:
    trailer = next((v for k, v in e.trailing_metadata() or () if k == "grpc-status-details-bin"), None)
    return error_from_status(e.code(), e.details(), trailer if isinstance(trailer, bytes) else None, max_tokens_name)


class Generation:
    """One request's Generate call, read to its final message, as the text each choice may show."""

    def __init__(self, api: RouterApi, request: pb.GenerateRequest, metadata: tuple, stops: list[str],
                 max_tokens_name: str = "max_tokens"):
        self.api, self.request, self.metadata = api, request, metadata
        self.max_tokens_name = max_tokens_name
        n = request.n or 1
        self.scanners = [StopScanner(stops) for _ in range(n)]
        self.received = [""] * n  # text the deltas brought
        self.shown = [""] * n  # text the client gets: up to its first stop string
        self.token_ids: list[list[int]] = [[] for _ in range(n)]  # a stopped choice's: up to its stop's delta
        self.result: pb.GenerateResult | None = None
        self._call = None
        self._first: pb.GenerateResponse | None = None

    async def open(self) -> None:
        """Starts the call and waits for its first message, so that a refusal (authentication,
        validation, routing, overload) raises OpenAIError before any HTTP response has begun."""
        self._call = self.api.target.Generate(self.request, metadata=self.metadata)
        try:
            self._first = await self._read()
        except BaseException:
            self._call.cancel()
            raise

    async def pieces(self) -> AsyncIterator[tuple[int, str]]:
        """(choice index, text) as the client may see it; `result` is set once this ends."""
        message, cancelled = self._first, False
        try:
            while message is not None:
                if message.HasField("final"):
                    for i, text in self._finish(message.final):
                        yield i, text
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await self._call.read()  # the call's status: it ends "ok", not cancelled by us
                    return
                i = message.delta.index
                if 0 <= i < len(self.scanners) and not self.scanners[i].stopped:
                    self.received[i] += message.delta.text
                    self.token_ids[i].extend(message.delta.token_ids)
                    text = self.scanners[i].feed(message.delta.text)
                    self.shown[i] += text
                    if text:
                        yield i, text
                if not cancelled and all(s.stopped for s in self.scanners):
                    cancelled = True
                    await self._cancel()
                try:
                    message = await (asyncio.wait_for(self._read(), FINAL_AFTER_CANCEL_S) if cancelled
                                     else self._read())
                except TimeoutError:
                    log.warning("request %s: no final message %.0f s after Cancel; ending it here",
                                self.request.request_id, FINAL_AFTER_CANCEL_S)
                    self.result = self._without_final()
                    return
            raise OpenAIError(502, "the Generate stream ended without its final message")
        finally:
            self.cancel()  # the client left, or the stream failed: free the request's slot

    def cancel(self) -> None:
        """Ends the call now (its client left): its replica frees the request's slot."""
        if self._call is not None and not self._call.done():
            self._call.cancel()

    def choices(self, with_token_ids: bool) -> list[ChoiceResult]:
        out = []
        for c in self.result.completions:
            stopped = c.index < len(self.scanners) and self.scanners[c.index].stopped
            out.append(ChoiceResult(
                index=c.index, text=self.shown[c.index] if c.index < len(self.shown) else c.text,
                finish_reason="stop" if stopped else finish_reason_of(c),
                speculation=speculation_json(c.speculation),
                token_ids=(self.token_ids[c.index] if stopped else list(c.token_ids)) if with_token_ids else None))
        return out

    def usage(self) -> dict:
        return usage_json(self.result.usage)

    async def _read(self) -> pb.GenerateResponse | None:
        try:
            message = await self._call.read()
        except grpc.aio.AioRpcError as e:
            raise _error(e, self.max_tokens_name) from None
        return None if message is grpc.aio.EOF else message

    async def _cancel(self) -> None:
        try:
            await self.api.target.Cancel(pb.CancelRequest(request_id=self.request.request_id),
                                         metadata=self.metadata, timeout=FINAL_AFTER_CANCEL_S)
        except grpc.aio.AioRpcError as e:  # NOT_FOUND: it had just finished; its final is on the way
            log.debug("Cancel of %s: %s", self.request.request_id, e.code().name)

    def _finish(self, result: pb.GenerateResult) -> list[tuple[int, str]]:
        """The text of each running choice that its deltas did not bring (a character the target held
        back, the end held back for a possible stop string)."""
        self.result = result
        out = []
        for c in result.completions:
            i = c.index
            if not 0 <= i < len(self.scanners) or self.scanners[i].stopped:
                continue
            rest = c.text[len(self.received[i]):] if c.text.startswith(self.received[i]) else ""
            text = self.scanners[i].feed(rest)
            text += self.scanners[i].flush()
            self.shown[i] += text
            if text:
                out.append((i, text))
        return out

    def _without_final(self) -> pb.GenerateResult:
        """What a final message would have said, from what was received (prompt tokens unknown: 0)."""
        return pb.GenerateResult(
            request_id=self.request.request_id, model=self.request.model,
            completions=[pb.Completion(index=i, token_ids=ids, text=self.received[i],
                                       finish_reason=pb.FINISH_REASON_CANCELLED)
                         for i, ids in enumerate(self.token_ids)],
            usage=pb.Usage(completion_tokens=sum(map(len, self.token_ids))))
