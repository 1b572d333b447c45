"""What a GenerateRequest must hold whatever model serves it: checked by the router before it places a
request (so a malformed one is INVALID_ARGUMENT even with no target up) and by every target service,
which then checks what only it knows (its model name, vocabulary, context and batch size). Torch-free."""

from __future__ import annotations

from specpool.common.errors import FieldError
from specpool.common.speculation import check_sampling, method_from_pb
from specpool.engine.method import MAX_DRAFT_TOKENS, Method
from specpool_client.v1 import target_pb2 as pb

CHAT_ROLES = ("system", "user", "assistant")


def check_generate_request(r: pb.GenerateRequest) -> Method | None:
    """Raises FieldError naming the first bad field; returns the requested method (None: the default)."""
    which = r.WhichOneof("input")
    if which is None:
        raise FieldError("prompt", "one of prompt, prompt_ids or messages is required")
    if which == "prompt" and not r.prompt or which == "prompt_ids" and not r.prompt_ids.ids:
        raise FieldError(which, "is empty")
    if which == "messages":
        if not r.messages.messages:
            raise FieldError("messages", "is empty")
        bad_role = next((m.role for m in r.messages.messages if m.role not in CHAT_ROLES), None)
        if bad_role is not None:
            raise FieldError("messages", f"role {bad_role!r} is not one of {', '.join(CHAT_ROLES)}")
    for field in ("prompt_ids", "stop_token_ids", "resume_token_ids"):
        ids = r.prompt_ids.ids if field == "prompt_ids" else getattr(r, field)
        bad = next((t for t in ids if t < 0), None)
        if bad is not None:
            raise FieldError(field, f"token ids are >= 0, got {bad}")
    if r.max_tokens < 1:
        raise FieldError("max_tokens", f"must be >= 1, got {r.max_tokens}")
    if r.n < 0:
        raise FieldError("n", f"must be >= 1 (0: one), got {r.n}")
    if r.resume_token_ids and r.n > 1:
        raise FieldError("resume_token_ids", f"resumes one completion; n must be 1, got {r.n}")
    check_sampling(r.sampling)
    method = method_from_pb(r.speculation.method)
    if not 0 <= r.speculation.max_draft_tokens <= MAX_DRAFT_TOKENS:
        raise FieldError("speculation.max_draft_tokens",
                         f"must be in [0, {MAX_DRAFT_TOKENS}], got {r.speculation.max_draft_tokens}")
    if r.speculation.tree and method is not None and not method.row.trees:
        raise FieldError("speculation.tree", f"{method.name} drafts chains; ask for draft_model or ngram with tree")
    return method
