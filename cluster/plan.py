"""`specpool plan`: how many speculation endpoints (and target replicas) a demand mix needs.

The model, from measured statistics (a `specpool bench` JSON; a live /capacity JSON, which gives
the endpoints' session capacity and the speedups the targets' own policies predict; or numbers
written into the demand file):

- A target replica of model m runs at batch b_m. Decoding alone it produces tps_ar_m tokens/s
  (the batch's total; bench mode `ar` at batch b). A sequence that holds a draft slot on an
  endpoint drafts with the draft model and its share of the replica runs s_m times faster (the
  fastest draft-model mode measured at batch b, sd/ssd, `speedup_vs_ar`; or what the targets'
  policies predict). One without a slot gets what the router gives it then: n-gram drafting,
  which needs no slot, when that beats AR (speedup s0_m, measured `ngram`), else AR (s0_m = 1).
  `--fallback-mode ar` makes the simplest model: a slot buys s_m, no slot is AR.
- An endpoint serves up to C concurrent sessions (its capacity: /capacity's maxSessions, the
  demand file's `endpoint_sessions`, or by default the batch size the bench measured, since the
  bench's drafter served that many sequences at that speedup).
- With n endpoints and R_m replicas, full replicas hold sum_m R_m b_m sequences; the router shares
  draft slots by weight, so every sequence gets one with the same probability
  f = min(1, n C / sum_m R_m b_m). Replica throughput mixes linearly:
  tps_m = tps_ar_m (s0_m + f (s_m - s0_m)); the mean speedup is s0 + f (s - s0), throughput-weighted.
- Demand of model m: requests_per_s × (mean_output_tokens / speedup + prefill_token_cost ×
  prompt_tokens) replica-seconds of AR tokens each second (prefill is not sped up by drafting; a
  prompt token costs `prefill_token_cost` of a decoded token, an assumption to set from your
  own measurement). R_m is the smallest count with utilization × R_m × tps_m >= that demand.
- Cost = sum_m R_m × target_cost_m + n × endpoint_cost (relative units, default 1 each).

For n = 0, 1, ... (until every sequence has a slot, then one more, or --max-endpoints) it finds
the smallest replica counts meeting the demand, and recommends the n with the smallest total
cost (ties: the higher mean speedup). R starts at the AR answer (feasible for any n) and drops
one replica at a time while the demand is still met; fewer replicas only raise f, and for one
model the feasible counts form an interval, so this is the minimum.
"""

from __future__ import annotations

import json
import math
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

MAX_ENDPOINTS = 64


@dataclass(frozen=True, slots=True)
class ModelStats:
    """Measured speed of one target model on one replica at its operating batch size."""

    batch_size: int
    tokens_per_s_ar: float  # the replica's total at that batch, decoding alone
    speedup: float  # with a draft slot (the pooled mode)
    mode: str = "measured"  # which measured mode gave `speedup`
    fallback_speedup: float = 1.0  # without a slot (1: AR)
    fallback_mode: str = "ar"


@dataclass(frozen=True, slots=True)
class ModelDemand:
    name: str
    requests_per_s: float
    mean_output_tokens: float
    prompt_tokens: float = 0.0
    target_cost: float = 1.0
    stats: ModelStats | None = None


@dataclass(frozen=True, slots=True)
class Demand:
    models: tuple[ModelDemand, ...]
    endpoint_cost: float = 1.0
    endpoint_sessions: int | None = None  # C; None: from the statistics
    utilization: float = 0.8  # of a replica's measured throughput, kept as headroom for bursts
    prefill_token_cost: float = 0.0


@dataclass(frozen=True, slots=True)
class PlanRow:
    endpoints: int
    slot_fraction: float  # f: share of sequences that hold a draft slot
    mean_speedup: float  # throughput-weighted, over all models
    replicas: dict[str, int]
    cost: float

    @property
    def total_replicas(self) -> int:
        return sum(self.replicas.values())


@dataclass(frozen=True, slots=True)
class Plan:
    rows: tuple[PlanRow, ...]
    endpoint_sessions: int
    demand: Demand
    notes: tuple[str, ...] = field(default=())

    @property
    def best(self) -> PlanRow:
        return min(self.rows, key=lambda r: (round(r.cost, 9), -r.mean_speedup, r.endpoints))


# -- the model ---------------------------------------------------------------------------------------


def _needed_ar_seconds(m: ModelDemand, speedup: float, prefill_token_cost: float) -> float:
    """AR-token-seconds of one replica per second of demand: what utilization × R × tps_ar must cover."""
    return m.requests_per_s * (m.mean_output_tokens / speedup + prefill_token_cost * m.prompt_tokens)


