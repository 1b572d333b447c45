# Over 400 lines: the generators for every field of three services, and the checks run after them.
"""Generated requests against a router, a target and a speculation endpoint (issue 13), real processes: a
Redis registry, a tiny serve-spec with a draft model, two tiny serve-targets attached to it and registered,
and a serve-router. REQUESTS_PER_SERVICE calls go to each of the three, concurrently, with short deadlines:
valid and invalid values of every field, unknown enum values, duplicate ids, raw bytes to every method,
client cancels. Meanwhile REGISTRY_RECORDS registry records are written straight into Redis with its password,
as any member could (issue 38.1): random and adversarial values of every field, missing fields, keys of
the wrong type; every tenth is followed by a GET of the router's /capacity. Beside the fuzz, alpha, another
tenant on the same address (127.0.0.1, as every tenant behind one proxy), sends a greedy request through
the router every ALPHA_EVERY_S: each is served and equals AR. Afterwards:

- no call ended with INTERNAL or UNKNOWN, /capacity always answered 200, and no server logged a traceback;
- the router dropped and counted malformed records of both kinds, and once the fuzzed records expire it
  lists the real members alone;
- every server is alive, answers grpc.health.v1 Check, and a greedy request through the router equals AR;
- nothing leaked: the targets run and queue nothing, the endpoint holds no session once leases expire,
  Redis holds no draft-slot lease, and each server has no more threads than it started with plus a full
  gRPC pool (a pool never shrinks: growing to its size is not a leak; a thread per request would be).

The generator is our own, seeded (random.Random per request from SEED, the service and the request's
index), not hypothesis: hypothesis draws examples one at a time and shrinks a failure by replaying it,
which neither sends 10k requests concurrently nor reproduces against live servers whose state earlier
requests changed. A failure names the service and index; `make_call(service, index)` rebuilds that call.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf import text_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specpool.cluster.processes import ServerProcess, start_server, wait_for
from specpool.cluster.redis_server import start_redis
from specpool.common.registry import Registry
from specpool.common.registry_schema import member_key
from specpool.engine.decoding import generate
from specpool.engine.runtime.gguf_loader import model_name
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.sampling import SamplingParams
from specpool_client import generate_result
from specpool_client.v1 import speculation_pb2 as spec_pb
from specpool_client.v1 import speculation_pb2_grpc, target_pb2_grpc
from specpool_client.v1 import target_pb2 as pb
from tests.cluster.test_disaggregation import start_endpoint, start_target, tiny_files
from tests.pki import channel as secure_channel

SEED = 13
REQUESTS_PER_SERVICE = 10_000
SERVICES = ("target", "router", "endpoint")
CONCURRENCY = 8  # calls in flight per service
ALPHA_EVERY_S = 2.0  # a legitimate tenant's request beside the fuzz, from the same address
FUZZ_BUDGET_S = 240.0  # calls not started by then are counted as skipped, and the test fails
VOCAB = 64
MAX_CONTEXT = 512
MAX_BATCH, MAX_QUEUE = 8, 8
LEASE_S, MAX_LEASE_S = 1.0, 3.0  # the endpoint's idle session leases: the leak check waits them out
LEASE_TTL_S = 5.0  # the router's draft-slot leases in Redis
LOCAL = ["--host", "127.0.0.1"]
THREAD_SLACK = 8  # threads a server may start besides its gRPC pool (client channels, capacity lookups)

INT32 = [-(2**31), -1, 2**31 - 1]
FLOAT_JUNK = [math.nan, math.inf, -math.inf, -1.0, 1e38]
TARGET_API = "/specpool.v1.TargetService/"
SPEC_API = "/specpool.v1.SpeculationService/"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
CLUSTER_CAPACITY = "/specpool.v1.ClusterStateService/GetClusterCapacity"
DUPLICATE_IDS = [f"dup-{i}" for i in range(8)]  # request ids several calls share, at once or not
# The tenants the fuzzer's endpoint requests name in their `tenant` fields. The endpoint goes by the
# caller's certificate (client/fz-a: FUZZER_TENANT) and ignores these fields, so they must be harmless;
# the fuzzer's sessions are fz-a's whatever a request says, and never a target's (t0, t1).
FUZZ_TENANTS = ["fz-a", "fz-b"]
FUZZER_TENANT = "fz-a"
SESSION_IDS = [f"s{i}" for i in range(12)]


# -- the generator ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Call:
    method: str  # "/package.Service/Method"
    kind: str  # unary, stream (server-streaming) or bidi
    request: object  # a message or raw bytes; for bidi a list of them
    timeout_s: float
    cancel_after: int | None = None  # streams: the client cancels after this many responses
    metadata: tuple[tuple[str, str], ...] = ()

    def payload(self):
        def raw(m) -> bytes:
            return m if isinstance(m, bytes) else m.SerializeToString()

        return [raw(m) for m in self.request] if self.kind == "bidi" else raw(self.request)

    def describe(self, limit: int = 600) -> str:
        def one(m) -> str:
            if isinstance(m, bytes):
                return f"bytes {m[:64].hex()}{'...' if len(m) > 64 else ''} ({len(m)} bytes)"
            return f"{type(m).__name__} {{{text_format.MessageToString(m, as_one_line=True)[:limit]}}}"

        body = "; ".join(map(one, self.request)) if self.kind == "bidi" else one(self.request)
        extra = f", cancel after {self.cancel_after}" if self.cancel_after is not None else ""
        return f"{self.method} {body} (timeout {self.timeout_s:g} s{extra}, metadata {list(self.metadata)})"


def pick(rng: random.Random, valid: list, invalid: list, p_invalid: float = 0.15):
    return rng.choice(invalid if invalid and rng.random() < p_invalid else valid)


def text(rng: random.Random) -> str:
    return rng.choice(["", " ", "x" * rng.randint(1, 5000), "é/ü\x00\n\t", "<|im_start|>system",
                       "".join(chr(rng.randint(32, 0xD7FF)) for _ in range(rng.randint(1, 40)))])


def token_ids(rng: random.Random, most: int, empty_ok: bool = False) -> list[int]:
    """Mostly a short run of in-vocabulary ids; else empty, one id out of the vocabulary, about the
    context size, far over it, or (rarely) over the 4 MiB message cap."""
    r = rng.random()
    ids = [rng.randrange(VOCAB) for _ in range(rng.randint(0 if empty_ok else 1, most))]
    if r < 0.8:
        return ids
    if r < 0.85:
        return []
    if r < 0.93:
        bad = rng.choice([*INT32, VOCAB, VOCAB + 1])
        return [*ids[1:], bad] if rng.random() < 0.5 else [bad, *ids[1:]]
    if r < 0.99:
        return [rng.randrange(VOCAB)] * rng.choice([MAX_CONTEXT - 60, MAX_CONTEXT, MAX_CONTEXT + 1, 5000])
    if r < 0.999:
        return [rng.randrange(VOCAB)] * 100_000
    return [1] * 1_100_000


def sampling(rng: random.Random) -> pb.SamplingParams:
    s = pb.SamplingParams(
        temperature=pick(rng, [0.0, 0.0, 0.0, 0.7, 1.0, 2.0], [1e-45, 1e-38, 1e-6, 3.4e38, -0.0, *FLOAT_JUNK], 0.3),
        top_k=pick(rng, [0, 0, 1, 5, VOCAB - 1], [VOCAB, VOCAB + 1, 10**6, *INT32]),
        top_p=pick(rng, [0.0, 0.0, 1.0, 0.9, 0.5], [1e-45, 1e-8, 1.5, *FLOAT_JUNK]),
    )
    if rng.random() < 0.3:
        s.seed = rng.choice([0, 1, 2**64 - 1, rng.getrandbits(64)])
    return s


def generate_request(rng: random.Random, model: str) -> pb.GenerateRequest:
    r = pb.GenerateRequest(
        request_id=rng.choice(["", "", "", rng.choice(DUPLICATE_IDS), rng.choice(DUPLICATE_IDS), text(rng)]),
        model=pick(rng, ["", "", model], ["tiny2", text(rng)]),
        max_tokens=pick(rng, [1, 2, 3, 4], [0, *INT32, MAX_CONTEXT, rng.randint(20, 300)], 0.2),
        n=pick(rng, [0, 1, 1, 2, 4], [MAX_BATCH, MAX_BATCH + 1, 1000, *INT32], 0.1),
        session_id=rng.choice(["", "", "", "sticky", text(rng)]),
        ignore_eos=rng.random() < 0.5,
    )
    which = rng.random()
    if which < 0.85:
        r.prompt_ids.ids.extend(token_ids(rng, 12))
    elif which < 0.9:
        r.prompt = text(rng)
    elif which < 0.95:
        r.messages.messages.add(role=rng.choice(["user", "system", "tool", ""]), content=text(rng))
    # else: no input at all
    r.sampling.CopyFrom(sampling(rng))
    r.speculation.method = pick(rng, [0, 1, 2, 3, 4], [5, 99, *INT32])
    r.speculation.max_draft_tokens = pick(rng, [0, 0, 1, 3, 32], [33, *INT32])
    if rng.random() < 0.2:
        r.stop_token_ids.extend(token_ids(rng, 3))
    if rng.random() < 0.1:
        r.resume_token_ids.extend(token_ids(rng, 6))
    return r


def raw_bytes(rng: random.Random, valid: bytes) -> bytes:
    """Random bytes, or a valid message with some bytes flipped, or cut short."""
    r = rng.random()
    if r < 0.4 or not valid:
        return rng.randbytes(rng.randint(0, 64))
    if r < 0.75:
        out = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(len(out))] = rng.randrange(256)
        return bytes(out)
    return valid[: rng.randrange(len(valid))]


def target_api_call(rng: random.Random, model: str, router: bool) -> Call:
    """A call of the Target API (a target's or the router's), grpc.health.v1, or the router's ClusterStateService."""
    timeout = 10.0
    r = rng.random()
    if r < 0.75:
        request = generate_request(rng, model)
        if request.max_tokens > 4 or rng.random() < 0.1:
            timeout = rng.choice([0.01, 0.05, 0.2, 0.5, 1.0])  # long requests end at their deadline
        metadata = ()
        if router and rng.random() < 0.2:
            # Self-asserted tenants: the router goes by the caller's bearer token and ignores these.
            metadata = (("x-specpool-tenant", rng.choice(["alpha", "", " ", "t" * 200, "fz-a", "t0"])),)
        cancel = rng.choice([1, 2]) if rng.random() < 0.1 else None
        return Call(TARGET_API + "Generate", "stream", request, timeout, cancel, metadata)
    if r < 0.82:
        request_id = rng.choice([*DUPLICATE_IDS, "", text(rng)])
        return Call(TARGET_API + "Cancel", "unary", pb.CancelRequest(request_id=request_id), 5.0)
    if r < 0.86:
        return Call(TARGET_API + "GetInfo", "unary", pb.GetInfoRequest(), 5.0)
    if r < 0.88:
        return Call(HEALTH_CHECK, "unary", health_pb2.HealthCheckRequest(service=rng.choice(["", "readiness", "x"])),
                    5.0)
    if router and r < 0.9:
        return Call(CLUSTER_CAPACITY, "unary", b"", 5.0)
    method, kind = rng.choice([("Generate", "stream"), ("Cancel", "unary"), ("GetInfo", "unary")])
    valid = generate_request(rng, model).SerializeToString() if method.startswith("Generate") else b"\x0a\x03abc"
    return Call(TARGET_API + method, kind, raw_bytes(rng, valid), 5.0)


