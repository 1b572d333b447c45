"""Log lines operators can use: text for people, or JSON (one object a line) for log pipelines.

`setup` installs one handler on the root logger. A servicer method decorated with `request_scoped`
runs in a context of its own; inside it `tag(request_id=..., tenant=...)` marks every line logged while
it serves that call, so a line about a request carries its id and tenant and no other call's. Threads
that work for many requests at once (a target's scheduler, an endpoint's engine) log without them; a
line there about one request passes them itself: `log.warning(..., extra={"request_id": ...})`.

A record's `extra` fields are part of the line: keys of the JSON object, `key=value` after a text line.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
import logging
import os
import sys
from datetime import UTC, datetime

LOG_FORMAT_ENV = "SPECPOOL_LOG_FORMAT"
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
REQUEST_FIELDS = ("request_id", "tenant")

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("specpool_request_id", default=None)
_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar("specpool_tenant", default=None)

# What every LogRecord has; anything else on a record came from `extra`.
_STANDARD = {*logging.LogRecord("", 0, "", 0, "", None, None).__dict__, "message", "asctime", "taskName",
             # uvicorn's copy of its message with terminal colours: the message says it already
             "color_message"}


def add_arguments(p) -> None:
    """--log-format, for every server (--log-level is each server's own)."""
    p.add_argument("--log-format", default=None, choices=FORMATS,
                   help=f"log lines as text or as JSON objects, one a line (default: ${LOG_FORMAT_ENV}, else text)")


def setup(level: str = "INFO", log_format: str | None = None) -> None:
    """Root logger at `level`, one handler on stderr in `log_format` (None: $SPECPOOL_LOG_FORMAT, else
    text). Calling it again changes the level and format, and adds no second handler."""
    log_format = log_format or os.environ.get(LOG_FORMAT_ENV) or "text"
    if log_format not in FORMATS:
        raise SystemExit(f"log format {log_format!r} (${LOG_FORMAT_ENV}): expected one of {', '.join(FORMATS)}")
    root = logging.getLogger()
    root.setLevel(level.upper())
    handler = next((h for h in root.handlers if isinstance(h, _Handler)), None)
    if handler is None:
        handler = _Handler(sys.stderr)
        handler.addFilter(RequestFields())
        root.addHandler(handler)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter(TEXT_FORMAT))


def tag(request_id: str | None = None, tenant: str | None = None) -> None:
    """Marks the lines logged from here on in this context (see request_scoped) with the request's id
    and tenant; None leaves one as it was."""
    if request_id:
        _request_id.set(request_id)
    if tenant:
        _tenant.set(tenant)


def request_scoped(method):
    """Runs a servicer method, unary or a response stream (a generator), in a context of its own: what
    it `tag`s marks its lines only, on whichever thread gRPC resumes it, and never the next call's."""
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def stream(*args, **kwargs):
            context = contextvars.copy_context()
            responses = context.run(method, *args, **kwargs)
            try:
                while True:
                    try:
                        response = context.run(next, responses)
                    except StopIteration:
                        return
                    yield response
            finally:  # also when the client went away mid-stream: the method's own cleanup sees its ids
                context.run(responses.close)

        return stream

    @functools.wraps(method)
    def unary(*args, **kwargs):
        return contextvars.copy_context().run(method, *args, **kwargs)

    return unary


class RequestFields(logging.Filter):
    """Adds the context's request_id and tenant to each record that has none of its own (from extra)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, var in (("request_id", _request_id), ("tenant", _tenant)):
            value = var.get()
            if value and getattr(record, name, None) is None:
                setattr(record, name, value)
        return True


def fields(record: logging.LogRecord) -> dict[str, object]:
    """The record's request fields, then its other extra fields, in the order they were given. Private
    names (a leading `_`) are left out: libraries' record factories add them to every record (Ray's
    `_ray_timestamp_ns`), they are not the caller's `extra`."""
    out = {name: getattr(record, name) for name in REQUEST_FIELDS if getattr(record, name, None) is not None}
    out.update((k, v) for k, v in record.__dict__.items()
               if k not in _STANDARD and not k.startswith("_") and k not in out)
    return out


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT, then ` key=value` for each field (request_id and tenant first); a traceback follows
    on the next lines, as usual."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        extra = " ".join(f"{k}={v}" for k, v in fields(record).items())
        return f"{line} {extra}" if extra else line


class JsonFormatter(logging.Formatter):
    """{"ts": ISO 8601 UTC, "level", "logger", "message", request_id, tenant, extra fields...,
    "exception": its traceback text}; one line, whatever the message holds."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
        }
        for k, v in fields(record).items():
            out.setdefault(k, v)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str)


class _Handler(logging.StreamHandler):
    """Marks the handler `setup` installed, so a second call does not add another."""
