"""A bounded soak of the default local cluster (issue 13): mixed traffic for N minutes through the
router, with cancels, deadlines, bad requests, one endpoint restart and one target restart.

    python -m specpool.bench.soak --minutes 30 --json bench/results/soak.json

The cluster is `make run`'s as it was before the Qwen2.5-Coder pair (cluster/examples/smollm2.yaml: Redis, a
router, two targets of the real SmolLM2-135M, one endpoint with its draft model), on free ports. Client threads send requests
drawn from a seeded generator:

- greedy (every speculation method): the output must equal AR of the same prompt (computed here
  in-process first); a divergence at a top-2 logit gap under bench.runner.NEAR_TIE is rounding and
  counted apart;
- sampled (temperature 0.8): must complete;
- cancelled after a few tokens, and with a deadline shorter than the request: must end CANCELLED /
  DEADLINE_EXCEEDED (or OK), and what streamed must be a prefix of AR;
- bad (a negative temperature, top_p above 1, an unknown method): must get INVALID_ARGUMENT.

Anything else is a lost request. At a third of the run the endpoint is SIGKILLed and restarted on
its port; at two thirds, a target. Every server's RSS is sampled every 30 s; growth is measured from
a warm-up point (2 minutes after start or restart) to the end. At the end the cluster must hold no
slots, sessions or leases. Exit status 0 when everything held, 1 when not.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from specpool.bench.runner import NEAR_TIE, first_divergence_gap
from specpool.bench.workloads import load_workload
from specpool.cluster.config import SMOLLM2_CONFIG, ClusterConfig
from specpool.cluster.launcher import Cluster
from specpool.cluster.processes import ServerProcess
from specpool.common.machine import machine_info, machine_line
from specpool.common.registry import Registry
from specpool.common.speculation import method_to_pb, sampling_to_pb
from specpool.engine.decoding import generate
from specpool.engine.method import Method
from specpool.engine.runtime.gguf_loader import default_model_path
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.sampling import SamplingParams
from specpool_client.v1 import speculation_pb2 as spec_pb
from specpool_client.v1 import speculation_pb2_grpc, target_pb2_grpc
from specpool_client.v1 import target_pb2 as pb

METHODS = [None, Method.NONE, Method.DRAFT_MODEL, Method.NGRAM, Method.SSD]  # None: AUTO, the router plans
UNKNOWN_METHOD = 99
KINDS = {"greedy": 6, "sampled": 2, "cancel": 1, "deadline": 1, "bad": 1}  # relative frequency
MAX_TOKENS = 48
RSS_EVERY_S = 30.0
WARM_S = 120.0
RSS_GROWTH_LIMIT = 0.10
EXPECTED = {  # kind -> the outcomes that are not a lost request
    "greedy": {"OK"}, "sampled": {"OK"}, "cancel": {"CANCELLED", "OK"}, "deadline": {"DEADLINE_EXCEEDED", "OK"},
    "bad": {"INVALID_ARGUMENT"},
}


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # (kind, code)
    lost: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)  # greedy tokens that differ from AR (not near ties)
    near_ties: int = 0
    tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class Soak:
    def __init__(self, cluster: Cluster, model: Llama, prompts: list[list[int]], refs: list[list[int]],
                 seconds: float, clients: int, seed: int):
        self.cluster, self.model, self.prompts, self.refs = cluster, model, prompts, refs
        self.seconds, self.clients, self.seed = seconds, clients, seed
        self.stub = target_pb2_grpc.TargetServiceStub(cluster.router_channel("alpha"))
        self.tally = Tally()
        self.rss: dict[str, list[tuple[float, int]]] = {}
        self.restarts: dict[str, float] = {}  # server name -> when it was restarted (s into the run)
        self.start = 0.0

    # -- one request --------------------------------------------------------------------------------

    def request(self, rng: random.Random) -> None:
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        i = rng.randrange(len(self.prompts))
        max_tokens = rng.choice([8, 24, MAX_TOKENS])
        method = method_to_pb(rng.choice(METHODS))
        req = pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=self.prompts[i]), max_tokens=max_tokens,
                                 speculation=pb.SpeculationPreference(method=method))
        timeout = 120.0
        if kind == "sampled":
            req.sampling.CopyFrom(sampling_to_pb(SamplingParams(temperature=0.8, seed=rng.randrange(2**32))))
        elif kind == "deadline":
            timeout = rng.uniform(0.05, 1.0)
        elif kind == "bad":
            which = rng.randrange(3)
            if which == 0:
                req.sampling.temperature = -1.0
            elif which == 1:
                req.sampling.top_p = 1.5
            else:
                req.speculation.method = method = UNKNOWN_METHOD
        tokens: list[int] = []
        call = self.stub.Generate(req, timeout=timeout)
        code = "OK"
        try:
            for msg in call:
                if msg.HasField("delta"):
                    tokens += msg.delta.token_ids
                    if kind == "cancel" and len(tokens) >= 3:
                        call.cancel()
        except grpc.RpcError as e:
            code = e.code().name
        want = self.refs[i][:max_tokens]
        label = method if method == UNKNOWN_METHOD else pb.SpeculationMethod.Name(method)
        what = f"{kind} prompt {i} max_tokens {max_tokens} {label}"
        with self.tally.lock:
            self.tally.outcomes[(kind, code)] += 1
            self.tally.tokens += len(tokens)
            if code not in EXPECTED[kind]:
                self.tally.lost.append(f"{what}: {code} after {len(tokens)} tokens")
            elif kind != "sampled" and kind != "bad":
                complete = code == "OK" and kind == "greedy"
                if tokens != (want if complete else want[: len(tokens)]):
                    if first_divergence_gap(self.model, self.prompts[i], want, tokens) < NEAR_TIE:
                        self.tally.near_ties += 1
                    else:
                        self.tally.wrong.append(f"{what}: {tokens} != AR {want}")

    def client(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        while time.monotonic() - self.start < self.seconds:
            self.request(rng)

    # -- faults, memory, progress -------------------------------------------------------------------

    def servers(self) -> dict[str, ServerProcess]:
        return {s.name: s for s in self.cluster.servers()}

    def watch(self, stop: threading.Event) -> None:
        """RSS every RSS_EVERY_S, a progress line every minute, the two restarts on schedule."""
        faults = [(self.seconds / 3, next(iter(self.cluster.endpoints.values()))),
                  (2 * self.seconds / 3, list(self.cluster.targets.values())[-1])]
        last_line = last_rss = -RSS_EVERY_S
        while not stop.wait(1.0):
            now = time.monotonic() - self.start
            if faults and now >= faults[0][0]:
                _, server = faults.pop(0)
                print(f"[{now:6.0f} s] {server.name}: SIGKILL and restart on port {server.port}", flush=True)
                server.restart()
                self.restarts[server.name] = time.monotonic() - self.start
                print(f"[{time.monotonic() - self.start:6.0f} s] {server.name}: serving again", flush=True)
            if now - last_rss >= RSS_EVERY_S:
                last_rss = now
                for name, server in self.servers().items():
                    self.rss.setdefault(name, []).append((now, rss_bytes(server.proc.pid)))
                if self.cluster.redis is not None:
                    self.rss.setdefault("redis", []).append((now, rss_bytes(self.cluster.redis.proc.pid)))
            if now - last_line >= 60.0 and self.rss:
                last_line = now
                with self.tally.lock:
                    done = sum(self.tally.outcomes.values())
                    print(f"[{now:6.0f} s] {done} requests, {self.tally.tokens} tokens, {len(self.tally.lost)} lost, "
                          f"{len(self.tally.wrong)} wrong; RSS MB: "
                          + ", ".join(f"{n} {s[-1][1] / 2**20:.0f}" for n, s in self.rss.items()), flush=True)

    def run(self) -> None:
        self.start = time.monotonic()
        stop = threading.Event()
        watcher = threading.Thread(target=self.watch, args=(stop,), daemon=True)
        watcher.start()
        clients = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(self.clients)]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        stop.set()
        watcher.join()

    # -- verdict --------------------------------------------------------------------------------------

    def rss_growth(self) -> dict[str, float]:
        """Per server: last RSS over the RSS at its warm-up point (WARM_S after start or restart)."""
        growth = {}
        for name, series in self.rss.items():
            warm = self.restarts.get(name, 0.0) + WARM_S
            after = [rss for t, rss in series if t >= warm]
            if len(after) >= 2:
                growth[name] = after[-1] / after[0] - 1
        return growth

    def leftovers(self, timeout_s: float = 60.0) -> dict[str, int]:
        """Slots, queued requests, endpoint sessions and Redis leases still held once traffic stopped
        (sessions and leases may need their lease time to run out)."""
        registry = Registry(self.cluster.redis_url)
        end = time.monotonic() + timeout_s
        while True:
            held = {}
            for name, target in self.cluster.targets.items():
                with self.cluster.operator_credentials().channel(target.address, "target", name) as channel:
                    info = target_pb2_grpc.TargetServiceStub(channel).GetInfo(pb.GetInfoRequest(), timeout=5)
                held[f"{name} sequences"] = info.active_sequences + info.queued_requests
            for name, endpoint in self.cluster.endpoints.items():
                with self.cluster.operator_credentials().channel(endpoint.address, "endpoint", name) as channel:
                    cap = speculation_pb2_grpc.SpeculationServiceStub(channel).GetCapacity(
                        spec_pb.GetCapacityRequest(), timeout=5)
                held[f"{name} sessions"] = cap.active_sessions
            for e in registry.endpoints():
                held[f"{e.id} leases"] = sum(registry.held(e.id).values())
            if not any(held.values()) or time.monotonic() > end:
                registry.close()
                return held
            time.sleep(1.0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="how long the traffic runs")
    p.add_argument("--clients", type=int, default=6, help="concurrent client threads")
    p.add_argument("--prompts", type=int, default=16, help="HumanEval prompts to draw from")
    p.add_argument("--seed", type=int, default=13, help="seed of the clients' request mix")
    p.add_argument("--json", type=Path, default=None,
                   help="write the report here too (printed without the RSS samples)")
    return p


def main() -> int:
    args = build_parser().parse_args()

    print(machine_line(), flush=True)
    config = ClusterConfig.load(SMOLLM2_CONFIG).with_free_ports()
    # References in the targets' dtype (bf16 where this CPU computes it natively, else fp32).
    model, tokenizer = Llama.from_gguf(default_model_path(), dtype=config.targets[0].dtype, device="cpu")
    prompts = load_workload("humaneval", tokenizer, limit=args.prompts)
    print(f"AR references: {len(prompts)} prompts x {MAX_TOKENS} tokens", flush=True)
    refs = [r.token_ids for r in generate(model, prompts, SamplingParams(), MAX_TOKENS)]
    with Cluster.start(config, progress=lambda text: print(f"cluster: {text}", flush=True)) as cluster:
        soak = Soak(cluster, model, prompts, refs, args.minutes * 60, args.clients, args.seed)
        soak.run()
        alive = {s.name: s.alive() for s in cluster.servers()}
        leftovers = soak.leftovers()
        tracebacks = {s.name: s.logs().count("Traceback") for s in cluster.servers() if "Traceback" in s.logs()}
    growth = soak.rss_growth()
    t = soak.tally
    report = {
        "command": f"python -m specpool.bench.soak --minutes {args.minutes:g} --clients {args.clients} --seed {args.seed}",
        "machine": machine_info(),
        "seconds": soak.seconds,
        "requests": sum(t.outcomes.values()),
        "tokens": t.tokens,
        "outcomes": {f"{kind} {code}": n for (kind, code), n in sorted(t.outcomes.items())},
        "lost": t.lost,
        "wrong_greedy": t.wrong,
        "near_ties": t.near_ties,
        "restarts_s": soak.restarts,
        "rss_growth": growth,
        "rss_bytes": soak.rss,
        "alive_at_end": alive,
        "held_at_end": leftovers,
        "tracebacks_in_logs_tail": tracebacks,
    }
    ok = (not t.lost and not t.wrong and all(alive.values()) and not any(leftovers.values())
          and all(g < RSS_GROWTH_LIMIT for g in growth.values()) and len(soak.restarts) == 2)
    report["passed"] = ok
    print(json.dumps({k: v for k, v in report.items() if k != "rss_bytes"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