def endpoint_tenant(rng: random.Random) -> str:
    return pick(rng, FUZZ_TENANTS, ["", " ", "x" * 5000, "é/\x00"], 0.1)


def session_spec(rng: random.Random) -> spec_pb.SessionSpec:
    s = spec_pb.SessionSpec(
        request_id=pick(rng, SESSION_IDS, ["", text(rng)], 0.1),
        context=token_ids(rng, 20),
        drafter=pick(rng, [0, 1, 2, 3], [4, 99, *INT32], 0.1),
        transport=pick(rng, [0, 1, 2], [3, 99, -1], 0.1),
        push=rng.random() < 0.3,
    )
    s.sampling.CopyFrom(sampling(rng))
    return s


def round_request(rng: random.Random) -> spec_pb.RoundsRequest:
    r = spec_pb.RoundsRequest(tenant=endpoint_tenant(rng), round_id=rng.choice([0, 1, rng.getrandbits(64)]))
    for _ in range(rng.randint(0, 4)):
        r.sequences.add(
            request_id=pick(rng, SESSION_IDS, ["", text(rng)], 0.1),
            new_tokens=token_ids(rng, 3, empty_ok=True)[:600],
            num_draft_tokens=pick(rng, [0, 1, 3, 4, 8], [33, *INT32]),
            resolution=pick(rng, [0, 0, 0, 1, 2], [3, 99, -1]),
            drafts_in_use=token_ids(rng, 4, empty_ok=True)[:40] if rng.random() < 0.3 else [],
        )
    return r


