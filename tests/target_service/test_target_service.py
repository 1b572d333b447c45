"""The target service as a separate process, on a tiny model written to a real GGUF file.

Without an endpoint it drafts with its local n-gram index; greedy outputs must equal in-process AR.
It serves mutual TLS as target/t1; the tests call it with client certificates from the tests' CA
(client/tester, and client/other where a second caller is needed).
"""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import pytest

from specpool.cluster.processes import start_server, wait_for
from specpool.engine.decoding import generate
from specpool.engine.runtime.config import tiny_config
from specpool.engine.runtime.gguf_loader import save_gguf
from specpool.engine.runtime.model import Llama, random_weights
from specpool.engine.verification.sampling import SamplingParams
from specpool_client import generate_result
from specpool_client.v1 import target_pb2 as pb
from specpool_client.v1 import target_pb2_grpc
from tests.pki import channel

# Room for long streams: a cancelled one must still be running seconds after its first delta.
MAX_CONTEXT = 4096
CONFIG = replace(tiny_config(vocab_size=64), max_context=MAX_CONTEXT)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return save_gguf(tmp_path_factory.mktemp("models") / "tiny.gguf", CONFIG, random_weights(CONFIG, seed=3))


@pytest.fixture(scope="module")
def target(tiny_gguf):
    server = start_server("target", [
        "serve-target", "--model", str(tiny_gguf), "--port", "0", "--metrics-port", "0", "--threads", "1",
        "--draft-tokens", "3", "--max-batch", "8", "--max-context", str(MAX_CONTEXT), "--datastore", "", "--tenant", "t1",
    ])
    yield server
    assert server.stop() == 0, server.logs()


@pytest.fixture(scope="module")
def stub(target):
    with channel(target.address, "target", "t1") as ch:
        yield target_pb2_grpc.TargetServiceStub(ch)


@pytest.fixture(scope="module")
def other(target):
    """Another caller (client/other): its request ids are its own."""
    with channel(target.address, "target", "t1", tenant="other") as ch:
        yield target_pb2_grpc.TargetServiceStub(ch)


PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10], [12, 13], [3, 4, 5, 6, 7, 8, 9, 10, 3, 4]]


def _request(ids, max_tokens=24, stop=(0,), **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=ids), max_tokens=max_tokens, stop_token_ids=stop, **kw)


def test_concurrent_streams_equal_in_process_ar(stub, tiny_gguf):
    model, _ = Llama.from_gguf(tiny_gguf, dtype="fp32", device="cpu")
    expected = [r.token_ids for r in generate(model, PROMPTS, SamplingParams(), 24, stop_ids=[0])]

    def run(ids):
        deltas, final = [], None
        for msg in stub.Generate(_request(ids)):
            if msg.HasField("delta"):
                deltas.extend(msg.delta.token_ids)
            else:
                final = msg.final
        return deltas, final

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(run, PROMPTS * 2))
    for (deltas, final), want in zip(outs, expected * 2):
        assert deltas == list(final.completions[0].token_ids) == want
        assert final.usage.completion_tokens == len(want)
        assert final.completions[0].speculation.target_steps >= 1


def test_unary_and_n_completions(stub):
    result = generate_result(stub, _request(PROMPTS[0], max_tokens=8, n=3,
                                         sampling=pb.SamplingParams(temperature=1.0, seed=7)))
    assert [c.index for c in result.completions] == [0, 1, 2]
    assert all(len(c.token_ids) >= 1 for c in result.completions)
    assert result.usage.completion_tokens == sum(len(c.token_ids) for c in result.completions)


def _not_found(cancel) -> bool:
    with pytest.raises(grpc.RpcError) as err:
        cancel()
    return err.value.code() == grpc.StatusCode.NOT_FOUND


