"""Grey failures of the speculation tier (issue 13, case 5), measured: an endpoint that hangs
(SIGSTOP) or whose link turns slow (300 ms each way, a real TCP proxy), for 8 s, under a drafted
stream and a co-batched plain one on one target.

    python -m specpool.bench.grey_failure --json bench/results/grey_failure.json

Figures, per fault, all from one run (this machine is shared and noisy):
- plain_solo: the plain stream's tokens/s alone (its prompt decoded plainly, so also the AR rate);
- plain_pair: the slower of two plain streams' tokens/s side by side, after the scenario, each from the
  plain stream's context halfway through the fault: what each stream may run at while the breaker is
  open, when the target's steps carry the two as plain rows of that length. Uncontended (StepThread): per second the target's step thread was
  not waiting for a core, as are plain_during_uncontended and drafted_during_uncontended;
- plain_during / drafted_during: each stream's tokens/s while the target's breaker was open;
- plain_ratio = plain_solo / plain_during (issue 38: within 1.5x; issue 13 asked 1.2x) and
  drafted_ratio = plain_solo / drafted_during (the drafted request against AR: within 1.3x). While
  the breaker is open the drafted stream decodes plainly beside the plain one (no local drafts: they
  would widen the plain row's forward), so both run at the rate of two plain rows;
- tripped_s: fault to breaker open; resumed_s: recovery to breaker closed (within 2 s);
- step_costs: the target's forward for the plain row alone, beside a second plain row (what it pays
  while the endpoint fails) and batched with the drafted row's verify (what it paid before, issue 38);
- the drafted stream's tokens equal AR, and a request sent after recovery is drafted by the endpoint
  again (`after`: its steps, drafted tokens and rounds drafted locally).

Without the breaker every step waited the full --spec-deadline-ms (500 ms): about 2 tokens/s.
tests/cluster/test_fault_isolation.py runs the same scenario on tiny models with a looser bound.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import torch

from specpool.cluster.config import EndpointSpec, TargetSpec
from specpool.cluster.delay_proxy import DelayProxy
from specpool.cluster.launcher import endpoint_command, target_command
from specpool.cluster.processes import ServerProcess, start_server, wait_for
from specpool.common.machine import machine_info, machine_line
from specpool.common.security import LocalCA
from specpool.common.speculation import method_to_pb
from specpool.engine.decoding import generate
from specpool.engine.method import Method
from specpool.engine.runtime.gguf_loader import default_model_path, model_name
from specpool.engine.runtime.model import Llama
from specpool.engine.verification.sampling import SamplingParams
from specpool_client import generate_result
from specpool_client.v1 import target_pb2 as pb
from specpool_client.v1 import target_pb2_grpc

FAULT_S = 8.0
SLOW_LINK_S = 0.3  # each way
DRAFT_TOKENS = 4  # fixed: the hardware-aware policy may rightly stop drafting where the draft does not pay
BREAKER = "specpool_target_spec_breaker_open"
FALLBACK_REASONS = ("deadline", "breaker_open", "session_unavailable", "session_lost", "endpoint_failed",
                    "endpoint_unavailable", "bad_reply")
REPO = Path(__file__).resolve().parents[1]


class Hang:
    """The endpoint process SIGSTOPped: it accepts nothing and answers nothing."""

    def __init__(self, spec: ServerProcess):
        self.spec, self.address = spec, spec.address

    def start(self) -> None:
        self.spec.proc.send_signal(signal.SIGSTOP)

    def end(self) -> None:
        self.spec.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        pass


class SlowLink:
    """SLOW_LINK_S added each way on the target's link to the endpoint."""

    def __init__(self, spec: ServerProcess):
        self.proxy = DelayProxy(spec.address)
        self.address = self.proxy.address

    def start(self) -> None:
        self.proxy.delay_s = SLOW_LINK_S

    def end(self) -> None:
        self.proxy.delay_s = 0.0

    def close(self) -> None:
        self.proxy.close()


FAULTS = {"sigstop": Hang, "slow_link": SlowLink}