def endpoint_call(rng: random.Random, model: str) -> Call:
    r = rng.random()
    if r < 0.3:
        request = spec_pb.OpenSessionsRequest(
            tenant=endpoint_tenant(rng), target_model=pick(rng, [model], ["", "tiny2", text(rng)], 0.1),
            lease_s=pick(rng, [0.0, 0.5, 2.0, 1e9], [1e-300, 5e-324, *FLOAT_JUNK], 0.1),
            sessions=[session_spec(rng) for _ in range(rng.randint(0, 4))],
        )
        return Call(SPEC_API + "OpenSessions", "unary", request, 5.0)
    if r < 0.42:
        ids = [pick(rng, SESSION_IDS, ["", text(rng)], 0.1) for _ in range(rng.randint(0, 6))]
        return Call(SPEC_API + "CloseSessions", "unary",
                    spec_pb.CloseSessionsRequest(tenant=endpoint_tenant(rng), request_ids=ids), 5.0)
    if r < 0.72:
        messages = [round_request(rng) if rng.random() < 0.9 else raw_bytes(rng, round_request(rng).SerializeToString())
                    for _ in range(rng.randint(1, 3))]
        cancel = 1 if rng.random() < 0.1 else None
        return Call(SPEC_API + "Rounds", "bidi", messages, rng.choice([0.05, 2.0, 5.0]), cancel)
    if r < 0.74:
        return Call(SPEC_API + "OpenTensorChannel", "unary",
                    spec_pb.OpenTensorChannelRequest(tenant=endpoint_tenant(rng)), 5.0)
    if r < 0.8:
        return Call(SPEC_API + "GetCapacity", "unary", spec_pb.GetCapacityRequest(), 5.0)
    if r < 0.82:
        return Call(HEALTH_CHECK, "unary", health_pb2.HealthCheckRequest(service=rng.choice(["", "liveness", "x"])),
                    5.0)
    method, kind = rng.choice([("OpenSessions", "unary"), ("CloseSessions", "unary"), ("Rounds", "bidi"),
                               ("OpenTensorChannel", "unary"), ("GetCapacity", "unary")])
    if kind == "bidi":
        return Call(SPEC_API + method, kind, [raw_bytes(rng, round_request(rng).SerializeToString())
                                              for _ in range(rng.randint(1, 2))], 5.0)
    valid = (spec_pb.OpenSessionsRequest(tenant="fz-a", target_model=model, sessions=[session_spec(rng)])
             if method == "OpenSessions" else spec_pb.CloseSessionsRequest(tenant="fz-a", request_ids=["s0"]))
    return Call(SPEC_API + method, kind, raw_bytes(rng, valid.SerializeToString()), 5.0)