def test_cancel_stops_a_running_stream(stub, other):
    # No stop token, EOS ignored: uncancelled, the stream runs to its 4000 tokens, about 3 s on this model
    # (measured with Cancel made a no-op), while Cancel lands within milliseconds of the first delta.
    # A stream that is not stopped ends with "length"; Cancel of an id that is not running (done, or
    # another caller's) is NOT_FOUND.
    max_tokens = 4000  # fits: MAX_CONTEXT less the prompt and the 33 positions kept for drafts
    stream = stub.Generate(_request(PROMPTS[1], max_tokens=max_tokens, stop=(), ignore_eos=True,
                                    request_id="to-cancel"))
    first = next(stream)
    assert first.HasField("delta")
    assert _not_found(lambda: other.Cancel(pb.CancelRequest(request_id="to-cancel"))), "not the other caller's"
    assert stub.Cancel(pb.CancelRequest(request_id="to-cancel")).cancelled
    received, final = list(first.delta.token_ids), None
    for msg in stream:
        if msg.HasField("delta"):
            received.extend(msg.delta.token_ids)
        else:
            final = msg.final
    assert final is not None and final.completions[0].finish_reason == pb.FINISH_REASON_CANCELLED
    assert list(final.completions[0].token_ids) == received and len(received) < max_tokens
    assert _not_found(lambda: stub.Cancel(pb.CancelRequest(request_id="to-cancel"))), "done: nothing to cancel"


def test_request_ids_are_each_callers_own(stub, other):
    """A running id is ALREADY_EXISTS for its own caller only; another caller's request of the same id
    is another request, which Cancel by the first caller leaves running."""
    long = _request(PROMPTS[0], max_tokens=4000, stop=(), ignore_eos=True, request_id="shared-id")
    mine = stub.Generate(long)
    try:
        assert next(mine).HasField("delta")
        with pytest.raises(grpc.RpcError) as err:
            generate_result(stub, long, timeout=30)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        theirs = other.Generate(long)
        try:
            assert next(theirs).HasField("delta"), "the same id, another caller: served"
            assert stub.Cancel(pb.CancelRequest(request_id="shared-id")).cancelled
            finals = [m.final for m in mine if m.HasField("final")]
            assert [f.completions[0].finish_reason for f in finals] == [pb.FINISH_REASON_CANCELLED]
            assert next(theirs).HasField("delta"), "the other caller's request still runs"
            assert other.Cancel(pb.CancelRequest(request_id="shared-id")).cancelled
            finals = [m.final for m in theirs if m.HasField("final")]
            assert [f.completions[0].finish_reason for f in finals] == [pb.FINISH_REASON_CANCELLED]
        finally:
            theirs.cancel()
    finally:
        mine.cancel()