def _fraction(endpoints: int, sessions: int, replicas: dict[str, int], demand: Demand) -> float:
    sequences = sum(replicas[m.name] * m.stats.batch_size for m in demand.models)
    return 1.0 if sequences == 0 else min(1.0, endpoints * sessions / sequences)


def _speedup(m: ModelDemand, f: float) -> float:
    s0 = m.stats.fallback_speedup
    return s0 + f * max(0.0, m.stats.speedup - s0)  # the router does not speculate where it loses


def _meets(replicas: dict[str, int], endpoints: int, sessions: int, demand: Demand) -> bool:
    f = _fraction(endpoints, sessions, replicas, demand)
    return all(
        demand.utilization * replicas[m.name] * m.stats.tokens_per_s_ar
        >= _needed_ar_seconds(m, _speedup(m, f), demand.prefill_token_cost) - 1e-9
        for m in demand.models
    )


def plan_row(demand: Demand, endpoints: int, sessions: int) -> PlanRow:
    """Smallest replica counts meeting the demand with `endpoints` endpoints of `sessions` slots each."""
    replicas = {
        m.name: max(1, math.ceil(_needed_ar_seconds(m, m.stats.fallback_speedup, demand.prefill_token_cost)
                                 / (demand.utilization * m.stats.tokens_per_s_ar) - 1e-9))
        for m in demand.models
    }
    lowered = True
    while lowered:
        lowered = False
        for m in demand.models:
            if replicas[m.name] > 1:
                fewer = {**replicas, m.name: replicas[m.name] - 1}
                if _meets(fewer, endpoints, sessions, demand):
                    replicas, lowered = fewer, True
    f = _fraction(endpoints, sessions, replicas, demand)
    tokens = {m.name: replicas[m.name] * m.stats.tokens_per_s_ar for m in demand.models}
    mean_speedup = sum(tokens[m.name] * _speedup(m, f) for m in demand.models) / sum(tokens.values())
    cost = sum(replicas[m.name] * m.target_cost for m in demand.models) + endpoints * demand.endpoint_cost
    return PlanRow(endpoints, f, mean_speedup, replicas, cost)


def make_plan(demand: Demand, max_endpoints: int | None = None) -> Plan:
    missing = [m.name for m in demand.models if m.stats is None]
    if missing:
        raise ValueError(f"no measured statistics for {', '.join(missing)}: give --stats (a specpool bench JSON) "
                         "or tokens_per_s_ar and speedup in the demand file")
    sessions = demand.endpoint_sessions or max(m.stats.batch_size for m in demand.models)
    if sessions < 1:
        raise ValueError(f"endpoint_sessions must be >= 1, got {sessions}")
    rows = []
    limit = MAX_ENDPOINTS if max_endpoints is None else max_endpoints
    saturated_at = None
    for n in range(limit + 1):
        rows.append(plan_row(demand, n, sessions))
        if saturated_at is None and rows[-1].slot_fraction >= 1.0:
            saturated_at = n
        if max_endpoints is None and saturated_at is not None and n >= max(saturated_at + 1, 1):
            break
    notes = []
    if all(m.stats.speedup <= m.stats.fallback_speedup for m in demand.models):
        notes.append("a draft slot is not faster than decoding without one (the fallback) at these batch sizes: "
                     "endpoints add only cost")
    return Plan(tuple(rows), sessions, demand, tuple(notes))


# -- inputs --------------------------------------------------------------------------------------------


def _wire_name(model: str) -> str:
    return model.removesuffix(".gguf")


DRAFT_MODEL_MODES = ("sd", "ssd")  # bench modes (and their -remote/:K variants) that hold a draft slot
NGRAM_MODES = ("ngram",)  # drafting a target does without a slot (the router's fallback)


def _family(mode: str) -> str:
    return mode.split(":")[0].removesuffix("-remote")


def _pick_mode(speedups: dict[str, float], wanted: str | None, families: tuple[str, ...],
               where: str) -> tuple[str, float] | None:
    """(mode, speedup): `wanted`, else the fastest measured mode of these families (None: none measured)."""
    if wanted is not None:
        if wanted not in speedups:
            raise ValueError(f"{where}: no mode {wanted!r} (measured: {sorted(speedups)})")
        return wanted, speedups[wanted]
    found = [(m, v) for m, v in speedups.items() if _family(m) in families]
    return max(found, key=lambda mv: mv[1], default=None)