class StepThread:
    """The target's step thread, read from /proc (its busiest thread: with --threads 1 the scheduler's,
    which runs the model): how long it waited for a core. A rate over a window, divided by the share of the
    window it was not kept waiting for one, is the rate the target kept on its own: other processes' load
    on a shared machine taken out, its own waiting (on the endpoint, on anything) kept in."""

    def __init__(self, pid: int):
        self.pid = pid

    def sample(self) -> dict[str, tuple[int, int]]:
        """Each thread's (ns run, ns waited for a core) so far."""
        stats = {}
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            try:
                run, wait, _ = (int(v) for v in (task / "schedstat").read_text().split())
            except (OSError, ValueError):  # a thread that ended meanwhile
                continue
            stats[task.name] = (run, wait)
        return stats

    def uncontended(self, rate: float, before: dict, after: dict, wall_s: float) -> float:
        """`rate` over a window of wall_s between the samples `before` and `after`, per second the step
        thread was not waiting for a core."""
        common = before.keys() & after.keys()
        busiest = max(common, key=lambda t: after[t][0] - before[t][0])
        waited_s = (after[busiest][1] - before[busiest][1]) / 1e9
        return rate * wall_s / max(wall_s - waited_s, 1e-3)


class RecordedStream:
    """One Generate call in a thread: (arrival time, tokens) per delta, then its final."""

    def __init__(self, stub, request: pb.GenerateRequest):
        self.stamps: list[tuple[float, int]] = []
        self.tokens: list[int] = []
        self.final: pb.GenerateResult | None = None
        self.error: grpc.RpcError | None = None
        self._call = stub.Generate(request, timeout=600)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for msg in self._call:
                if msg.HasField("delta"):
                    self.stamps.append((time.monotonic(), len(msg.delta.token_ids)))
                    self.tokens += msg.delta.token_ids
                else:
                    self.final = msg.final
        except grpc.RpcError as e:
            self.error = e

    def count(self) -> int:
        return sum(n for _, n in self.stamps)

    def rate(self, start: float, end: float) -> float:
        """Tokens per second received in [start, end] (up to its last token, if it ended first)."""
        end = min(end, self.stamps[-1][0]) if self.stamps else end
        return sum(n for t, n in self.stamps if start <= t <= end) / max(end - start, 1e-9)

    def cancel(self) -> None:
        self._call.cancel()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