# -- registry records ---------------------------------------------------------------------------------

REGISTRY_RECORDS = 10_000
RECORD_TTL_MS = 2000  # a fuzzed record expires soon after it is written, so the live ones stay few
NUMBER_JUNK = ["1e999", "-1e999", "nan", "-nan", "inf", "-inf", "Infinity", "-1", "2.5", "1e308", "0x10", "", " ",
               "9" * 400, "1_000", "\u0661\u0662", "8\x00"]
NAME_JUNK = ["", "x" * 5000, "m\n", "\x00", "é" * 300]
ADDRESS_JUNK = ["", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000", "127.0.0.1:-1", "a b:1", "http://h:1/",
                "x" * 5000 + ":1", "[::1", ":1"]


@dataclass(frozen=True, slots=True)
class Record:
    key: str
    fields: dict[str, str] | None  # None: the key holds another type (wrong_type)
    wrong_type: str = ""


def registry_record(index: int, model: str) -> Record:
    """The index-th fuzzed record. One that would pass serves the fuzzed model on a port where nothing
    listens, so the pool still serves one model (requests naming none stay valid) and a request placed on
    it fails over. Member ids come from a small set, so records overwrite one another."""
    rng = random.Random(f"{SEED}/registry/{index}")
    kind = rng.choice(["target", "endpoint"])
    address = pick(rng, ["127.0.0.1:1", "[::1]:2", "localhost:3"], ADDRESS_JUNK, 0.2)
    member_id = pick(rng, [address if kind == "target" else f"fz-ep-{rng.randrange(4)}"],
                     [*NAME_JUNK[1:], "other:1"], 0.05)
    tenant = pick(rng, ["", "fz-a", "t0"], NAME_JUNK[1:], 0.1)
    # Mostly the key its fields name; else another tenant's (a target claiming to be another tenant's).
    key = member_key("specpool", kind, member_id, tenant if rng.random() < 0.95 else rng.choice(["", "t1", "fz-b"]))
    if rng.random() < 0.04:
        return Record(key, None, rng.choice(["string", "list", "set", "zset"]))

    def count() -> str:
        return pick(rng, ["0", "1", "8", "16", "8.0"], NUMBER_JUNK, 0.3)

    def fraction() -> str:
        return pick(rng, ["0", "0.5", "1"], [*NUMBER_JUNK, "1.5"], 0.3)

    def speedup() -> str:
        return pick(rng, ["0.8", "1.0", "1.6"], NUMBER_JUNK, 0.3)

    common = {"id": lambda: member_id, "address": lambda: address,
              "updated": lambda: pick(rng, [f"{time.time():.3f}"], NUMBER_JUNK, 0.2)}
    if kind == "target":
        makers = {**common, "model": lambda: pick(rng, [model], NAME_JUNK, 0.1),
                  "tenant": lambda: tenant,
                  "max_batch": count, "running": count, "queued": count,
                  "spec_endpoint": lambda: pick(rng, ["", "127.0.0.1:1"], ADDRESS_JUNK[1:], 0.2),
                  "mean_accept_len": speedup, "predicted_speedup_draft": speedup, "predicted_speedup_ngram": speedup,
                  "methods": lambda: pick(rng, ["ngram", "draft_model,ngram", "ssd,draft_model,ngram"],
                                          ["teleport", "ngram,,,", ",".join(["ngram"] * 200), "x" * 5000], 0.3)}
    else:
        makers = {**common, "models": lambda: pick(rng, [model, f"{model},other"],
                                                   [",".join(["m"] * 500), "x" * 100_000, "m\t"], 0.2),
                  "max_sessions": count, "active_sessions": count, "draft_busy_ratio": fraction,
                  "acceptance": fraction, "hit_ratio": fraction}
    fields = {name: make() for name, make in makers.items() if rng.random() < 0.92}  # some go missing
    if rng.random() < 0.05:
        fields["id"] = "someone-else:1"  # a record that claims another member's id
    if rng.random() < 0.05:
        fields["future_field"] = text(rng)
    return Record(key, fields)