def stats_from_bench(reports: list[dict], batch_size: int | None = None, mode: str | None = None,
                     fallback_mode: str | None = None) -> dict[str, ModelStats]:
    """ModelStats per model (wire name) from `specpool bench` reports (merged; later files win).

    The operating batch is `batch_size` or the largest one with an `ar` result. What a draft slot
    buys is `mode` or the fastest draft-model mode (sd, ssd; a draft slot is what the router leases
    for them); without a slot a sequence gets `fallback_mode` or, as the router decides, the fastest
    n-gram mode when it beats AR (n-gram drafting needs no slot), else AR."""
    by_model: dict[str, dict[tuple[str, int], dict]] = {}
    for report in reports:
        results = by_model.setdefault(_wire_name(report.get("model", "")), {})
        for r in report.get("results", []):
            results[(r["mode"], int(r["batch_size"]))] = r
    stats = {}
    for model, results in by_model.items():
        batches = sorted(b for (m, b) in results if m == "ar")
        if not batches:
            raise ValueError(f"bench results for {model!r} have no 'ar' mode to measure speedups against")
        b = batch_size or batches[-1]
        if ("ar", b) not in results:
            raise ValueError(f"bench results for {model!r} have no 'ar' run at batch {b} (measured: {batches})")
        at_b = {m: r["speedup_vs_ar"] for (m, bb), r in results.items() if bb == b}
        where = f"bench results for {model!r} at batch {b}"
        pooled = _pick_mode(at_b, mode, DRAFT_MODEL_MODES, where) or ("none", 1.0)
        if fallback_mode == "ar":
            fallback = ("ar", 1.0)
        else:
            fallback = _pick_mode(at_b, fallback_mode, NGRAM_MODES, where)
            if fallback is None or (fallback_mode is None and fallback[1] <= 1.0):
                fallback = ("ar", 1.0)  # the router does not draft where it loses
        stats[model] = ModelStats(batch_size=b, tokens_per_s_ar=results[("ar", b)]["tokens_per_s"],
                                  speedup=pooled[1], mode=pooled[0],
                                  fallback_speedup=fallback[1], fallback_mode=fallback[0])
    return stats


def _get(report: dict, key: str, default=None):
    """A field of a /capacity JSON by its proto name, in protobuf's JSON (camelCase) or as written."""
    camel = key.split("_")[0] + "".join(w.title() for w in key.split("_")[1:])
    return report.get(camel, report.get(key, default))


def sessions_from_capacity(capacity: dict) -> int | None:
    """Per-endpoint session capacity from a /capacity JSON: an endpoint's own report
    ({"maxSessions": ...}) or a router's ({"endpoints": [...]}; the smallest counts)."""
    def one(report: dict) -> int | None:
        value = _get(report, "max_sessions")
        return int(value) if value else None

    if isinstance(capacity.get("endpoints"), list):
        values = [v for v in map(one, capacity["endpoints"]) if v]
        return min(values) if values else None
    return one(capacity)