def step_costs(gguf: Path, draft_tokens: int, context: int = 200, repeats: int = 15) -> dict:
    """Median ms of the target's forward, one thread as the served target: a plain row alone, beside
    another plain row, and batched with a drafted row verifying draft_tokens + 1 positions."""
    torch.set_num_threads(1)
    model, _ = Llama.from_gguf(gguf, dtype="fp32", device="cpu")
    cache = model.new_cache(2, context + draft_tokens + 2)
    plain, drafted = cache.allocate(), cache.allocate()
    model.forward(cache, [plain, drafted], [list(range(3, 3 + context))] * 2)

    def median_ms(slots: list[int], feeds: list[list[int]]) -> float:
        times = []
        for _ in range(repeats):
            lengths = [cache.lengths[s] for s in slots]
            start = time.perf_counter()
            model.forward(cache, slots, feeds, all_logits=True)
            times.append(time.perf_counter() - start)
            for s, n in zip(slots, lengths):
                cache.truncate(s, n)
        return 1e3 * sorted(times)[len(times) // 2]

    solo = median_ms([plain], [[5]])
    two_plain = median_ms([plain, drafted], [[5], [5]])
    joint = median_ms([plain, drafted], [[5], list(range(5, 6 + draft_tokens))])
    return {"solo_step_ms": solo, "two_plain_step_ms": two_plain, "two_plain_over_solo": two_plain / solo,
            "joint_step_ms": joint, "joint_over_solo": joint / solo}


def measure(gguf: Path, draft: Path, fault: str, prompt: list[int], drafted_tokens: int, plain_tokens: int,
            target_args: list[str], endpoint_args: list[str], window_s: float = 2.0,
            cpus: tuple[list[int], list[int]] | None = None) -> dict:
    """The scenario of the module docstring on one endpoint and one target (pinned to `cpus`:
    (endpoint's, target's), as cluster/examples/smollm2.yaml pins them); returns its figures (see the
    docstring) with `equal_ar` and `resumed_drafting`."""
    model, _ = Llama.from_gguf(gguf, dtype="fp32", device="cpu")
    [want] = generate(model, [prompt], SamplingParams(), drafted_tokens, stop_ids=[])
    ca = LocalCA.temporary()
    # None: the servers' own defaults, so target_args and endpoint_args decide as given.
    endpoint = EndpointSpec(name="", drafters=(f"{model_name(gguf)}={gguf},draft={draft}",), max_sessions=None,
                            threads=None, args=tuple(endpoint_args))
    spec = start_server("spec", endpoint_command(endpoint), cpus=cpus[0] if cpus else None, env=ca.env)
    grey = FAULTS[fault](spec)
    target = None
    try:
        served = TargetSpec(tenant="grey", model=str(gguf), max_batch=None, max_context=None, threads=None,
                            args=("--spec-deadline-ms", "500", *target_args))
        target = start_server("target", target_command(served, grey.address), cpus=cpus[1] if cpus else None,
                              env=ca.env)
        stub = target_pb2_grpc.TargetServiceStub(ca.client("bench").channel(target.address, "target", "grey"))

        def request(method: Method, max_tokens: int, context: list[int] = prompt) -> pb.GenerateRequest:
            return pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=context), max_tokens=max_tokens, ignore_eos=True,
                                      speculation=pb.SpeculationPreference(method=method_to_pb(method)))

        step_thread = StepThread(target.proc.pid)

        def pair_rate(context: list[int]) -> float:
            """Two plain streams side by side from `context`, for window_s: the slower one's tokens/s,
            uncontended."""
            # Room for window_s at a few thousand tokens/s, within the context the plain stream had.
            pair = [RecordedStream(stub, request(Method.NONE, 3000, context)) for _ in range(2)]
            wait_for(lambda: min(p.count() for p in pair) >= 20, timeout_s=120)
            start, first = time.monotonic(), step_thread.sample()
            time.sleep(window_s)
            end, last = time.monotonic(), step_thread.sample()
            rate = min(p.rate(start, end) for p in pair)
            for p in pair:
                p.cancel()
                p.join(10)
            return step_thread.uncontended(rate, first, last, end - start)

        plain = RecordedStream(stub, request(Method.NONE, plain_tokens))
        wait_for(lambda: plain.count() >= 20, timeout_s=120)
        time.sleep(window_s)
        solo = plain.rate(time.monotonic() - window_s, time.monotonic())
        drafted = RecordedStream(stub, request(Method.DRAFT_MODEL, drafted_tokens))
        wait_for(lambda: drafted.count() >= 20, timeout_s=120)
        time.sleep(window_s)
        began = time.monotonic()
        plain_before, drafted_before = plain.rate(began - window_s, began), drafted.rate(began - window_s, began)
        grey.start()
        try:
            wait_for(lambda: target.metric_total(BREAKER) == 1, timeout_s=10)
            tripped, at_trip = time.monotonic(), step_thread.sample()
            time.sleep(max(0.0, began + FAULT_S - time.monotonic()))
        finally:
            grey.end()
        recovered, at_recovery = time.monotonic(), step_thread.sample()
        plain_during, drafted_during = plain.rate(tripped, recovered), drafted.rate(tripped, recovered)
        during_uncontended = [step_thread.uncontended(r, at_trip, at_recovery, recovered - tripped)
                              for r in (plain_during, drafted_during)]
        # Probes ride on rounds: a drafted request keeps them going, whether or not the first one ended.
        prober = RecordedStream(stub, request(Method.DRAFT_MODEL, drafted_tokens))
        resumed = wait_for(lambda: target.metric_total(BREAKER) == 0 and time.monotonic() - recovered, timeout_s=30)
        plain.cancel()
        prober.cancel()
        drafted.join(600)
        # From the plain stream's context halfway through the fault: a step's cost grows with the context
        # (measured from the prompt alone, the pair ran 1.7x the fault's rate on a quiet machine).
        halfway = sum(n for t, n in plain.stamps if t <= (tripped + recovered) / 2)
        plain_pair = pair_rate(prompt + plain.tokens[:halfway])
        after = generate_result(stub, request(Method.DRAFT_MODEL, 32), timeout=120).completions[0]
        done = drafted.final.completions[0] if drafted.final else None
        fallbacks = {reason: target.metric_total("specpool_target_spec_fallback_rounds_total", reason=reason)
                     for reason in FALLBACK_REASONS}
        return {
            "fault": fault, "fault_s": FAULT_S,
            "plain_solo": solo, "plain_pair": plain_pair, "plain_before": plain_before, "drafted_before": drafted_before,
            "plain_during": plain_during, "drafted_during": drafted_during,
            "plain_during_uncontended": during_uncontended[0], "drafted_during_uncontended": during_uncontended[1],
            "plain_ratio": solo / max(plain_during, 1e-9), "drafted_ratio": solo / max(drafted_during, 1e-9),
            "tripped_s": tripped - began, "resumed_s": resumed,
            "equal_ar": drafted.tokens == want.token_ids,
            "fallback_rounds": done.speculation.fallback_rounds if done else None,
            "fallback_rounds_by_reason": {r: n for r, n in fallbacks.items() if n},
            # Its first round may draft locally while its session opens; after that the endpoint drafts.
            "resumed_drafting": after.speculation.drafted_tokens > 0
                                and after.speculation.fallback_rounds < after.speculation.target_steps,
            "after": {"target_steps": after.speculation.target_steps, "drafted_tokens": after.speculation.drafted_tokens,
                      "fallback_rounds": after.speculation.fallback_rounds},
        }
    finally:
        for server in (target, spec):
            if server is not None:
                server.stop()
        grey.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--faults", default="sigstop,slow_link",
                   help=f"comma-separated faults, each measured in turn (of: {', '.join(FAULTS)})")
    p.add_argument("--drafted-tokens", type=int, default=400, help="tokens the drafted stream generates")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    return p


