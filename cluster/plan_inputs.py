"""What `specpool plan` reads: measured statistics (`specpool bench` JSON, a live /capacity JSON) and
the demand file, as the capacity model's inputs (cluster/plan_model.py)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import yaml

from specpool.cluster.plan_model import Demand, ModelDemand, ModelStats
from specpool.common.metrics_http import METRICS_TOKEN_ENV
from specpool.engine.method import METHODS


def _wire_name(model: str) -> str:
    return model.removesuffix(".gguf")


# Bench modes (and their -remote/:K variants) that hold a draft slot, and those of the drafting a target does
# without one (the router's fallback).
DRAFT_MODEL_MODES = tuple(mode for row in METHODS if row.leases_slot for mode in row.bench_modes)
NGRAM_MODES = tuple(mode for row in METHODS if row.local for mode in row.bench_modes)


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
    buys is `mode` or the fastest draft-model mode (sd, ssd, head, head-tree; a draft slot is what the
    router leases for them); without a slot a sequence gets `fallback_mode` or, as the router decides, the fastest
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
    policies predict, with a slot (the draft model or SSD, whichever they predict faster) and with
    n-gram drafting (no slot; the router's fallback). It does not measure AR throughput:
    tokens_per_s_ar stays 0 until --stats or the demand file gives it."""
    stats = {}
    for pool in capacity.get("pools") or []:
        targets = _get(pool, "targets", [])
        batches = sorted(int(_get(t, "max_batch", 0)) for t in targets if _get(t, "max_batch", 0))
        draft = float(_get(pool, "predicted_speedup_draft", 1.0) or 1.0)
        ssd = float(_get(pool, "predicted_speedup_ssd", 0.0) or 0.0)  # 0: a router from before SSD's figure
        ngram = float(_get(pool, "predicted_speedup_ngram", 1.0) or 1.0)
        slot = "ssd" if ssd > draft else "draft model"
        stats[pool["model"]] = ModelStats(
            batch_size=batches[len(batches) // 2] if batches else 1, tokens_per_s_ar=0.0, speedup=max(draft, ssd),
            mode=f"{slot}, predicted by the targets", fallback_speedup=max(1.0, ngram),
            fallback_mode="ngram, predicted" if ngram > 1.0 else "ar",
        )
    return stats


def fetch_capacity(url: str, token: str | None = None, timeout_s: float = 10.0) -> dict:
    """A live /capacity JSON. token: the operators' metrics token, which a server started with one wants."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read().decode())
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise ValueError(f"{url}: 401, the server wants the operators' metrics token: set "
                             f"{METRICS_TOKEN_ENV}" + (" (the one set was refused)" if token else "")) from None
        raise


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
