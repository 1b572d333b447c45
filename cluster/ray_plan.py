"""What a cluster file asks of Ray, worked out without Ray (cluster/ray_launcher.py starts it): the actors'
names, each server's host and port flags, the resources each actor reserves, and the placement groups
that keep a target beside its endpoint or a tenant's replicas apart."""

from __future__ import annotations

from dataclasses import dataclass

from specpool.cluster.config import ClusterConfig, RaySpec
from specpool.cluster.launcher import endpoint_of

NAMESPACE = "specpool"
STATE = "cluster"  # the state actor's name
PORT_FLAGS = ("--port", "--metrics-port", "--http-port")


def actor_name(role: str, name: str, index: int | None = None) -> str:
    return f"{role}:{name}" if index is None else f"{role}:{name}:{index}"


def with_host(args: list[str], role: str, host: str) -> list[str]:
    """args listening on host: --host (and what each role advertises) right after the subcommand, so a
    cluster file's own `args` still override them."""
    flags = ["--host", host]
    if role in ("target", "endpoint"):
        flags += ["--advertise-host", host]
    if role == "endpoint":
        flags += ["--channel-host", host]
    return args[:1] + flags + args[1:]


def with_ports(args: list[str], ports: dict[str, int]) -> list[str]:
    """args with the port flags set to ports[flag] (those args have)."""
    out = list(args)
    for flag, port in ports.items():
        if flag in out:
            out[out.index(flag) + 1] = str(port)
    return out


def resources(spec: RaySpec, threads: int | None) -> dict:
    """The actor's resource options."""
    num_cpus = spec.num_cpus if spec.num_cpus is not None else (threads or 1)
    return {"num_cpus": num_cpus, "num_gpus": spec.num_gpus, "resources": dict(spec.resources)}


def bundle(spec: RaySpec, threads: int | None) -> dict[str, float]:
    r = resources(spec, threads)
    out = {"CPU": r["num_cpus"], "GPU": r["num_gpus"], **r["resources"]}
    return {k: v for k, v in out.items() if v} or {"CPU": 0.001}  # a bundle must ask for something


@dataclass(frozen=True, slots=True)
class Group:
    """A placement group: its strategy and (actor name, bundle) in bundle order."""

    name: str
    strategy: str  # STRICT_PACK or STRICT_SPREAD
    members: tuple[tuple[str, dict[str, float]], ...]


def placement_groups(config: ClusterConfig) -> list[Group]:
    """The placement groups a cluster file asks for: each endpoint with the targets placed with it
    (STRICT_PACK), and each strict_spread tenant with more than one replica (STRICT_SPREAD)."""
    groups = []
    for e in config.endpoints:
        packed = [(actor_name("target", t.tenant, i), bundle(t.ray, t.threads))
                  for t in config.targets if t.ray.placement == "with_endpoint" and endpoint_of(config, t) == e.name
                  for i in range(t.ray.replicas)]
        if packed:
            groups.append(Group(f"pack:{e.name}", "STRICT_PACK",
                                ((actor_name("endpoint", e.name), bundle(e.ray, e.threads)), *packed)))
    for t in config.targets:
        if t.ray.placement == "strict_spread" and t.ray.replicas > 1:
            groups.append(Group(f"spread:{t.tenant}", "STRICT_SPREAD",
                                tuple((actor_name("target", t.tenant, i), bundle(t.ray, t.threads))
                                      for i in range(t.ray.replicas))))
    return groups


def ray_cpus_needed(config: ClusterConfig) -> float:
    """The CPUs the file's members ask Ray for, all together (to size a one-node Ray for it)."""
    total = sum(resources(t.ray, t.threads)["num_cpus"] * t.ray.replicas for t in config.targets)
    total += sum(resources(e.ray, e.threads)["num_cpus"] for e in config.endpoints)
    total += resources(config.routers.ray, None)["num_cpus"] * config.routers.count
    return total + (0 if config.redis.url else resources(config.redis.ray, None)["num_cpus"])



def _index(name: str) -> int:
    """A member's index: I of target:TENANT:I or endpoint:NAME:I; 0 for endpoint:NAME, the file's instance."""
    parts = name.split(":")
    return int(parts[2]) if len(parts) > 2 else 0


def _free(indices: list[int], count: int) -> list[int]:
    """The `count` lowest indices not in use."""
    return [i for i in range(len(indices) + count) if i not in indices][:count]

