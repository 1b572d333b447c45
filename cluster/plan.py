"""`specpool plan`: how many speculation endpoints (and target replicas) a demand mix needs.

The model is cluster/plan_model.py's (its docstring says how it counts); cluster/plan_inputs.py reads
the statistics and the demand file, cluster/plan_report.py prints the answer and draws it. A bench report with
remote modes also gets the drafter's side (cluster/drafter_capacity.py): how many targets one drafter core
serves, and how near the targets' own predicted speedups came to the measured ones.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from specpool.cluster.drafter_capacity import describe_loads, loads_from_bench
from specpool.cluster.plan_inputs import (
    fetch_capacity,
    load_demand,
    sessions_from_capacity,
    stats_from_bench,
    stats_from_capacity,
)
from specpool.cluster.plan_model import ModelStats, make_plan
from specpool.cluster.plan_report import describe, format_table, write_svg
from specpool.common.metrics_http import METRICS_TOKEN_ENV


def main(args) -> int:
    stats: dict[str, ModelStats] = {}
    sessions = None
    loads = []
    if args.stats:
        reports = [json.loads(Path(p).read_text()) for p in args.stats]
        stats = stats_from_bench(reports, batch_size=args.batch_size, mode=args.mode, fallback_mode=args.fallback_mode)
        loads = [load for report in reports for load in loads_from_bench(report)]
    if args.capacity_url:
        capacity = fetch_capacity(args.capacity_url, token=os.environ.get(METRICS_TOKEN_ENV))
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
    if loads:
        print("\ndrafter capacity (measured through an endpoint at batch 1):")
        print(describe_loads(loads))
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
                        f"speedups) or an endpoint's (its sessions); sends ${METRICS_TOKEN_ENV} when set")
    p.add_argument("--batch-size", type=int, default=None, help="operating batch (default: the largest measured)")
    p.add_argument("--mode", default=None,
                   help="bench mode a draft slot buys (default: the fastest draft-model mode, sd/ssd)")
    p.add_argument("--fallback-mode", default=None,
                   help="bench mode without a slot: ar, or e.g. ngram (default: the fastest n-gram mode when it "
                        "beats AR, as the router falls back)")
    p.add_argument("--max-endpoints", type=int, default=None, help="scan 0..N endpoints (default: until all drafted)")
    p.add_argument("--plot", default=None, help="write an SVG of speedup and cost against endpoints here")
