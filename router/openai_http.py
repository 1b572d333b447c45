"""The router's OpenAI-compatible HTTP front: POST /v1/completions, POST /v1/chat/completions, GET /v1/models.

A translator, run inside the router process (uvicorn on a thread and event loop of its own): each HTTP
request becomes one Generate call (server-streaming) to this router's own gRPC port over loopback,
carrying the caller's Authorization header as the call's `authorization` metadata. Authentication,
tenancy, admission, routing, failover and metrics are therefore the Target API's, by construction; a
gRPC status comes back as the HTTP status OpenAI's clients expect (router/openai_responses.py).

TLS: the front serves HTTPS with the router's certificate and dials the gRPC port with the router's CA
(`--insecure`: both plaintext). It presents no client certificate there: the router would take a
call carrying its own certificate for its own, not its caller's (Security.caller: a certificate
outranks a token). The certificate names router.specpool, not an address: clients check that name
(curl --resolve router.specpool:PORT:127.0.0.1; httpx: the sni_hostname request extension).

Stop strings are the front's: a choice's text ends before its first one (finish_reason "stop"), and
once every choice has stopped so, the request is cancelled with Cancel, so that its final message
still brings usage and speculation statistics.

The parts: openai_schema.py (requests, OpenAIError) and openai_responses.py (errors from statuses,
stop strings, response JSON) translate; openai_generation.py runs one request's Generate call; here,
the app and the server around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from specpool.common import outcomes
from specpool.common.http_limits import DEFAULT_LIMITS, HttpLimits
from specpool.common.security import TENANT_HEADER, Security
from specpool.common.serving import MAX_MESSAGE_BYTES
from specpool.router.http_guard import (
    DEFAULT_TENANT_LIMITS,
    SHARE,
    HandshakeBoundLoop,
    TenantLimits,
    guarded_protocol,
)
from specpool.router.openai_generation import Generation, RouterApi, _error
from specpool.router.openai_responses import ChatShape, CompletionShape
from specpool.router.openai_schema import (
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    R,
    parse,
    to_generate_request,
)
from specpool_client.v1 import cluster_pb2

log = logging.getLogger("specpool.router.http")

_PRINTABLE = re.compile(r"^[\x20-\x7e]*$")  # what gRPC metadata values may hold


# -- the app -------------------------------------------------------------------------------------------------


def build_app(grpc_address: str, credentials: Security,
              on_refused: Callable[[str], None] | None = None) -> FastAPI:
    """The ASGI app; its loopback channel to the router opens and closes with it (lifespan).
    `on_refused(outcome)` hears each completion request the front refuses itself, before forwarding
    (the router counts the ones it forwards)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.api = RouterApi(grpc_address, credentials)
        app.state.loop = asyncio.get_running_loop()
        try:
            yield
        finally:
            await app.state.api.close()

    app = FastAPI(title="specpool", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers())

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:  # unknown paths, methods
        return JSONResponse(OpenAIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, e: ClientDisconnect) -> Response:  # mid-body, or let go (http_guard)
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(OpenAIError(500, f"internal error ({type(e).__name__})").body(), status_code=500)

    async def accepted(request: Request, schema: type[R]) -> tuple[R, tuple[tuple[str, str], ...]]:
        """The request's body and credentials, or its refusal (counted). A stream takes one of its
        tenant's streams (router/http_guard.py; past them 429, counted there)."""
        try:
            body, metadata = parse(schema, await _json(request)), _metadata(request)
        except OpenAIError as e:
            if on_refused is not None:
                on_refused(outcomes.UNAUTHENTICATED if e.status == 401 else outcomes.INVALID)
            raise
        share = request.scope.get(SHARE)  # none: no token the front knows (the router refuses it)
        if body.stream and share is not None and (refused := share.take_stream()) is not None:
            raise refused
        return body, metadata

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, *await accepted(request, CompletionRequest), CompletionShape)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, *await accepted(request, ChatRequest), ChatShape)

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": [_model_json(m) for m in await _models(request)]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str):
        if model not in await _models(request):
            raise OpenAIError(404, f"model: no live target serves {model!r}", param="model", code="model_not_found")
        return _model_json(model)

    return app