def write_record(client, record: Record) -> None:
    """As a member holding the password could: the record, with a short TTL."""
    key = record.key
    with client.pipeline(transaction=True) as pipe:
        pipe.delete(key)
        if record.fields:
            pipe.hset(key, mapping=record.fields)
        elif record.wrong_type:
            {"string": lambda: pipe.set(key, "junk"), "list": lambda: pipe.rpush(key, "junk"),
             "set": lambda: pipe.sadd(key, "junk"), "zset": lambda: pipe.zadd(key, {"junk": 1.0})}[record.wrong_type]()
        pipe.pexpire(key, RECORD_TTL_MS)
        pipe.execute()


def listed_members(router: ServerProcess) -> tuple[set[str], set[str]]:
    """The target and endpoint ids the router's /capacity lists."""
    with urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/capacity", timeout=10) as reply:
        data = json.load(reply)
    return {t["id"] for p in data["pools"] for t in p["targets"]}, {e["id"] for e in data["endpoints"]}


def capacity_status(router: ServerProcess) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/capacity", timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code


def make_call(service: str, index: int, model: str = "tiny") -> Call:
    """The index-th generated call to a service: the same for the same SEED, whatever ran before."""
    rng = random.Random(f"{SEED}/{service}/{index}")
    if service == "endpoint":
        return endpoint_call(rng, model)
    return target_api_call(rng, model, router=service == "router")


