"""What a speculation endpoint tells the registry on every heartbeat: its capacity report, flattened."""

from __future__ import annotations

from specpool.spec_endpoint.messages import CapacityReport


def heartbeat_fields(report: CapacityReport, address: str) -> dict:
    drafted = sum(t.drafted_tokens for t in report.tenants)
    accepted = sum(t.accepted_tokens for t in report.tenants)
    return {
        "address": address,
        "models": [m.target_model for m in report.models],
        "max_sessions": report.max_sessions,
        "active_sessions": report.active_sessions,
        "draft_busy_ratio": round(report.draft_busy_ratio, 4),
        "acceptance": round(accepted / drafted, 4) if drafted else 0.0,
        # SSD speculation-cache hits / lookups, once the report carries them.
        "hit_ratio": round(getattr(report, "hit_ratio", 0.0), 4),
    }