async def _generate(request: Request, body: CompletionRequest | ChatRequest, metadata: tuple[tuple[str, str], ...],
                    shape):
    api: RouterApi = request.app.state.api
    request_id = uuid.uuid4().hex
    max_tokens_name = ("max_completion_tokens" if isinstance(body, ChatRequest) and body.max_completion_tokens
                       else "max_tokens")
    generation = Generation(api, to_generate_request(body, request_id), metadata, body.stops(),
                            max_tokens_name)
    head = {"id": shape.id_prefix + request_id, "created": int(time.time()), "model": body.model}
    with_ids = bool(body.return_token_ids)
    if body.stream:
        await generation.open()
        # The events stop at the client's leaving (its connection dropped, a stalled one included) only
        # when they next send: a Generate call read meanwhile ran on to its end. Cancelled at once instead.
        watcher = asyncio.ensure_future(_client_left(request))
        watcher.add_done_callback(lambda _: generation.cancel())
        return StreamingResponse(_events(generation, shape, head, body.include_usage, with_ids),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def complete() -> JSONResponse:
        await generation.open()
        async for _ in generation.pieces():
            pass
        head["model"] = generation.result.model or body.model
        return JSONResponse(shape.response(head, generation.choices(with_ids), generation.usage()))

    return await _unless_client_leaves(request, complete())


async def _events(generation: Generation, shape, head: dict, include_usage: bool,
                  with_ids: bool) -> AsyncIterator[bytes]:
    """Server-sent events: OpenAI's chunks, then `data: [DONE]`. A failure after the response began is
    an error event (the SDKs raise it)."""

    def event(chunk: dict, last: bool = False) -> bytes:
        if include_usage and not last:
            chunk["usage"] = None  # OpenAI's: every chunk but the usage chunk says null
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    try:
        for chunk in shape.opening(head, len(generation.scanners)):
            yield event(chunk)
        async for index, text in generation.pieces():
            yield event(shape.text_chunk(head, index, text))
        for choice in generation.choices(with_ids):
            yield event(shape.finish_chunk(head, choice))
        if include_usage:
            yield event(shape.usage_chunk(head, generation.usage()), last=True)
    except OpenAIError as e:
        yield event(e.body(), last=True)
    yield b"data: [DONE]\n\n"


async def _models(request: Request) -> list[str]:
    api: RouterApi = request.app.state.api
    try:
        capacity = await api.cluster.GetClusterCapacity(cluster_pb2.GetClusterCapacityRequest(),
                                                        metadata=_metadata(request), timeout=10.0)
    except grpc.aio.AioRpcError as e:
        raise _error(e) from None
    return sorted({pool.model for pool in capacity.pools if pool.targets})


def _model_json(model: str) -> dict:
    return {"id": model, "object": "model", "created": 0, "owned_by": "specpool"}


def _metadata(request: Request) -> tuple[tuple[str, str], ...]:
    """The caller's credentials as gRPC metadata: its Authorization header (and, which only an
    --insecure router believes, its x-specpool-tenant)."""
    out = []
    for header in ("authorization", TENANT_HEADER):
        value = request.headers.get(header)
        if value is None:
            continue
        if not _PRINTABLE.match(value):
            status = 401 if header == "authorization" else 400
            raise OpenAIError(status, f"{header}: the header holds characters other than printable ASCII")
        out.append((header, value))
    return tuple(out)


async def _json(request: Request) -> object:
    """The request body as JSON; 413 past the gRPC message limit (the request could not be forwarded)."""
    size, parts = 0, []
    async for part in request.stream():
        size += len(part)
        if size > MAX_MESSAGE_BYTES:
            raise OpenAIError(413, f"the request body is larger than {MAX_MESSAGE_BYTES} bytes")
        parts.append(part)
    try:
        return json.loads(b"".join(parts))
    except ValueError as e:
        raise OpenAIError(400, f"the request body is not JSON ({e})") from None


async def _client_left(request: Request) -> None:
    """Returns once the client has disconnected, or its response is complete (uvicorn says either as
    http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_client_leaves(request: Request, work: Awaitable[Response]) -> Response:
    """`work`'s response, unless the client disconnects first: then the work is cancelled (its Generate
    call too, which frees the request's slot on its replica)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_client_left(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is stopping
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, OpenAIError):
            await task
        return Response(status_code=499)  # nobody reads it: the client has gone
    return task.result()


