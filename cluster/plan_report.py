"""What `specpool plan` prints and draws: the recommendation, the table of endpoint counts, an SVG."""

from __future__ import annotations

import math
from pathlib import Path

from specpool.cluster.plan_model import Plan


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