def main() -> int:
    args = build_parser().parse_args()
    print(machine_line(), flush=True)
    gguf, draft = default_model_path(), REPO / "models" / "smollm2-135m-draft"
    _, tokenizer = Llama.from_gguf(gguf, dtype="fp32", device="cpu")
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Write a Python function that returns the factorial "
                                                                 "of n, with a docstring and tests."}])
    one_thread = ["--threads", "1"]
    # The SmolLM2 cluster's layout (cluster/examples/smollm2.yaml): the endpoint (and this client) on core 0, the
    # target on core 1.
    cpus = ([0], [1]) if {0, 1} <= os.sched_getaffinity(0) else None
    costs = step_costs(gguf, DRAFT_TOKENS)
    print(json.dumps(costs), flush=True)
    results = []
    for fault in args.faults.split(","):
        figures = measure(gguf, draft, fault, prompt, args.drafted_tokens, 4000,
                          ["--max-context", "4096", "--max-batch", "4", "--draft-tokens", str(DRAFT_TOKENS),
                           *one_thread],
                          ["--max-len", "4096", *one_thread], cpus=cpus)
        print(json.dumps(figures, indent=1), flush=True)
        results.append(figures)
    for r in results:
        r["plain_within_1_5x_of_solo"] = r["plain_ratio"] <= 1.5
        r["plain_within_1_2x_of_solo"] = r["plain_ratio"] <= 1.2
    passed = all(r["plain_within_1_5x_of_solo"] and r["drafted_ratio"] <= 1.3 and r["resumed_s"] < 2.0
                 and r["equal_ar"] and r["resumed_drafting"] for r in results)
    report = {"command": "python -m specpool.bench.grey_failure " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                                   vars(args).items() if k != "json"),
              "machine": machine_info(), "cpus": {"endpoint": cpus[0], "target": cpus[1]} if cpus else None,
              "step_costs": costs, "results": results, "passed": passed}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
