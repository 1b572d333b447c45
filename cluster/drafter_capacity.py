"""How many targets one drafter core serves: `specpool plan`'s answer for a pooled endpoint, from the remote modes
of a `specpool bench` report (sd-remote, measured with one target, and sd-remote-x2 with two).

A target drafting through the endpoint at speedup s over its AR rate r (tokens/s) costs the endpoint c
core-seconds of drafting per token it emits (the bench's drafter_core_s_per_token: the endpoint's busy seconds
times its threads, over the target tokens). So it keeps u = s r c drafter cores busy. One drafter core serves
1/u such targets at their full speedup. Past that the drafter is the bottleneck and every target's rounds wait
their turn: each one's speedup falls as s / (n u), down to AR's at n = 1 / (r c) targets, where the pooled plan
stops paying. Forwards shared across targets (the endpoint batches rounds that arrive together) lower c; a mode
measured with two targets gives the c they paid together.
"""

from __future__ import annotations

from dataclasses import dataclass

TOLERANCE = 0.15  # how far a prediction may fall from the measured speedup (issue 51's bar)


@dataclass(frozen=True, slots=True)
class DrafterLoad:
    """What one remote bench mode measured of its targets' load on the endpoint."""

    model: str
    mode: str
    targets: int  # on the endpoint at once
    speedup: float  # each target's over its own AR in the same layout (the mean of the targets')
    tokens_per_s_ar: float  # one target's, decoding plainly in that layout
    core_s_per_token: float  # drafter core-seconds per target token
    cores_busy: float  # the endpoint's drafting, in cores, over the mode's wall time
    drafter_cores: int  # the endpoint's threads in that layout
    accept_len: float | None  # tokens per target step
    predicted_speedup: float | None  # the targets' policies' own (their heartbeats'), None: not reported

    @property
    def cores_per_target(self) -> float:
        """u: drafter cores one target keeps busy at its speedup."""
        return self.speedup * self.tokens_per_s_ar * self.core_s_per_token

    @property
    def full_speed_targets(self) -> float:
        """Targets one drafter core serves at their full speedup (1/u)."""
        return 1.0 / self.cores_per_target

    @property
    def paying_targets(self) -> float:
        """Targets one drafter core serves before each one's speedup falls to AR's (1/(r c))."""
        return 1.0 / (self.tokens_per_s_ar * self.core_s_per_token)

    def speedup_with(self, targets: int, drafter_cores: int) -> float:
        """Each target's predicted speedup with `targets` of them on `drafter_cores`, at this per-token cost."""
        return self.speedup * min(1.0, drafter_cores * self.full_speed_targets / targets)


def loads_from_bench(report: dict) -> list[DrafterLoad]:
    """The remote draft modes of one bench report at batch 1 that counted the endpoint's drafting."""
    model = report.get("model", "").removesuffix(".gguf")
    loads = []
    for row in report.get("results", []):
        if row.get("batch_size") != 1 or not row.get("drafter_core_s_per_token") or not row.get("speedup_vs_ar"):
            continue
        per_target = row.get("targets") or [row]
        speedups = [t["speedup_vs_ar"] for t in per_target]
        if None in speedups:
            continue
        speedup = sum(speedups) / len(speedups)
        loads.append(DrafterLoad(
            model=model, mode=row["mode"], targets=len(per_target), speedup=speedup,
            tokens_per_s_ar=sum(t["tokens_per_s"] / t["speedup_vs_ar"] for t in per_target) / len(per_target),
            core_s_per_token=row["drafter_core_s_per_token"], cores_busy=row["drafter_cores_busy"],
            drafter_cores=row.get("drafter_threads") or 1,
            accept_len=row.get("mean_accept_len"), predicted_speedup=row.get("predicted_speedup"),
        ))
    return loads


def _off(predicted: float, measured: float) -> str:
    error = abs(predicted - measured) / measured
    return f"{error:.0%} off, {'within' if error <= TOLERANCE else 'OUTSIDE'} {TOLERANCE:.0%}"


def describe_loads(loads: list[DrafterLoad]) -> str:
    """The planner's drafter section: each mode's measured and predicted speedup, acceptance and drafter use, how
    many targets a drafter core serves, and for modes of several targets the speedup the one-target measurement
    predicted for them against what they measured."""
    lines = []
    alone = {load.model: load for load in loads if load.targets == 1}
    for load in loads:
        lines.append(f"{load.model}, {load.mode} ({load.targets} target{'s' if load.targets > 1 else ''} on the "
                     f"endpoint): {load.speedup:.2f}x measured each"
                     + (f", {load.predicted_speedup:.2f}x predicted by the targets' policies "
                        f"({_off(load.predicted_speedup, load.speedup)})" if load.predicted_speedup else ""))
        lines.append(f"  acceptance {load.accept_len or 0:.2f} tokens a step; drafter {load.cores_busy:.2f} cores busy, "
                     f"{1e3 * load.core_s_per_token:.1f} core-ms a target token")
        lines.append(f"  one drafter core: {load.full_speed_targets:.2f} targets at full speed, pays up to "
                     f"{load.paying_targets:.2f} targets")
        one = alone.get(load.model)
        if load.targets > 1 and one is not None:
            predicted = one.speedup_with(load.targets, one.drafter_cores)
            lines.append(f"  predicted from {one.mode} alone on {one.drafter_cores} drafter cores: {predicted:.2f}x each "
                         f"({_off(predicted, load.speedup)}); drafter cores busy {load.targets * one.cores_per_target:.2f} "
                         f"unbatched, {load.cores_busy:.2f} measured")
    return "\n".join(lines)
