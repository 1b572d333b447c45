"""The Target API (specpool.v1.TargetService) of one target model: its gRPC servicer.

The servicer only translates: it validates a GenerateRequest into a scheduler Request, then turns
the request's events back into GenerateResponses. Decoding, batching and speculation live in the
scheduler, the engine's Decoder and the RemoteDrafter.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import uuid
from dataclasses import replace

import grpc
import jinja2

from specpool.common import logs, outcomes
from specpool.common.errors import FieldError
from specpool.common.security import TENANT_HEADER, Security
from specpool.common.serving import abort_invalid, abort_with_retry
from specpool.common.speculation import finish_reason_to_pb, method_to_pb, sampling_from_pb
from specpool.common.target_api import check_generate_request
from specpool.common.write_deadline import WriteDeadline
from specpool.engine.decoding import GenerationResult
from specpool.engine.method import LOCAL_METHOD, MAX_DRAFT_TOKENS
from specpool.engine.plan import SpeculationPlan
from specpool.engine.runtime.model import Llama
from specpool.engine.runtime.tokenizer import Tokenizer
from specpool.engine.verification.sampling import continued_seed
from specpool.target_service.remote.drafter import RemoteDrafter
from specpool.target_service.remote.observer import SequenceCounts
from specpool.target_service.scheduler import Request, Scheduler, request_key
from specpool_client.v1 import target_pb2 as pb
from specpool_client.v1 import target_pb2_grpc

log = logging.getLogger(__name__)


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    """Request ids are scoped by their owner: the caller's identity, or for a router the tenant it
    names (it authenticated that tenant's token). Another owner's id is simply not found."""

    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer | None, model: Llama, name: str,
                 tenant: str, max_context: int, max_batch: int, drafter: RemoteDrafter,
                 credentials: Security | None = None, max_per_tenant: int = 0,
                 write_deadline: WriteDeadline | None = None):
        self.credentials = credentials or Security.insecure()
        self.write_deadline = write_deadline or WriteDeadline()
        # Generate calls one owner holds here at once, queued, running or still sending (0: no cap).
        self.max_per_tenant = max_per_tenant
        self._held: collections.Counter[str] = collections.Counter()
        self._held_lock = threading.Lock()
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.vocab_size = model.config.vocab_size
        self.stop_ids = list(model.config.stop_ids)  # eos, and Llama 3's end-of-turn tokens
        self.name = name
        self.tenant = tenant
        self.max_context = max_context
        self.max_batch = max_batch
        self.drafter = drafter

    # -- RPCs -----------------------------------------------------------------------------------

    @logs.request_scoped
    def Generate(self, request, context):
        owner = self._owner(context)
        logs.tag(request_id=request.request_id, tenant=_tenant_of(owner))
        if not self._hold(owner):
            self.scheduler.metrics.count(outcomes.REJECTED)
            abort_with_retry(context, f"request: this tenant holds {self.max_per_tenant} requests here, queued, "
                             f"running or sending (--max-requests-per-tenant {self.max_per_tenant}); retry in 1 s "
                             "or on another replica", 1.0)
        try:
            yield from self.write_deadline.stream(self._generate(request, context),
                                                  on_stall=lambda: self._stalled(owner, context))
        finally:
            self._release(owner)

    def _stalled(self, owner: str, context) -> None:
        """The client stopped reading: its call is cancelled, which cancels the request (`_client_gone`)."""
        log.warning("tenant %s stopped reading its stream for %g s (--grpc-stall-timeout-s): call cancelled, "
                    "request cancelled", _tenant_of(owner) or "(none)", self.write_deadline.timeout_s)
        context.cancel()

    def _hold(self, owner: str) -> bool:
        """Counts a call of `owner`'s, unless it already holds its share of this target (issue 52.2: one
        tenant's streams, read or not, must leave room for the others)."""
        with self._held_lock:
            if self.max_per_tenant and self._held[owner] >= self.max_per_tenant:
                return False
            self._held[owner] += 1
            return True

    def _release(self, owner: str) -> None:
        with self._held_lock:
            self._held[owner] -= 1
            if self._held[owner] <= 0:
                del self._held[owner]

    def _generate(self, request, context):
        try:
            req = self._submit(request, context)
        except Exception:  # refused before the scheduler took it (it counts the requests it takes)
            self.scheduler.metrics.count(outcomes.of_call(context))
            raise
        logs.tag(request_id=req.request_id)
        decoded: list[list[int]] = [list(req.resumed) for _ in range(req.n)]
        # What the client already has: a character the failed replica held back incomplete is not in it.
        text = [self.tokenizer.decode(ids).rstrip("\ufffd") if self.tokenizer else "" for ids in decoded]
        for kind, index, payload in _events(req, context):
            if kind == "delta":
                decoded[index].extend(payload)
                delta = self._text_delta(decoded[index], text, index)
                yield pb.GenerateResponse(request_id=req.request_id,
                                          delta=pb.TokenDelta(index=index, token_ids=payload, text=delta))
            elif kind == "error":
                abort_invalid(context, "request", payload, grpc.StatusCode.INTERNAL, reason="ENGINE_FAILED")
        yield pb.GenerateResponse(request_id=req.request_id, final=self._result(req))

    @logs.request_scoped
    def Cancel(self, request, context):
        owner = self._owner(context)
        logs.tag(request_id=request.request_id, tenant=_tenant_of(owner))
        if not self.scheduler.cancel(request_key(owner, request.request_id)):
            abort_invalid(context, "request_id", f"no running request {request.request_id!r} of yours",
                          grpc.StatusCode.NOT_FOUND)
        return pb.CancelResponse(cancelled=True)

    def GetInfo(self, request, context):
        running, queued = self.scheduler.load()
        return pb.GetInfoResponse(
            service_id=self.tenant, model=self.name, vocab_size=self.vocab_size, max_batch=self.max_batch,
            active_sequences=running, queued_requests=queued,
            spec_endpoint=self.drafter.address or "", spec_endpoint_attached=self.drafter.attached,
        )

    # -- translation --------------------------------------------------------------------------------

    def _owner(self, context) -> str:
        caller = self.credentials.caller(context)
        metadata = dict(context.invocation_metadata() or ())
        if caller.anonymous or caller.role == "router":  # --insecure, or a router naming its tenant
            return f"tenant/{metadata.get(TENANT_HEADER, '')}"
        return f"{caller.role}/{caller.name}"

    def _submit(self, request: pb.GenerateRequest, context) -> Request:
        req = self._validate(request, context)
        req.owner = self._owner(context)
        stops = req.stop_ids if req.stop_ids is not None else self.stop_ids
        if req.resumed and req.resumed[-1] in stops:
            # The failed replica emitted a stop token but not its final message: nothing is left to do.
            req.results = [GenerationResult(req.prompt_ids + req.resumed, finish_reason="stop")]
            req.counts = [SequenceCounts()]
            req.finished_at = time.monotonic()
            req.events.put(("done", None, None))
            self.scheduler.metrics.count(outcomes.OK)
            return req
        try:
            self.scheduler.submit(req)
        except KeyError:
            abort_invalid(context, "request_id", f"{req.request_id!r} is already running (one of yours)",
                          grpc.StatusCode.ALREADY_EXISTS)
        except OverflowError as e:
            abort_with_retry(context, f"request: {e}; retry in 1 s or on another replica", 1.0)
        except RuntimeError as e:
            abort_invalid(context, "request", str(e), grpc.StatusCode.UNAVAILABLE)
        # A client that goes away (cancels, or its deadline passes) frees the slots; harmless once the
        # request is done. One already gone (a short deadline that passed while this thread waited to run:
        # seen on a loaded CI machine) gets no callback: its request would wait in the queue and then run
        # for nobody, counted as anything but expired.
        if not context.add_callback(lambda: self._client_gone(req, context)):
            self._client_gone(req, context)
        return req

    def _client_gone(self, req: Request, context) -> None:
        req.expired = outcomes.deadline_passed(context)
        self.scheduler.cancel(req.key)

    def _validate(self, r: pb.GenerateRequest, context) -> Request:
        try:
            method = check_generate_request(r)
            params = sampling_from_pb(r.sampling)
        except FieldError as e:
            abort_invalid(context, e.field, e.message)
        if r.model and r.model != self.name:
            abort_invalid(context, "model", f"unknown model {r.model!r}; this service serves {self.name!r}",
                          grpc.StatusCode.NOT_FOUND)
        prompt_ids = self._prompt_ids(r, context)
        resumed = list(r.resume_token_ids)
        self._check_token_ids(context, "resume_token_ids", resumed)
        held = len(prompt_ids) + len(resumed)
        room = self.max_context - held - MAX_DRAFT_TOKENS - 1
        if r.max_tokens > room:
            abort_invalid(context, "max_tokens", f"{r.max_tokens} does not fit: the prompt has {held} "
                          f"tokens and this service holds {self.max_context} per sequence (at most {max(room, 0)})")
        n = r.n or 1
        if not 1 <= n <= self.max_batch:
            abort_invalid(context, "n", f"must be in [1, {self.max_batch}], got {r.n}")
        self._check_token_ids(context, "stop_token_ids", r.stop_token_ids)
        if params.top_k >= self.vocab_size:  # keeps every token: the same sampler as no truncation
            params = replace(params, top_k=0)
        if resumed and params.seed is not None:
            params = replace(params, seed=continued_seed(params.seed, len(resumed)))
        speculation = SpeculationPlan.of(method, bool(self.drafter.address), r.speculation.max_draft_tokens,
                                           r.speculation.tree)
        return Request(
            request_id=r.request_id or uuid.uuid4().hex, prompt_ids=prompt_ids, params=params,
            max_tokens=r.max_tokens, stop_ids=list(r.stop_token_ids) or ([] if r.ignore_eos else None), n=n,
            speculation=speculation, resumed=resumed,
        )

    def _check_token_ids(self, context, field: str, ids) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            abort_invalid(context, field, f"token id {bad} outside the vocabulary [0, {self.vocab_size})")

    def _prompt_ids(self, r: pb.GenerateRequest, context) -> list[int]:
        which = r.WhichOneof("input")
        if which == "prompt_ids":
            ids = list(r.prompt_ids.ids)
            self._check_token_ids(context, "prompt_ids", ids)
        else:
            field = "prompt" if which == "prompt" else "messages"
            if self.tokenizer is None:
                abort_invalid(context, field, "this model has no tokenizer; send prompt_ids")
            # Refused before tokenizing: the tokenizer holds the GIL (1.4 s per MB) and stalls decoding.
            size = len(r.prompt.encode()) if which == "prompt" else sum(
                len(m.content.encode()) for m in r.messages.messages)
            limit = self.max_context * self.tokenizer.max_token_bytes
            if size > limit:
                abort_invalid(context, field, f"{size} bytes of text cannot fit in {self.max_context} tokens "
                              f"(at most {limit} bytes: {self.tokenizer.max_token_bytes} per token)")
            if which == "prompt":
                ids = self.tokenizer.encode_prompt(r.prompt)
            else:
                messages = [{"role": m.role, "content": m.content} for m in r.messages.messages]
                try:
                    ids = self.tokenizer.encode_chat(messages) if messages else []
                except jinja2.TemplateError as e:  # the model file's template: refused by the sandbox, or broken
                    abort_invalid(context, "messages", f"this model's chat template failed ({type(e).__name__}: "
                                  f"{e}); send prompt or prompt_ids instead", grpc.StatusCode.FAILED_PRECONDITION,
                                  reason="CHAT_TEMPLATE_FAILED")
        if not ids:
            abort_invalid(context, {"prompt": "prompt", "prompt_ids": "prompt_ids"}.get(which, "messages"), "is empty")
        return ids

    def _text_delta(self, ids: list[int], text: list[str], index: int) -> str:
        """Text added by the latest tokens; held back while a multi-byte character is incomplete."""
        if self.tokenizer is None:
            return ""
        full = self.tokenizer.decode(ids)
        if full.endswith("\ufffd") or not full.startswith(text[index]):
            return ""
        delta, text[index] = full[len(text[index]) :], full
        return delta

    def _result(self, req: Request) -> pb.GenerateResult:
        completions = []
        for i, res in enumerate(req.results):
            token_ids = req.resumed + res.token_ids
            completions.append(pb.Completion(
                index=i, token_ids=token_ids,
                text=self.tokenizer.decode(token_ids) if self.tokenizer else "",
                finish_reason=finish_reason_to_pb("cancelled" if req.cancelled else res.finish_reason),
                speculation=pb.SpeculationStats(
                    method=method_to_pb(req.speculation.method),
                    local=req.speculation.method is LOCAL_METHOD and not req.speculation.remote,
                    target_steps=res.target_steps,
                    drafted_tokens=res.drafted_tokens, accepted_tokens=res.accepted_tokens,
                    mean_accept_len=res.mean_accept_len, fallback_rounds=req.counts[i].fallback_rounds,
                    cache_hits=req.counts[i].cache_hits, cache_lookups=req.counts[i].cache_lookups,
                    branch_rounds=res.branch_rounds, plan_drops=res.plan_drops,
                ),
            ))
        first = (req.first_token_at - req.submitted_at) if req.first_token_at else 0.0
        return pb.GenerateResult(
            request_id=req.request_id, model=self.name, completions=completions,
            usage=pb.Usage(prompt_tokens=len(req.prompt_ids),
                           completion_tokens=sum(len(c.token_ids) for c in completions)),
            time_to_first_token_s=first, elapsed_s=(req.finished_at or time.monotonic()) - req.submitted_at,
        )


def _tenant_of(owner: str) -> str:
    """The tenant a request owner names, for log lines: "tenant/alpha" and "client/alpha" are alpha."""
    return owner.partition("/")[2]


def _events(req: Request, context):
    """The request's events until it is done; stops early when the client has gone."""
    while True:
        try:
            event = req.events.get(timeout=1.0)
        except queue.Empty:
            if not context.is_active():
                return
            continue
        if event[0] == "done":
            return
        yield event