# -- the server ----------------------------------------------------------------------------------------------


def loopback_address(host: str, port: int) -> str:
    """Where this process reaches a port it bound on `host`."""
    if host in ("", "0.0.0.0"):
        return f"127.0.0.1:{port}"
    if host in ("::", "[::]"):
        return f"[::1]:{port}"
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class HttpFront:
    """uvicorn serving build_app on a thread with its own event loop, beside the router's gRPC server,
    held to `limits` and each tenant to `tenant_limits` (router/http_guard.py)."""

    def __init__(self, credentials: Security, grpc_port: int, host: str, port: int, grace_s: float = 10.0,
                 on_refused: Callable[[str], None] | None = None, limits: HttpLimits = DEFAULT_LIMITS,
                 tenant_limits: TenantLimits = DEFAULT_TENANT_LIMITS):
        if port < 0:
            raise ValueError(f"--http-port must be >= 0 (or -1: no HTTP front), got {port}")
        self.credentials, self.host, self.requested_port = credentials, host, port
        self.grace_s, self.limits, self.tenant_limits, self.on_refused = grace_s, limits, tenant_limits, on_refused
        self.app = build_app(loopback_address(host, grpc_port), credentials, on_refused)
        self.port = 0
        self.scheme = "https" if credentials.enabled else "http"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None

    def start(self, timeout_s: float = 30.0) -> int:
        """Binds host:port (0: a free port), serves, and returns the port once the app has started."""
        family = socket.getaddrinfo(self.host or None, self.requested_port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]
        self._socket = socket.create_server((self.host, self.requested_port), family=family, backlog=2048)
        self.port = self._socket.getsockname()[1]
        config = self._config()
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="http-front", daemon=True)
        self._thread.start()
        end = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                self.stop()
                raise RuntimeError("the OpenAI-compatible HTTP front did not start; see the log above")
            time.sleep(0.02)
        log.info("OpenAI-compatible HTTP front on %s://%s/v1", self.scheme, loopback_address(self.host, self.port))
        return self.port

    def _run(self) -> None:
        with asyncio.Runner(loop_factory=lambda: HandshakeBoundLoop(self.limits.header_timeout_s)) as runner:
            runner.run(self._server.serve(sockets=[self._socket]))

    def begin_stop(self) -> None:
        """Stop taking connections; requests in flight finish (their gRPC calls drain with the router's)."""
        if self._server is not None:
            self._server.should_exit = True

    def stop(self) -> None:
        """Once the requests in flight have answered (the router has drained its gRPC calls first), stop.
        An idle keep-alive TLS connection is not waited for: uvicorn would wait for its client's
        close_notify, which an idle client never sends."""
        self.begin_stop()
        loop = getattr(self.app.state, "loop", None)
        if self._server is not None and loop is not None:
            end = time.monotonic() + self.grace_s
            while self._server.server_state.tasks and time.monotonic() < end:
                time.sleep(0.05)
            with contextlib.suppress(RuntimeError):  # the loop has already ended
                loop.call_soon_threadsafe(self._drop_connections)
        if self._thread is not None:
            self._thread.join(self.grace_s + 5.0)
        if self._socket is not None:
            self._socket.close()

    def _drop_connections(self) -> None:
        for connection in list(self._server.server_state.connections):
            connection.transport.abort()

    def _config(self) -> uvicorn.Config:
        common = {"log_config": None, "log_level": "warning", "access_log": False, "lifespan": "on", "ws": "none",
                  "proxy_headers": False, "timeout_graceful_shutdown": max(1, math.ceil(self.grace_s)),
                  "http": guarded_protocol(self.limits, self.tenant_limits, self.credentials, self.on_refused),
                  "timeout_keep_alive": self.limits.idle_timeout_s}
        if not self.credentials.enabled:
            config = uvicorn.Config(self.app, **common)
            config.load()
            return config
        # uvicorn reads the certificate and key from files: they live only until it has loaded them.
        directory = Path(tempfile.mkdtemp(prefix="specpool-https-"))  # 0700
        try:
            cert, key = directory / "tls.crt", directory / "tls.key"
            for path, data in ((cert, self.credentials.cert), (key, self.credentials.key)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            config = uvicorn.Config(self.app, ssl_certfile=str(cert), ssl_keyfile=str(key), **common)
            config.load()
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return config
