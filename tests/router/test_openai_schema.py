"""The OpenAI front's translation, without servers (router/openai_schema.py, openai_responses.py):
requests to GenerateRequest, what is refused and with which param, gRPC statuses to HTTP errors, and
the scan for stop strings."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from specpool.router.openai_responses import StopScanner, error_from_status, speculation_json
from specpool.router.openai_schema import (
    CHAT_MAX_TOKENS,
    COMPLETIONS_MAX_TOKENS,
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    parse,
    to_generate_request,
)
from specpool_client.v1 import target_pb2 as pb


def test_a_completion_request_becomes_a_generate_request_with_openai_defaults():
    out = to_generate_request(parse(CompletionRequest, {"model": "m", "prompt": "hi", "user": "ignored"}), "id-1")
    assert (out.request_id, out.model, out.prompt, out.max_tokens, out.n) == ("id-1", "m", "hi", COMPLETIONS_MAX_TOKENS, 1)
    assert (out.sampling.temperature, out.sampling.top_p, out.sampling.min_p, out.sampling.HasField("seed")) == (
        1.0, 1.0, 0.0, False)
    assert out.speculation.method == pb.SPECULATION_METHOD_UNSPECIFIED

    ids = to_generate_request(parse(CompletionRequest, {"model": "m", "prompt": [[5, 6, 7]], "temperature": 0,
                                                        "top_p": 0.5, "min_p": 0.25, "seed": 9, "n": 3,
                                                        "max_tokens": 4}), "x")
    assert list(ids.prompt_ids.ids) == [5, 6, 7] and ids.WhichOneof("input") == "prompt_ids"
    assert (ids.sampling.temperature, ids.sampling.top_p, ids.sampling.min_p, ids.sampling.seed, ids.n,
            ids.max_tokens) == (0, 0.5, 0.25, 9, 3, 4)


def test_a_chat_request_carries_its_messages_and_the_speculation_extension():
    out = to_generate_request(parse(ChatRequest, {
        "model": "m", "max_tokens": 7, "max_completion_tokens": 5,
        "messages": [{"role": "developer", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}],
        "speculation": {"method": "ngram", "max_draft_tokens": 4, "tree": True}}), "id")
    assert [(m.role, m.content) for m in out.messages.messages] == [("system", "be brief"), ("user", "hello")]
    assert out.max_tokens == 5, "max_completion_tokens wins over max_tokens"
    assert (out.speculation.method, out.speculation.max_draft_tokens, out.speculation.tree) == (
        pb.SPECULATION_METHOD_NGRAM, 4, True)
    assert to_generate_request(parse(ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}]}),
                               "i").max_tokens == CHAT_MAX_TOKENS


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": "m", "prompt": "x", "max_tokens": -5}, "max_tokens"),
    ({"model": "m", "prompt": "x", "top_p": 1.5}, "top_p"),
    ({"model": "m", "prompt": "x", "min_p": 1.5}, "min_p"),
    ({"model": "m", "prompt": "x", "n": 0}, "n"),
    ({"model": "m", "prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x"}, "model"),
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": {"text": "x"}}, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": "x", "logprobs": 2}, "logprobs"),
    ({"model": "m", "prompt": "x", "logprobs": True}, "logprobs"),
    ({"model": "m", "prompt": "x", "echo": True}, "echo"),
    ({"model": "m", "prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"model": "m", "prompt": "x", "stop": ["ok", ""]}, "stop"),
    ({"model": "m", "prompt": "x", "stop": 3}, "stop"),
    ({"model": "m", "prompt": "x", "speculation": {"method": "magic"}}, "speculation.method"),
    ({"model": "m", "prompt": "x", "speculation": {"max_draft_tokens": 99}}, "speculation.max_draft_tokens"),
    ({"model": "m", "prompt": "x", "speculation": {"metod": "none"}}, "speculation.metod"),
])
def test_a_bad_completion_request_is_a_400_naming_its_field(body, param):
    with pytest.raises(OpenAIError) as err:
        to_generate_request(parse(CompletionRequest, body), "id")
    assert (err.value.status, err.value.param) == (400, param), err.value.message
    assert err.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content"),
    ({"model": "m", "messages": [{"content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
])
def test_a_bad_chat_request_is_a_400_naming_its_field(body, param):
    with pytest.raises(OpenAIError) as err:
        parse(ChatRequest, body)
    assert (err.value.status, err.value.param) == (400, param), err.value.message


def test_neutral_values_of_unsupported_fields_are_accepted():
    parse(ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": False,
                        "presence_penalty": 0, "response_format": {"type": "text"}, "tools": [], "user": "u"})


def _status(*details) -> bytes:
    status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message="m")
    for d in details:
        status.details.add().Pack(d)
    return status.SerializeToString()


@pytest.mark.parametrize("code, details, http, param", [
    (grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature: must be >= 0", 400, "temperature"),
    (grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids: token id 99 outside the vocabulary", 400, "prompt"),
    (grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: 9000 does not fit", 400, "max_tokens"),
    (grpc.StatusCode.FAILED_PRECONDITION, "messages: this model's chat template failed", 400, "messages"),
    (grpc.StatusCode.UNAUTHENTICATED, "authorization: send a bearer token", 401, None),
    (grpc.StatusCode.PERMISSION_DENIED, "no", 403, None),
    (grpc.StatusCode.NOT_FOUND, "model: no live target serves 'x'", 404, "model"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "request: at its limit", 429, None),
    (grpc.StatusCode.UNAVAILABLE, "model: no live target replica", 503, "model"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", 504, None),
    (grpc.StatusCode.INTERNAL, "sequence failed", 500, None),
])
def test_grpc_statuses_map_to_openai_errors(code, details, http, param):
    e = error_from_status(code, details)
    assert (e.status, e.param, e.message, e.code) == (http, param, details, code.name.lower())
    assert e.body()["error"]["type"] == {400: "invalid_request_error", 401: "authentication_error",
                                         403: "permission_error", 404: "not_found_error",
                                         429: "rate_limit_error"}.get(http, "server_error")
    assert ("Retry-After" in e.headers()) == (http == 429), "429 always says when; 503 when the status does"


def test_status_details_name_the_field_the_reason_and_the_retry_delay():
    bad = error_details_pb2.BadRequest(field_violations=[
        error_details_pb2.BadRequest.FieldViolation(field="sampling.top_p", description="must be in [0, 1]")])
    info = error_details_pb2.ErrorInfo(reason="INVALID_FIELD", domain="specpool.v1", metadata={"field": "x"})
    e = error_from_status(grpc.StatusCode.INVALID_ARGUMENT, "bad request", _status(info, bad))
    assert (e.param, e.code) == ("top_p", "invalid_field")
    retry = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=2, nanos=500_000_000))
    e = error_from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "request: full", _status(retry))
    assert e.headers() == {"Retry-After": "3"} and e.code == "resource_exhausted"
    gone = error_details_pb2.ErrorInfo(reason="NO_LIVE_REPLICA", metadata={"field": "model"})
    e = error_from_status(grpc.StatusCode.UNAVAILABLE, "no replica", _status(gone, retry))
    assert (e.status, e.param, e.code, e.headers()) == (503, "model", "no_live_replica", {"Retry-After": "3"})
    chat = error_from_status(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: too many",
                             max_tokens_name="max_completion_tokens")
    assert chat.param == "max_completion_tokens"


@pytest.mark.parametrize("stops, pieces, shown, stopped", [
    (["abc"], ["hello a", "b", "c tail"], ["hello ", "", ""], True),
    (["abc"], ["hello a", "bx", " more"], ["hello ", "abx", " more"], False),
    (["abc", "xyz"], ["ab", "xab", "c"], ["", "abx", ""], True),
    (["\n\n"], ["one\n", "\ntwo"], ["one", ""], True),
    (["END"], ["no stop here"], ["no stop here"], False),
    (["a", "ab"], ["xab"], ["x"], True),  # the first stop string to start wins
])
def test_text_ends_before_the_first_stop_string(stops, pieces, shown, stopped):
    scanner = StopScanner(stops)
    assert [scanner.feed(p) for p in pieces] == shown
    assert scanner.stopped == stopped
    assert scanner.flush() == ""


def test_held_text_is_shown_at_the_end_when_no_stop_string_follows():
    scanner = StopScanner(["abc"])
    assert scanner.feed("xxab") == "xx"
    assert scanner.flush() == "ab" and not scanner.stopped


def test_speculation_statistics_read_as_ratios():
    stats = pb.SpeculationStats(method=pb.SPECULATION_METHOD_NGRAM, target_steps=10, drafted_tokens=20,
                                accepted_tokens=15, mean_accept_len=2.5, cache_hits=3, cache_lookups=4, local=True)
    out = speculation_json(stats)
    assert (out["method"], out["acceptance"], out["hit_ratio"], out["local"]) == ("ngram", 0.75, 0.75, True)
    none = speculation_json(pb.SpeculationStats(method=pb.SPECULATION_METHOD_NONE, target_steps=4))
    assert (none["method"], none["acceptance"], none["hit_ratio"]) == ("none", None, None)
