"""Log lines (specpool/common/logs.py): JSON objects or text, each line logged while serving a request
tagged with its id and tenant, and no other line; the format from the flag, else the environment."""

from __future__ import annotations

import io
import json
import logging
import threading
from datetime import datetime

import pytest

from specpool.common import logs


@pytest.fixture
def lines():
    """A logger writing through the filter and a formatter set by the test; .text() is what it wrote."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(logs.RequestFields())
    logger = logging.getLogger("specpool.test-logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield logger, handler, stream
    logger.removeHandler(handler)


def test_json_lines_carry_the_request_fields_and_the_exception(lines):
    logger, handler, stream = lines
    handler.setFormatter(logs.JsonFormatter())

    @logs.request_scoped
    def serve():
        logs.tag(request_id="r-1", tenant="alpha")
        logger.info("placed on %s", "t1")
        try:
            raise ValueError("bad\nthing")
        except ValueError:
            logger.exception("failed")

    serve()
    logger.info("ready", extra={"service": "Router", "port": 50070})
    placed, failed, ready = (json.loads(line) for line in stream.getvalue().splitlines())
    assert datetime.fromisoformat(placed.pop("ts")).utcoffset().total_seconds() == 0
    assert placed == {"level": "INFO", "logger": "specpool.test-logs", "message": "placed on t1",
                      "request_id": "r-1", "tenant": "alpha"}
    assert failed["level"] == "ERROR" and "ValueError: bad\nthing" in failed["exception"]
    assert {k: ready[k] for k in ("message", "service", "port")} == {"message": "ready", "service": "Router",
                                                                     "port": 50070}
    assert "request_id" not in ready and "tenant" not in ready, "a line about no request names none"


def test_text_lines_end_with_the_fields_and_streams_keep_their_own_ids_across_threads(lines):
    logger, handler, stream = lines
    handler.setFormatter(logs.TextFormatter("%(levelname)s %(name)s: %(message)s"))
    go_on = threading.Event()

    @logs.request_scoped
    def responses(request_id: str):
        logs.tag(request_id=request_id, tenant="beta")
        logger.warning("first")
        yield 1
        logger.warning("second")
        yield 2

    a, b = responses("a"), responses("b")
    next(a)
    next(b)
    logger.warning("between")  # this thread's own context: neither request's
    threading.Thread(target=lambda: (next(a), go_on.set())).start()  # gRPC may resume a stream elsewhere
    assert go_on.wait(5)
    next(b)
    assert stream.getvalue().splitlines() == [
        "WARNING specpool.test-logs: first request_id=a tenant=beta",
        "WARNING specpool.test-logs: first request_id=b tenant=beta",
        "WARNING specpool.test-logs: between",
        "WARNING specpool.test-logs: second request_id=a tenant=beta",
        "WARNING specpool.test-logs: second request_id=b tenant=beta",
    ]


def test_the_format_comes_from_the_flag_else_the_environment(monkeypatch):
    root = logging.getLogger()
    before = list(root.handlers), root.level

    def formatter():
        [handler] = [h for h in root.handlers if isinstance(h, logs._Handler)]
        return type(handler.formatter)

    try:
        monkeypatch.setenv(logs.LOG_FORMAT_ENV, "json")
        logs.setup("INFO")
        assert formatter() is logs.JsonFormatter
        logs.setup("INFO", "text")
        assert formatter() is logs.TextFormatter, "the flag wins; still one handler"
        monkeypatch.setenv(logs.LOG_FORMAT_ENV, "yaml")
        with pytest.raises(SystemExit, match="SPECPOOL_LOG_FORMAT"):
            logs.setup("INFO")
    finally:
        root.handlers[:] = before[0]
        root.setLevel(before[1])


def test_attributes_other_libraries_add_to_every_record_are_not_fields(lines):
    """Ray (once imported) sets a record factory that puts _ray_timestamp_ns on every record: a private
    attribute, not something the caller passed in `extra`, so it stays off the line."""
    logger, handler, stream = lines
    handler.setFormatter(logs.TextFormatter("%(message)s"))
    default = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = default(*args, **kwargs)
        record._ray_timestamp_ns = 1
        return record

    logging.setLogRecordFactory(factory)
    try:
        logger.warning("placed", extra={"replica": "t1"})
    finally:
        logging.setLogRecordFactory(default)
    assert stream.getvalue().splitlines() == ["placed replica=t1"]