def send(channel: grpc.Channel, call: Call) -> tuple[grpc.StatusCode, str]:
    """-> the call's status: OK, the server's code, or CANCELLED where the client cancelled it."""
    try:
        if call.kind == "unary":
            channel.unary_unary(call.method)(call.payload(), timeout=call.timeout_s, metadata=call.metadata)
            return grpc.StatusCode.OK, ""
        if call.kind == "stream":
            responses = channel.unary_stream(call.method)(call.payload(), timeout=call.timeout_s,
                                                          metadata=call.metadata)
        else:
            responses = channel.stream_stream(call.method)(iter(call.payload()), timeout=call.timeout_s,
                                                           metadata=call.metadata)
        for count, _ in enumerate(responses, 1):
            if count == call.cancel_after:
                responses.cancel()
                return grpc.StatusCode.CANCELLED, "cancelled by the client"
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


# -- the cluster ------------------------------------------------------------------------------------


def threads(server: ServerProcess) -> int:
    with open(f"/proc/{server.proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def keep_logs(server: ServerProcess) -> ServerProcess:
    """Keeps the whole log (the launcher keeps 200 lines): a traceback early in the fuzz must not scroll away."""
    server.log_tail = deque(server.log_tail, maxlen=200_000)
    return server


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    gguf, draft = tiny_files(tmp_path_factory.mktemp("fuzz"), vocab=VOCAB, seed=17, max_context=MAX_CONTEXT)
    redis = start_redis()
    servers: list[ServerProcess] = []
    try:
        servers.append(keep_logs(start_endpoint(
            gguf, draft, *LOCAL, "--redis", redis.url, "--lease-s", str(LEASE_S), "--max-lease-s", str(MAX_LEASE_S),
            "--max-len", str(MAX_CONTEXT), "--max-sessions", "48", "--max-round-streams", "16",
            "--batch-window-ms", "0")))
        endpoint = servers[0]
        with ThreadPoolExecutor(3) as pool:
            started = [pool.submit(start_target, gguf, endpoint, f"t{i}", *LOCAL, "--redis", redis.url,
                                   "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE),
                                   "--max-context", str(MAX_CONTEXT), "--draft-tokens", "3",
                                   "--spec-deadline-ms", "300") for i in range(2)]
            started.append(pool.submit(start_server, "router", [
                "serve-router", "--port", "0", "--metrics-port", "0", *LOCAL, "--redis", redis.url,
                "--lease-ttl-s", str(LEASE_TTL_S), "--max-in-flight", "32"]))
            for future in started:
                servers.append(keep_logs(future.result()))
        registry = Registry(redis.url)
        wait_for(lambda: len(registry.targets()) == 2 and len(registry.endpoints()) == 1)
        yield {"gguf": gguf, "redis": redis, "registry": registry, "endpoint": endpoint, "targets": servers[1:3],
               "router": servers[3], "started_threads": {s.name: threads(s) for s in servers}}
        registry.close()
    finally:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(ServerProcess.stop, servers))
        redis.close()


ROLES = {"spec": "endpoint", "router": "router"}  # server name -> role; the rest are targets


