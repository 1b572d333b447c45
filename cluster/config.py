"""A cluster file (YAML) as data: which servers `specpool up` starts, with what settings, checked.

cluster/default.yaml is the embedded default; cluster/examples/ holds other topologies. Each key
of a file maps to a field below; an unknown key or a value of the wrong type raises ConfigError
naming it. cluster/launcher.py turns these into command lines and processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import yaml

from specpool.common.model_args import drafter_models
from specpool.engine.runtime.chunked_models import ModelNotAssembled, model_path

DEFAULT_CONFIG = Path(__file__).with_name("default.yaml")
# Two SmolLM2 targets, one endpoint: the cluster of the fast model (bench routed modes, the soak, tests).
SMOLLM2_CONFIG = Path(__file__).parent / "examples" / "smollm2.yaml"


class ConfigError(ValueError):
    """A cluster file that does not describe a cluster; the message names the key."""


PLACEMENTS = ("spread", "strict_spread", "with_endpoint")


@dataclass(frozen=True, slots=True)
class RaySpec:
    """What a member's actor asks of a Ray cluster (`specpool up --ray`, cluster/ray_launcher.py); a
    local `specpool up` ignores it. Ray places the actor on a node that has these resources."""

    num_cpus: float | None = None  # None: the member's threads, else 1
    num_gpus: float = 0
    resources: dict[str, float] = field(default_factory=dict)  # custom resources, e.g. {draft_device: 1}
    max_restarts: int = -1  # times Ray restarts the member after its server dies (-1: always)
    # Targets only: replicas of the tenant at start, and where they go: spread (Ray's SPREAD, best
    # effort), strict_spread (each on a node of its own), with_endpoint (on its endpoint's node).
    replicas: int = 1
    placement: str = "spread"


@dataclass(frozen=True, slots=True)
class RedisSpec:
    port: int = 0  # 0: a free port
    url: str | None = None  # an external Redis: nothing is started
    data_dir: str | None = None  # keep the registry on disk across restarts
    ray: RaySpec = RaySpec()


@dataclass(frozen=True, slots=True)
class RouterSpec:
    count: int = 1
    port: int = 0  # of the first router; the others take the next ports (0: free ports)
    metrics_port: int = 0
    http_port: int = 0  # the OpenAI-compatible HTTP front (0: free ports; -1: none)
    tenant_weights: dict[str, float] = field(default_factory=dict)
    cpus: tuple[int, ...] | None = None
    args: tuple[str, ...] = ()  # further serve-router flags
    ray: RaySpec = RaySpec()


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    name: str = "spec"  # "": the name in its certificate
    drafters: tuple[str, ...] = ()  # NAME=TARGET_GGUF[,draft=DIR][,head=DIR][,datastore=NPZ]; empty: the default model's
    max_sessions: int | None = 32  # None (here and below): the server's own default
    threads: int | None = 1
    cpus: tuple[int, ...] | None = None
    port: int = 0
    metrics_port: int = 0
    args: tuple[str, ...] = ()  # further serve-spec flags
    ray: RaySpec = RaySpec()


@dataclass(frozen=True, slots=True)
class TargetSpec:
    tenant: str
    model: str | None = None  # a GGUF path (a short name in the file: its assembled file); None: SmolLM2-135M-Instruct
    max_batch: int | None = 8
    max_context: int | None = 1024
    threads: int | None = 1
    # --layout-cores: the cores its layout (it and the drafter beside it) would give plain decoding
    # instead; SSD is planned only if faster than that (None: its own threads).
    layout_cores: int | None = None
    cpus: tuple[int, ...] | None = None
    endpoint: str | None = None  # name of the endpoint it drafts on (None: the first; "": none)
    datastore: str | None = None  # local n-gram datastore (None: serve-target's default; "": none)
    dtype: str = "auto"
    port: int = 0
    metrics_port: int = 0
    args: tuple[str, ...] = ()  # further serve-target flags
    ray: RaySpec = RaySpec()


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    redis: RedisSpec = RedisSpec()
    routers: RouterSpec = RouterSpec()
    endpoints: tuple[EndpointSpec, ...] = ()
    targets: tuple[TargetSpec, ...] = ()

    @classmethod
    def load(cls, path: Path | str | None = None) -> ClusterConfig:
        path = Path(path) if path else DEFAULT_CONFIG
        return cls.from_dict(yaml.safe_load(path.read_text()) or {}, str(path))

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config") -> ClusterConfig:
        _check_keys(raw, cls, where)
        endpoints = tuple(_build(EndpointSpec, e, f"{where}: endpoints[{i}]")
                          for i, e in enumerate(_list(raw.get("endpoints"), f"{where}: endpoints")))
        targets = tuple(_build(TargetSpec, t, f"{where}: targets[{i}]")
                        for i, t in enumerate(_list(raw.get("targets"), f"{where}: targets")))
        config = cls(
            redis=_build(RedisSpec, raw.get("redis") or {}, f"{where}: redis"),
            routers=_build(RouterSpec, raw.get("routers") or {}, f"{where}: routers"),
            endpoints=endpoints, targets=targets,
        )
        config.validate(where)
        return config

    def validate(self, where: str = "config") -> None:
        names = [e.name for e in self.endpoints]
        if len(set(names)) != len(names):
            raise ConfigError(f"{where}: endpoints: names must be unique, got {names}")
        tenants = [t.tenant for t in self.targets]
        if len(set(tenants)) != len(tenants):
            raise ConfigError(f"{where}: targets: tenants must be unique, got {tenants}")
        for i, t in enumerate(self.targets):
            if t.endpoint and t.endpoint not in names:
                raise ConfigError(f"{where}: targets[{i}].endpoint: no endpoint named {t.endpoint!r} (have {names})")
            if (t.max_batch or 1) < 1 or (t.max_context or 64) < 64:
                raise ConfigError(f"{where}: targets[{i}]: max_batch must be >= 1 and max_context >= 64")
            if t.ray.placement == "with_endpoint" and (t.endpoint == "" or not names):
                raise ConfigError(f"{where}: targets[{i}].ray.placement: with_endpoint needs an endpoint to pair with")
        for i, e in enumerate(self.endpoints):
            if e.max_sessions is not None and e.max_sessions < 1:
                raise ConfigError(f"{where}: endpoints[{i}].max_sessions must be >= 1, got {e.max_sessions}")
        if self.routers.count < 0:
            raise ConfigError(f"{where}: routers.count must be >= 0, got {self.routers.count}")
        unknown = set(self.routers.tenant_weights) - set(tenants)
        if unknown and self.targets:
            raise ConfigError(f"{where}: routers.tenant_weights: no target with tenant {sorted(unknown)}")
        for tenant, weight in self.routers.tenant_weights.items():
            if not isinstance(weight, (int, float)) or weight <= 0:
                raise ConfigError(f"{where}: routers.tenant_weights.{tenant} must be a number > 0, got {weight!r}")

    def with_free_ports(self) -> ClusterConfig:
        """Every port 0 (picked by the servers): for demos and tests that must not collide."""
        return replace(
            self,
            redis=replace(self.redis, port=0),
            routers=replace(self.routers, port=0, metrics_port=0,
                            http_port=min(self.routers.http_port, 0)),
            endpoints=tuple(replace(e, port=0, metrics_port=0) for e in self.endpoints),
            targets=tuple(replace(t, port=0, metrics_port=0) for t in self.targets),
        )


def _list(value, where: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def _check_keys(raw, cls: type, where: str) -> None:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")


def _build(cls: type, raw: dict, where: str):
    _check_keys(raw, cls, where)
    values = {}
    for f in fields(cls):
        if f.name not in raw:
            continue
        value = raw[f.name]
        if f.name in ("drafters", "args") and value is None:
            value = ()
        elif f.name in ("cpus", "drafters", "args") and value is not None:
            if not isinstance(value, list):
                raise ConfigError(f"{where}.{f.name}: expected a list, got {value!r}")
            if f.name == "cpus" and not all(isinstance(v, int) and v >= 0 for v in value):
                raise ConfigError(f"{where}.cpus: expected core numbers, got {value!r}")
            value = tuple(value) if f.name == "cpus" else tuple(str(v) for v in value)
        elif f.name == "tenant_weights":
            if not isinstance(value, dict):
                raise ConfigError(f"{where}.tenant_weights: expected a mapping tenant -> weight, got {value!r}")
            value = dict(value)
        elif f.name == "ray":
            value = _ray(value, f"{where}.ray", targets=cls.__name__ == "TargetSpec")
        elif f.name == "model" and value == "default":
            value = None
        elif value is not None or "None" not in f.type:
            expected = {"int": int, "float": (int, float), "str": str}.get(f.type.split(" |")[0], object)
            if not isinstance(value, expected) or isinstance(value, bool):
                raise ConfigError(f"{where}.{f.name}: expected {f.type.split(' |')[0]}, got {value!r}")
        if f.name == "model" and value is not None:
            value = _resolved(model_path, value, f"{where}.model")
        elif f.name == "drafters":
            value = tuple(_resolved(drafter_models, d, f"{where}.drafters[{i}]") for i, d in enumerate(value))
        values[f.name] = value
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from e


def _resolved(resolve, value: str, where: str) -> str:
    """A model's short name (`model: qwen2.5-coder-1.5b`, and a drafter's target and draft=) as its assembled
    file, here where the file is read: a short name `make setup` has not assembled stops `specpool up` before
    any server starts. The servers are given the path, as if the file had named it (on Ray: each node needs the
    file at that path, as it needs any path the file names)."""
    try:
        return resolve(value)
    except ModelNotAssembled as e:
        raise ConfigError(f"{where}: {e}") from e


def _ray(raw, where: str, targets: bool) -> RaySpec:
    _check_keys(raw, RaySpec, where)
    if not targets and ({"replicas", "placement"} & set(raw)):
        raise ConfigError(f"{where}: replicas and placement are for targets only")

    def number(key: str, value, least: float) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < least:
            raise ConfigError(f"{where}.{key}: expected a number >= {least:g}, got {value!r}")
        return value

    values = dict(raw)
    for key in ("num_cpus", "num_gpus"):
        if values.get(key) is not None:
            number(key, values[key], 0)
    resources = values.get("resources") or {}
    if not isinstance(resources, dict):
        raise ConfigError(f"{where}.resources: expected a mapping name -> amount, got {resources!r}")
    values["resources"] = {str(k): number(f"resources.{k}", v, 0) for k, v in resources.items()}
    for key, least in (("max_restarts", -1), ("replicas", 1)):
        if key in values and (not isinstance(values[key], int) or isinstance(values[key], bool) or values[key] < least):
            raise ConfigError(f"{where}.{key}: expected an integer >= {least}, got {values[key]!r}")
    if values.get("placement", "spread") not in PLACEMENTS:
        raise ConfigError(f"{where}.placement: expected one of {list(PLACEMENTS)}, got {values['placement']!r}")
    return RaySpec(**values)