def stats_from_capacity(capacity: dict) -> dict[str, ModelStats]:
    """What a router's /capacity knows per model: its targets' batch size and the speedups their own
    policies predict, with the draft model (a slot) and with n-gram drafting (no slot; the router's
    fallback). It does not measure AR throughput: tokens_per_s_ar stays 0 until --stats or the
    demand file gives it."""
    stats = {}
    for pool in capacity.get("pools") or []:
        targets = _get(pool, "targets", [])
        batches = sorted(int(_get(t, "max_batch", 0)) for t in targets if _get(t, "max_batch", 0))
        draft = float(_get(pool, "predicted_speedup_draft", 1.0) or 1.0)
        ngram = float(_get(pool, "predicted_speedup_ngram", 1.0) or 1.0)
        stats[pool["model"]] = ModelStats(
            batch_size=batches[len(batches) // 2] if batches else 1, tokens_per_s_ar=0.0, speedup=draft,
            mode="draft model, predicted by the targets", fallback_speedup=max(1.0, ngram),
            fallback_mode="ngram, predicted" if ngram > 1.0 else "ar",
        )
    return stats


def fetch_capacity(url: str, timeout_s: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read().decode())


def load_demand(path: Path, stats: dict[str, ModelStats] | None = None, sessions: int | None = None) -> Demand:
    """The demand file (YAML or JSON), with measured stats filled in for models that do not carry
    their own (`tokens_per_s_ar`, `speedup`, `batch_size` inline). One measured model applies to all."""
    raw = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(raw, dict) or not isinstance(raw.get("models"), dict) or not raw["models"]:
        raise ValueError(f"{path}: expected a mapping with 'models: {{MODEL: {{requests_per_s, mean_output_tokens}}}}'")
    stats = stats or {}
    costs = raw.get("costs") or {}
    models = []
    for name, item in raw["models"].items():
        item = item or {}
        for key in ("requests_per_s", "mean_output_tokens"):
            if not isinstance(item.get(key), (int, float)) or item[key] < 0:
                raise ValueError(f"{path}: models.{name}.{key} must be a number >= 0, got {item.get(key)!r}")
        measured = stats.get(name) or (next(iter(stats.values())) if len(stats) == 1 else None)
        if "tokens_per_s_ar" in item or "speedup" in item:
            base = measured or ModelStats(batch_size=1, tokens_per_s_ar=0.0, speedup=1.0)
            measured = replace(
                base, tokens_per_s_ar=float(item.get("tokens_per_s_ar", base.tokens_per_s_ar)),
                speedup=float(item.get("speedup", base.speedup)),
                mode="demand file" if "speedup" in item else base.mode,
                batch_size=int(item.get("batch_size", base.batch_size)),
                fallback_speedup=float(item.get("fallback_speedup", base.fallback_speedup)),
            )
        if measured is not None and measured.tokens_per_s_ar <= 0:
            raise ValueError(f"{path}: models.{name}: AR throughput unknown (a live /capacity does not measure it): "
                             "give --stats BENCH_JSON or tokens_per_s_ar in the demand file")
        models.append(ModelDemand(
            name=name, requests_per_s=float(item["requests_per_s"]),
            mean_output_tokens=float(item["mean_output_tokens"]),
            prompt_tokens=float(item.get("prompt_tokens", 0)),
            target_cost=float(item.get("target_cost", costs.get("target", 1.0))), stats=measured,
        ))
    utilization = float(raw.get("utilization", 0.8))
    if not 0 < utilization <= 1:
        raise ValueError(f"{path}: utilization must be in (0, 1], got {utilization}")
    return Demand(
        models=tuple(models), endpoint_cost=float(costs.get("endpoint", 1.0)),
        endpoint_sessions=raw.get("endpoint_sessions") or sessions, utilization=utilization,
        prefill_token_cost=float(raw.get("prefill_token_cost", 0.0)),
    )


# -- output ---------------------------------------------------------------------------------------------


def format_table(plan: Plan) -> str:
    names = [m.name for m in plan.demand.models]
    header = ["endpoints", "slot share", "mean speedup", *(f"replicas {n}" for n in names), "cost"]
    lines = [header]
    best = plan.best
    for r in plan.rows:
        lines.append([
            f"{r.endpoints}{' *' if r is best else ''}", f"{r.slot_fraction:.2f}", f"{r.mean_speedup:.2f}x",
            *(str(r.replicas[n]) for n in names), f"{r.cost:g}",
        ])
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    out = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def describe(plan: Plan) -> str:
    lines = []
    for m in plan.demand.models:
        s = m.stats
        lines.append(f"{m.name}: {m.requests_per_s:g} req/s x {m.mean_output_tokens:g} tokens; one replica at batch "
                     f"{s.batch_size}: {s.tokens_per_s_ar:g} tokens/s AR, {s.speedup:.2f}x with a draft slot "
                     f"({s.mode}), {s.fallback_speedup:.2f}x without ({s.fallback_mode})")
    lines.append(f"endpoint capacity: {plan.endpoint_sessions} sessions; costs: endpoint {plan.demand.endpoint_cost:g}, "
                 f"utilization {plan.demand.utilization:g}")
    b = plan.best
    replicas = ", ".join(f"{n} x {k}" for k, n in b.replicas.items())
    lines.append(f"recommendation: {b.endpoints} speculation endpoint(s) and {replicas} "
                 f"(cost {b.cost:g}, mean speedup {b.mean_speedup:.2f}x, {b.slot_fraction:.0%} of sequences drafted)")
    lines.extend(f"note: {n}" for n in plan.notes)
    return "\n".join(lines)


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_svg(plan: Plan, path: Path) -> None:
    """Mean speedup (left axis) and total cost (right axis) against the number of endpoints."""
    width, height, left, right, top, bottom = 640, 400, 70, 70, 40, 60
    pw, ph = width - left - right, height - top - bottom
    xs = [r.endpoints for r in plan.rows]
    speedups = [r.mean_speedup for r in plan.rows]
    costs = [r.cost for r in plan.rows]
    x_max = max(max(xs), 1)
    s_lo, s_hi = _axis_range(speedups, floor=1.0)  # from AR up: the differences are what matter
    c_lo, c_hi = _axis_range(costs, floor=0.0)

    def px(x: float) -> float:
        return left + pw * x / x_max

    def py(v: float, lo: float, hi: float) -> float:
        return top + ph * (1 - (v - lo) / (hi - lo))

    out = [
        (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">'),
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="14">Draft pool size: speedup and cost</text>',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>',
    ]
    for i in range(5):
        frac = i / 4
        y = top + ph * (1 - frac)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" fill="#1f77b4">'
                   f'{s_lo + frac * (s_hi - s_lo):.2f}x</text>')
        out.append(f'<text x="{left + pw + 6}" y="{y + 4:.1f}" fill="#d62728">{c_lo + frac * (c_hi - c_lo):.3g}</text>')
    step = max(1, math.ceil(x_max / 10))
    for x in range(0, x_max + 1, step):
        out.append(f'<text x="{px(x):.1f}" y="{top + ph + 18}" text-anchor="middle">{x}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 20}" text-anchor="middle">speculation endpoints</text>')
    out.append(f'<text transform="translate(18 {top + ph / 2}) rotate(-90)" text-anchor="middle" '
               f'fill="#1f77b4">mean speedup vs AR</text>')
    out.append(f'<text transform="translate({width - 14} {top + ph / 2}) rotate(90)" text-anchor="middle" '
               f'fill="#d62728">total cost (targets + endpoints)</text>')
    for values, lo, hi, color in ((speedups, s_lo, s_hi, "#1f77b4"), (costs, c_lo, c_hi, "#d62728")):
        points = " ".join(f"{px(x):.1f},{py(v, lo, hi):.1f}" for x, v in zip(xs, values))
        out.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"/>')
        out.extend(f'<circle cx="{px(x):.1f}" cy="{py(v, lo, hi):.1f}" r="3" fill="{color}"/>'
                   for x, v in zip(xs, values))
    best = plan.best
    bx = px(best.endpoints)
    out.append(f'<line x1="{bx:.1f}" y1="{top}" x2="{bx:.1f}" y2="{top + ph}" stroke="#2ca02c" '
               f'stroke-dasharray="4 3"/>')
    out.append(f'<text x="{bx + 4:.1f}" y="{top + 14}" fill="#2ca02c">'
               f'{_esc(f"recommended: {best.endpoints} (cost {best.cost:g})")}</text>')
    out.append("</svg>")
    Path(path).write_text("\n".join(out) + "\n")


def _axis_range(values: list[float], floor: float) -> tuple[float, float]:
    lo, hi = min(min(values), floor), max(values)
    if hi - lo < 1e-9:
        hi = lo + 1.0
    return lo, hi + 0.05 * (hi - lo)


def main(args) -> int:
    stats: dict[str, ModelStats] = {}
    sessions = None
    if args.stats:
        reports = [json.loads(Path(p).read_text()) for p in args.stats]
        stats = stats_from_bench(reports, batch_size=args.batch_size, mode=args.mode, fallback_mode=args.fallback_mode)
    if args.capacity_url:
        capacity = fetch_capacity(args.capacity_url)
        sessions = sessions_from_capacity(capacity)
        if sessions is None:
            raise ValueError(f"{args.capacity_url}: no maxSessions in the capacity report")
        for model, live in stats_from_capacity(capacity).items():
            stats.setdefault(model, live)  # measured side by side (--stats) beats predicted
    demand = load_demand(Path(args.demand), stats, sessions)
    plan = make_plan(demand, args.max_endpoints)
    print(describe(plan))
    print()
    print(format_table(plan))
    if args.plot:
        write_svg(plan, Path(args.plot))
        print(f"\nplot: {args.plot}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--demand", required=True, help="YAML/JSON: per model requests_per_s, mean_output_tokens, "
                                                   "optional prompt_tokens; costs, endpoint_sessions")
    p.add_argument("--stats", action="append", default=[], metavar="BENCH_JSON",
                   help="`specpool bench` JSON (repeatable; e.g. one per batch size)")
    p.add_argument("--capacity-url", default=None,
                   help="a live /capacity JSON: a router's (endpoint sessions, targets' batch and predicted "
                        "speedups) or an endpoint's (its sessions)")
    p.add_argument("--batch-size", type=int, default=None, help="operating batch (default: the largest measured)")
    p.add_argument("--mode", default=None,
                   help="bench mode a draft slot buys (default: the fastest draft-model mode, sd/ssd)")
    p.add_argument("--fallback-mode", default=None,
                   help="bench mode without a slot: ar, or e.g. ngram (default: the fastest n-gram mode when it "
                        "beats AR, as the router falls back)")
    p.add_argument("--max-endpoints", type=int, default=None, help="scan 0..N endpoints (default: until all drafted)")
    p.add_argument("--plot", default=None, help="write an SVG of speedup and cost against endpoints here")