def connect(server: ServerProcess) -> grpc.Channel:
    """The fuzzer's channel to a server: client/fz-a's certificate, and fz-a's bearer token (the
    router's tenant of every fuzzed call, whatever x-specpool-tenant it also sends)."""
    return secure_channel(server.address, ROLES.get(server.name, "target"), tenant=FUZZER_TENANT)


def idle(target: ServerProcess) -> bool:
    """Whether a target runs and queues nothing."""
    with connect(target) as channel:
        info = target_pb2_grpc.TargetServiceStub(channel).GetInfo(pb.GetInfoRequest(), timeout=5)
    return info.active_sequences == 0 and info.queued_requests == 0


def pool_size(server: ServerProcess) -> int:
    """The most threads its gRPC server pool may grow to (specpool.common.serving.build_server)."""
    from specpool.common.serving import CONTROL_WORKERS

    admitted = {"spec": 16, "router": 32}.get(server.name, MAX_BATCH + MAX_QUEUE)
    return admitted + CONTROL_WORKERS


# -- the test -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_generated_requests_never_get_internal_and_leak_nothing(cluster):
    model = model_name(cluster["gguf"])
    server_of = {"target": cluster["targets"][0], "router": cluster["router"], "endpoint": cluster["endpoint"]}
    channels = {s: connect(server) for s, server in server_of.items()}
    servers = [cluster["endpoint"], *cluster["targets"], cluster["router"]]
    before = {s.name: threads(s) for s in servers}

    codes = {s: Counter() for s in SERVICES}
    offenders: list[tuple[str, int, grpc.StatusCode, str]] = []
    skipped = Counter()
    seconds: dict[str, float] = {}  # service -> when its last call ended
    lock = threading.Lock()
    start = time.monotonic()
    stop_at = start + FUZZ_BUDGET_S

    poisoner, router = cluster["registry"].client, cluster["router"]
    real = listed_members(router)  # what the fuzzed records must not change once they expire
    assert real == ({t.address for t in cluster["targets"]}, {cluster["registry"].endpoints()[0].id})
    capacity_codes: Counter = Counter()

    def poison(index: int) -> None:
        write_record(poisoner, registry_record(index, model))
        if index % 10 == 0:
            status = capacity_status(router)
            with lock:
                capacity_codes[status] += 1
                if status != 200:
                    offenders.append(("registry", index, grpc.StatusCode.UNKNOWN, f"/capacity answered {status}"))

    def run(job: tuple[str, int]) -> None:
        service, index = job
        if time.monotonic() > stop_at:
            with lock:
                skipped[service] += 1
            return
        if service == "registry":
            poison(index)
            return
        code, details = send(channels[service], make_call(service, index, model))
        with lock:
            codes[service][code.name] += 1
            if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                offenders.append((service, index, code, details))
            seconds[service] = time.monotonic() - start

    # Alpha, another tenant on the fuzzer's address (issue 52.1: behind a proxy every tenant has one), asks the
    # router for a greedy request every ALPHA_EVERY_S while the fuzz runs: each must be served, and right.
    prompt = [5, 6, 7, 8, 5, 6, 7]
    tiny, _ = Llama.from_gguf(cluster["gguf"], dtype="fp32", device="cpu")
    [want] = generate(tiny, [prompt], SamplingParams(), 24, stop_ids=[])
    fuzzing = threading.Event()
    alpha_results: list[str] = []

    def alpha() -> None:
        with secure_channel(router.address, "router", tenant="alpha") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            while not fuzzing.wait(ALPHA_EVERY_S):
                try:
                    result = generate_result(stub, pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=prompt),
                                                                      max_tokens=24, ignore_eos=True), timeout=30)
                    alpha_results.append("equal" if list(result.completions[0].token_ids) == want.token_ids
                                         else f"differs: {list(result.completions[0].token_ids)}")
                except grpc.RpcError as e:
                    alpha_results.append(f"{e.code().name}: {e.details()}")

    # Interleaved, so the three services and the registry are fuzzed at once (the router's calls reach both targets).
    counts = {**dict.fromkeys(SERVICES, REQUESTS_PER_SERVICE), "registry": REGISTRY_RECORDS}
    jobs = [(s, i) for i in range(max(counts.values())) for s in counts if i < counts[s]]
    beside = threading.Thread(target=alpha, name="alpha", daemon=True)
    beside.start()
    with ThreadPoolExecutor(CONCURRENCY * len(SERVICES)) as pool:
        list(pool.map(run, jobs))
    fuzzing.set()
    beside.join(60)
    elapsed = time.monotonic() - start
    for service in SERVICES:
        print(f"{service}: {sum(codes[service].values())} calls in {seconds.get(service, elapsed):.0f} s "
              f"(seed {SEED}): {dict(codes[service].most_common())}")

    print(f"registry: {REGISTRY_RECORDS} records written, /capacity answered {dict(capacity_codes)}")
    print(f"alpha, on the fuzzer's address: {dict(Counter(alpha_results))}")
    shown = "\n".join(f"  {service} #{index}: {code.name} {details[:300]!r}\n    {make_call(service, index, model).describe()}"
                      for service, index, code, details in offenders[:5])
    assert not offenders, f"{len(offenders)} calls got INTERNAL or UNKNOWN (seed {SEED}); the first:\n{shown}"
    assert not skipped, f"calls not sent within {FUZZ_BUDGET_S:.0f} s: {dict(skipped)}"
    assert len(alpha_results) >= 5 and set(alpha_results) == {"equal"}, Counter(alpha_results)
    for service in SERVICES:
        assert codes[service]["OK"] > REQUESTS_PER_SERVICE // 20, f"{service}: too few valid calls to mean much"
        # The fuzzer's credentials are valid: no field or header it makes up may cost it its identity.
        assert not codes[service]["UNAUTHENTICATED"], f"{service}: {codes[service]['UNAUTHENTICATED']} refused"

    # Alive, serving, and still right.
    for server in servers:
        assert server.alive(), f"{server.name} exited with {server.proc.returncode}:\n{server.logs()[-5000:]}"
        with connect(server) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING, server.name
    tracebacks = {s.name: s.logs().split("Traceback", 1)[1][:3000] for s in servers if "Traceback" in s.logs()}
    for kind in ("target", "endpoint"):
        assert router.metric_total("specpool_router_registry_records_dropped_total", kind=kind) > 0, kind
    # Both views: the router's listing can match while a well-formed fuzzed record still waits out its TTL.
    wait_for(lambda: listed_members(router) == real and {e.id for e in cluster["registry"].endpoints()} == real[1],
             timeout_s=RECORD_TTL_MS / 1000 + 10)
    assert not tracebacks, "servers logged tracebacks:\n" + "\n".join(f"{n}: {t}" for n, t in tracebacks.items())
    result = generate_result(target_pb2_grpc.TargetServiceStub(channels["router"]), pb.GenerateRequest(
        prompt_ids=pb.TokenIds(ids=prompt), max_tokens=24, ignore_eos=True), timeout=30)
    assert list(result.completions[0].token_ids) == want.token_ids

    # Nothing held: slots, sessions (once their leases run out), Redis leases, threads.
    for target in cluster["targets"]:
        wait_for(lambda t=target: idle(t), timeout_s=20)
    spec = speculation_pb2_grpc.SpeculationServiceStub(channels["endpoint"])
    wait_for(lambda: spec.GetCapacity(spec_pb.GetCapacityRequest(), timeout=5).active_sessions == 0,
             timeout_s=MAX_LEASE_S + 10)
    [endpoint_id] = real[1]
    wait_for(lambda: not sum(cluster["registry"].held(endpoint_id).values()), timeout_s=LEASE_TTL_S + 10)
    ceiling = {s.name: cluster["started_threads"][s.name] + pool_size(s) + THREAD_SLACK for s in servers}

    def settled() -> bool:
        return all(threads(s) <= ceiling[s.name] for s in servers)

    try:
        wait_for(settled, timeout_s=45)
    finally:
        print("threads at start / before the fuzz / after / ceiling: " + ", ".join(
            f"{s.name} {cluster['started_threads'][s.name]}/{before[s.name]}/{threads(s)}/{ceiling[s.name]}"
            for s in servers))
    for channel in channels.values():
        channel.close()