@pytest.mark.parametrize(("request_", "code", "field"), [
    (pb.GenerateRequest(max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (_request([]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids"),
    (_request([1, 64]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids"),
    (_request([1, 2], max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (_request([1, 2], max_tokens=10**6), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (_request([1, 2], sampling=pb.SamplingParams(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.temperature"),
    (_request([1, 2], model="no-such-model"), grpc.StatusCode.NOT_FOUND, "model"),
    (pb.GenerateRequest(prompt="hello", max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
])
def test_bad_input_names_the_field_and_the_server_keeps_serving(stub, request_, code, field):
    with pytest.raises(grpc.RpcError) as err:
        generate_result(stub, request_)
    assert err.value.code() == code
    assert err.value.details().startswith(f"{field}:"), err.value.details()
    assert generate_result(stub, _request([1, 2], max_tokens=2)).usage.completion_tokens >= 1


def test_oversized_message_is_refused(stub):
    with pytest.raises(grpc.RpcError) as err:
        generate_result(stub, _request([1] * (5 * 1024 * 1024), max_tokens=1))  # over the 4 MiB limit
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_health_and_metrics(target, stub):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with channel(target.address, "target", "t1") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "liveness", "readiness"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
    for probe in ("livez", "readyz", "healthz"):  # plain HTTP on the metrics port, for kubelets
        with urllib.request.urlopen(f"http://127.0.0.1:{target.metrics_port}/{probe}", timeout=5) as reply:
            assert (reply.status, reply.read()) == (200, b"ok"), probe
    text = urllib.request.urlopen(f"http://127.0.0.1:{target.metrics_port}/metrics").read().decode()
    assert "specpool_target_generated_tokens_total" in text
    assert "specpool_target_time_to_first_token_seconds_bucket" in text


def test_a_resumed_request_continues_after_the_tokens_it_was_given(stub, tiny_gguf):
    """resume_token_ids, as a router sends them when it moves a stream off a failed replica: greedy, the
    stream continues with exactly AR's remaining tokens, and the final completion holds all of them."""
    model, _ = Llama.from_gguf(tiny_gguf, dtype="fp32", device="cpu")
    prompt, total, k = PROMPTS[3], 24, 10
    [ar] = generate(model, [prompt], SamplingParams(), total, stop_ids=[0])
    want = ar.token_ids
    assert len(want) > k, "the tiny model stops too early for this prompt"
    resumed = _request(prompt, max_tokens=total - k, resume_token_ids=want[:k])
    deltas, finals = [], []
    for msg in stub.Generate(resumed):
        if msg.HasField("delta"):
            deltas.extend(msg.delta.token_ids)
        else:
            finals.append(msg.final)
    [final] = finals
    assert deltas == want[k:], "only the new tokens stream"
    assert list(final.completions[0].token_ids) == want
    assert final.usage.completion_tokens == len(want) and final.usage.prompt_tokens == len(prompt)
    assert list(generate_result(stub, resumed).completions[0].token_ids) == want
    with pytest.raises(grpc.RpcError) as err:
        generate_result(stub, _request(prompt, max_tokens=4, n=2, resume_token_ids=want[:k]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("resume_token_ids:"), err.value.details()
    # A replica that died between a stop token and its final: the continuation is already complete.
    stopped = generate_result(stub, _request(prompt, max_tokens=4, stop=(want[k - 1],), resume_token_ids=want[:k]))
    assert list(stopped.completions[0].token_ids) == want[:k]
    assert stopped.completions[0].finish_reason == pb.FINISH_REASON_STOP


def test_every_request_is_counted_by_outcome_one_that_expires_queued_included(target, stub):
    """One request of n=8 fills the batch (--max-batch 8); the next waits in the queue until its
    deadline passes: counted as expired, not cancelled. Refusals the scheduler never saw count too."""
    def counted(outcome: str) -> float:
        return target.metric_total("specpool_target_requests_total", outcome=outcome)

    before = {o: counted(o) for o in ("expired", "cancelled", "invalid", "not_found")}
    batch = stub.Generate(_request(PROMPTS[0], max_tokens=4000, stop=(), ignore_eos=True, n=8), timeout=60)
    try:
        assert next(batch).HasField("delta")
        with pytest.raises(grpc.RpcError) as err:
            generate_result(stub, _request(PROMPTS[2], max_tokens=4), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: counted("expired") == before["expired"] + 1, timeout_s=30)
    finally:
        batch.cancel()
    wait_for(lambda: counted("cancelled") == before["cancelled"] + 1, timeout_s=30)
    for bad in (_request([1, 2], max_tokens=0), _request([1, 2], model="no-such-model")):
        with pytest.raises(grpc.RpcError):
            generate_result(stub, bad)
    assert (counted("invalid"), counted("not_found")) == (before["invalid"] + 1, before["not_found"] + 1)


def test_the_shipped_datastore_drafts_for_the_default_model_alone():
    """The shipped n-gram datastore holds SmolLM2's token ids: a Qwen target started without --datastore had
    loaded it and drafted other tokens' ids from it. Another model gets none unless one is named."""
    from specpool.common.model_args import DEFAULT_DATASTORE
    from specpool.target_service.server import local_datastore

    assert local_datastore(None, None) == DEFAULT_DATASTORE
    assert local_datastore("qwen2.5-coder-1.5b.gguf", None) == ""
    assert local_datastore("qwen2.5-coder-1.5b.gguf", "qwen.npz") == "qwen.npz"
    assert local_datastore(None, "") == ""
