"""A cluster file's members as Ray actors on an existing Ray cluster: `specpool up --ray [ADDRESS]`,
`specpool scale TENANT N`, `specpool scale --endpoint NAME N`, `specpool down`. From Python:

    cluster = RayCluster.start(ClusterConfig.load(path), address="auto")
    stub = TargetServiceStub(cluster.router_channel("alpha"))
    cluster.scale("alpha", 2)
    cluster.scale_endpoint("spec", 2)
    cluster.down()

Each member is one detached, named actor (namespace "specpool": `scale` and `down` find them from
another process) that asks Ray for what its file's `ray:` key states (num_cpus, num_gpus, custom
resources), so Ray picks its node. The actor runs the same command line as `specpool up`
(cluster/launcher.py's builders) as a child process (cluster/processes.start_server), listening on
its node's address, and supervises it: when the server dies the actor exits, and Ray restarts it
(max_restarts), which starts the server again. A target comes back on fresh ports and registers in
Redis anew, as a new replica; meanwhile the routers route around it. Endpoints, routers and Redis
come back on the ports they had (remembered by the cluster's state actor) when they land on the same
node, since targets know their endpoint and clients their router by address.

Placement: a target whose `ray.placement` is with_endpoint shares a STRICT_PACK placement group with
its endpoint (one host, for the tensor channel); strict_spread puts the tenant's replicas in a
STRICT_SPREAD group (a node each); spread asks Ray's SPREAD strategy. Replicas added later by `scale`
go to the endpoint's node (with_endpoint) or by SPREAD: a placement group cannot grow.

An endpoint scales by instances: the file's, endpoint:NAME, and more, endpoint:NAME:I, each its own
server (id NAME-I, its own draft slots). A target starts drafting on the instance the fewest targets
use, and keeps it: an instance that drains first has its targets replaced by ones drafting elsewhere.

Secure by default as `specpool up`: one throwaway CA; its directory (certificate, key, tokens) travels
to each actor in its arguments (held by Ray's GCS, to restart it) and the cluster's state actor,
which `scale` and clients in other processes read. Run with --insecure only on a private network.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Self

from specpool.cluster.config import ClusterConfig, EndpointSpec, RaySpec, TargetSpec
from specpool.cluster.launcher import (
    Member,
    endpoint_command,
    endpoint_of,
    router_command,
    router_name,
    target_command,
    target_tiers,
)
from specpool.cluster.processes import start_server
from specpool.common.logs import LOG_FORMAT_ENV
from specpool.common.registry import redacted
from specpool.common.security import TLS_DIR_ENV, LocalCA, Security
from specpool.common.serving import REDIS_URL_ENV

log = logging.getLogger(__name__)

NAMESPACE = "specpool"
STATE = "cluster"  # the state actor's name
TIERS = ("router", "target", "endpoint", "redis")  # the order down() drains them in
PORT_FLAGS = ("--port", "--metrics-port", "--http-port")

# -- pure planning: names, command lines, placement ----------------------------------------------------


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


# -- the actors ------------------------------------------------------------------------------------------


class ClusterState:
    """The cluster as its launcher started it (file, CA, Redis URL), and the ports each restartable
    member last served on. A detached actor: `scale`, `down` and clients in other processes read it."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.served: dict[str, dict] = {}

    def get(self) -> dict:
        return self.spec

    def update(self, **fields) -> None:
        self.spec.update(fields)

    def remember(self, name: str, report: dict) -> None:
        self.served[name] = report

    def last(self, name: str) -> dict | None:
        return self.served.get(name)


class MemberServer:
    """One specpool server as a child of this actor, on this node's address; exits (so Ray restarts the
    actor) when the server dies, unless told to drain it."""

    def __init__(self, name: str, role: str, args: list[str], env: dict[str, str], ca_files: dict[str, bytes],
                 cpus: list[int] | None, keep_ports: bool, namespace: str, timeout_s: float = 300.0):
        import ray

        self.name, self.role = name, role
        # The endpoint instance a target drafts on: scale_endpoint counts each instance's targets.
        self.drafts_on = args[args.index("--spec-endpoint") + 1] if "--spec-endpoint" in args else None
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.state = ray.get_actor(STATE, namespace=namespace)
        self.tls_dir = _write_ca(ca_files)
        env = {**env, **({TLS_DIR_ENV: str(self.tls_dir)} if self.tls_dir else {})}
        args = with_host(args, role, self.node_ip)
        last = ray.get(self.state.last.remote(name)) if keep_ports else None
        if last and last["node_ip"] == self.node_ip:  # a restart on the same node: the same address
            args = with_ports(args, last["ports"])
        self.notes = []
        self.server = _start_retrying(name, args, env, _pin(cpus, self.notes), self.node_ip, timeout_s)
        self.state.remember.remote(name, {"node_ip": self.node_ip, "ports": {
            "--port": self.server.port, "--metrics-port": self.server.metrics_port,
            "--http-port": self.server.http_port}})
        self._draining = False
        threading.Thread(target=self._supervise, daemon=True, name=f"supervise-{name}").start()

    def _supervise(self) -> None:
        code = self.server.proc.wait()
        if not self._draining:
            sys.stderr.write(f"{self.name}: server exited with {code}; its log:\n{self.server.logs()}\n")
            sys.stderr.flush()
            os._exit(1)  # the actor dies with its server: Ray restarts both

    def info(self) -> dict:
        s = self.server
        return {"name": self.name, "role": self.role, "address": s.address, "metrics_port": s.metrics_port,
                "http_port": s.http_port, "node_ip": self.node_ip, "node_id": self.node_id,
                "server_pid": s.proc.pid, "actor_pid": os.getpid(), "alive": s.alive(), "notes": self.notes,
                "drafts_on": self.drafts_on}

    def drain(self, grace_s: float = 20.0) -> int:
        """SIGTERM: the server finishes its in-flight requests and exits (SIGKILL after grace_s)."""
        self._draining = True
        code = self.server.stop(grace_s)
        if self.tls_dir:
            shutil.rmtree(self.tls_dir.parent, ignore_errors=True)
        return code


class RedisServer:
    """The registry's Redis as a member: on this node's address, with the cluster's password."""

    def __init__(self, port: int, password: str, data_dir: str | None, namespace: str):
        import ray

        from specpool.cluster.redis_server import start_redis

        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        state = ray.get_actor(STATE, namespace=namespace)
        last = ray.get(state.last.remote("redis"))
        if last and last["node_ip"] == self.node_ip:  # a restart on the same node: the same address
            port = last["ports"]["--port"]
            _end(last["pid"], port)  # redis-server outlives a killed parent (the servers drain by themselves)
        self.redis = start_redis(port, Path(data_dir) if data_dir else None, host=self.node_ip, password=password)
        state.remember.remote("redis", {"node_ip": self.node_ip, "ports": {"--port": self.redis.port},
                                        "pid": self.redis.proc.pid})
        self._draining = False
        threading.Thread(target=self._supervise, daemon=True, name="supervise-redis").start()

    def _supervise(self) -> None:
        self.redis.proc.wait()
        if not self._draining:
            os._exit(1)

    def info(self) -> dict:
        return {"name": "redis", "role": "redis", "address": f"{self.node_ip}:{self.redis.port}", "metrics_port": 0,
                "http_port": 0, "node_ip": self.node_ip, "node_id": self.node_id, "server_pid": self.redis.proc.pid,
                "actor_pid": os.getpid(), "alive": self.redis.alive(), "notes": []}

    def drain(self, grace_s: float = 5.0) -> int:
        self._draining = True
        self.redis.close()
        return 0


def _end(pid: int, port: int) -> None:
    """SIGTERM the redis-server of this member's previous incarnation, if it still runs, and wait."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        if b"redis-server" not in cmd or f"--port\0{port}\0".encode() not in cmd:
            return
        os.kill(pid, signal.SIGTERM)
    except OSError:
        return
    end = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < end:
        time.sleep(0.1)


def _write_ca(files: dict[str, bytes]) -> Path | None:
    """The cluster's CA directory, written on this node (0700); None when insecure."""
    if not files:
        return None
    directory = Path(tempfile.mkdtemp(prefix="specpool-ca-")) / "ca"
    directory.mkdir(mode=0o700)
    for name, data in files.items():
        path = directory / name
        path.touch(0o600)
        path.write_bytes(data)
    return directory


def _pin(cpus: list[int] | None, notes: list[str]) -> list[int] | None:
    if not cpus:
        return None
    missing = sorted(set(cpus) - set(os.sched_getaffinity(0)))
    if missing:
        notes.append(f"cpus {cpus}: {missing} not on this node; running unpinned")
        return None
    return list(cpus)


def _start_retrying(name: str, args: list[str], env: dict, cpus, host: str, timeout_s: float):
    """start_server; while its port is still held (the previous incarnation of a restarted member drains
    on the same port), again."""
    end = time.monotonic() + 60.0
    while True:
        try:
            return start_server(name, args, timeout_s=timeout_s, cpus=cpus, env=env, host=host)
        except RuntimeError as e:
            if not ("cannot bind" in str(e) or "Address already in use" in str(e)) or time.monotonic() > end:
                raise
            time.sleep(1.0)


# -- the driver's side -----------------------------------------------------------------------------------


def connect(address: str | None = None, node_ip: str | None = None, namespace: str = NAMESPACE) -> None:
    """Joins the Ray cluster at address ("auto": the local node's, or $RAY_ADDRESS) unless this process
    already has; node_ip: this process's own address towards it (default: Ray's choice)."""
    import ray

    if ray.is_initialized():
        return
    ray.init(address=address or "auto", namespace=namespace, _node_ip_address=node_ip, log_to_driver=False,
             logging_level=logging.WARNING)


class RayCluster:
    """A cluster file's members on a Ray cluster (start(), or attach() to one started elsewhere)."""

    def __init__(self, namespace: str, spec: dict, ca: LocalCA | None):
        self.namespace = namespace
        self.spec = spec  # config, ca_files, redis_url, insecure, log_format
        self.config: ClusterConfig = spec["config"]
        self.ca = ca
        self._scratch: Path | None = None  # the local copy of an attached cluster's CA

    # -- start -------------------------------------------------------------------------------------

    @classmethod
    def start(cls, config: ClusterConfig, address: str | None = None, node_ip: str | None = None,
              namespace: str = NAMESPACE, insecure: bool = False, log_format: str | None = None,
              timeout_s: float = 300.0, progress=None) -> RayCluster:
        """Starts every member as an actor and returns once all serve; on any failure removes what it
        started (actors, placement groups, the state actor) and raises with the failing member's log."""
        import ray

        connect(address, node_ip, namespace)
        if _named_actors(namespace):
            raise RuntimeError(f"a specpool cluster already runs in Ray namespace {namespace!r}: "
                               f"`specpool down` it first, or pass another namespace")
        ca = None if insecure else LocalCA.temporary()
        if ca is not None:
            for tenant in [t.tenant for t in config.targets] + list(config.routers.tenant_weights):
                ca.token(tenant)
        spec = {"config": config, "insecure": insecure, "log_format": log_format, "redis_url": config.redis.url or "",
                "ca_files": {p.name: p.read_bytes() for p in ca.dir.iterdir() if p.is_file()} if ca else {}}
        cluster = cls(namespace, spec, ca)
        try:
            ray.get(_remote(ClusterState).options(
                name=STATE, namespace=namespace, lifetime="detached", num_cpus=0, max_restarts=-1,
            ).remote(spec).get.remote())
            cluster._start(timeout_s, progress or (lambda text: None))
        except BaseException:
            cluster.down(grace_s=5.0)
            raise
        return cluster

    def _start(self, timeout_s: float, say) -> None:
        import ray
        from ray.util import placement_group

        config = self.config
        strategies: dict[str, object] = {}  # actor name -> its scheduling strategy
        for g in placement_groups(config):
            # Detached, so a restarted member gets its bundle back; only down() removes a group (Ray
            # warns that removing one kills its actors: down() has drained them by then).
            pg = placement_group([b for _, b in g.members], strategy=g.strategy,
                                 name=f"{self.namespace}:{g.name}", lifetime="detached")
            say(f"placement group {g.name}: {g.strategy} for {', '.join(n for n, _ in g.members)}")
            if not pg.wait(timeout_seconds=timeout_s):
                raise RuntimeError(f"placement group {g.name} ({g.strategy} of {[b for _, b in g.members]}) "
                                   f"cannot be placed on this Ray cluster in {timeout_s:g}s")
            for index, (name, _) in enumerate(g.members):
                strategies[name] = _in_group(pg, index)
        if not config.redis.url:
            say("redis: starting")
            password = secrets.token_urlsafe(24)
            redis = _remote(RedisServer).options(
                name=actor_name("redis", "registry"), **self._actor_options(config.redis.ray, None, None),
            ).remote(config.redis.port, password, config.redis.data_dir, self.namespace)
            [info] = self._wait({"redis": redis}, timeout_s, say)
            url = f"redis://:{password}@{info['address']}/0"
            self.spec["redis_url"] = url
            ray.get(self._state().update.remote(redis_url=url))

        say(f"endpoints: starting {', '.join(e.name for e in config.endpoints) or 'none'} (loading draft models)")
        self._wait({e.name: self._endpoint(e, strategies) for e in config.endpoints}, timeout_s, say)
        say("targets: starting (loading models; the first run measures step costs)")
        for tier in target_tiers(config.targets):
            self._wait({actor_name("target", t.tenant, i): self._target(t, i, strategies.get(actor_name(
                "target", t.tenant, i))) for t in tier for i in range(t.ray.replicas)}, timeout_s, say)
        r = config.routers
        if r.count:
            say(f"routers: starting {r.count}")
        self._wait({router_name(r, i): self._member(
            actor_name("router", router_name(r, i)), "router", router_command(r, i), r.ray, None, r.cpus, True, None)
            for i in range(r.count)}, timeout_s, say)

    def _endpoint(self, e: EndpointSpec, strategies: dict, index: int = 0):
        """The endpoint's first instance (the file's), or one more (`scale_endpoint`): its own id, NAME-i,
        and free ports."""
        name = actor_name("endpoint", e.name, index or None)
        spec = replace(e, name=f"{e.name or 'endpoint'}-{index}", port=0, metrics_port=0) if index else e
        return self._member(name, "endpoint", endpoint_command(spec), e.ray, e.threads, e.cpus, True,
                            strategies.get(name))

    def _target(self, t: TargetSpec, index: int, strategy=None, avoid: tuple[str, ...] = ()):
        """The index-th replica of t, drafting on the instance of its endpoint with the fewest targets
        (not one of `avoid`, instances being drained)."""
        endpoint = endpoint_of(self.config, t)
        address = None
        if endpoint:
            info = self._least_loaded(endpoint, avoid)
            address = info["address"]
            if strategy is None and t.ray.placement == "with_endpoint":  # a replica added later: beside it
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                strategy = NodeAffinitySchedulingStrategy(info["node_id"], soft=False)
        strategy = strategy or (None if t.ray.placement == "with_endpoint" else "SPREAD")
        return self._member(actor_name("target", t.tenant, index), "target", target_command(t, address), t.ray,
                            t.threads, t.cpus, False, strategy)

    def _least_loaded(self, endpoint: str, avoid: tuple[str, ...] = ()) -> dict:
        """The info of the endpoint's instance (not in `avoid`) the fewest targets draft on; the first on a tie."""
        import ray

        instances = [ray.get(a.info.remote()) for n, a in self.endpoint_instances(endpoint).items() if n not in avoid]
        if len(instances) == 1:  # as at start, while the targets are not up to count
            return instances[0]
        load = Counter(i["drafts_on"] for i in self.infos("target").values() if i)
        return min(instances, key=lambda i: load[i["address"]])

    def _member(self, name: str, role: str, args: list[str], ray_spec: RaySpec, threads, cpus, keep_ports: bool,
                strategy):
        env = {REDIS_URL_ENV: self.spec["redis_url"]}
        if self.spec["log_format"]:
            env[LOG_FORMAT_ENV] = self.spec["log_format"]
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        if self.spec["insecure"]:
            args = args + ["--insecure"]
        return _remote(MemberServer).options(name=name, **self._actor_options(ray_spec, threads, strategy)).remote(
            name, role, args, env, self.spec["ca_files"], list(cpus) if cpus else None, keep_ports, self.namespace)

    def _actor_options(self, spec: RaySpec, threads, strategy) -> dict:
        options = {"namespace": self.namespace, "lifetime": "detached", "max_restarts": spec.max_restarts,
                   **resources(spec, threads)}
        if strategy is not None:
            options["scheduling_strategy"] = strategy
        return options

    def _wait(self, actors: dict, timeout_s: float, say) -> list[dict]:
        """Each actor's info() once it serves; raises naming the first that failed, with its log."""
        import ray

        infos = []
        for name, actor in actors.items():
            try:
                info = ray.get(actor.info.remote(), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(f"{name}: not placed or not ready in {timeout_s:g}s (does the Ray cluster have "
                                   "the resources its `ray:` key asks for?)") from None
            except ray.exceptions.RayActorError as e:
                raise RuntimeError(f"{name} failed to start: {_cause(e)}") from None
            say(f"{name}: ready on {info['address']} (node {info['node_ip']}, {info['node_id'][:8]})")
            infos.append(info)
        return infos

    # -- attach, use -------------------------------------------------------------------------------------

    @classmethod
    def attach(cls, address: str | None = None, node_ip: str | None = None, namespace: str = NAMESPACE) -> RayCluster:
        """The cluster started in this Ray namespace, from any process."""
        import ray

        connect(address, node_ip, namespace)
        try:
            state = ray.get_actor(STATE, namespace=namespace)
        except ValueError:
            raise RuntimeError(f"no specpool cluster runs in Ray namespace {namespace!r}") from None
        spec = ray.get(state.get.remote())
        cluster = cls(namespace, spec, None)
        if spec["ca_files"]:
            cluster._scratch = _write_ca(spec["ca_files"])
            cluster.ca = LocalCA(cluster._scratch)
        return cluster

    def _state(self):
        import ray

        return ray.get_actor(STATE, namespace=self.namespace)

    def actors(self, role: str | None = None) -> dict[str, object]:
        """Actor name -> handle of the running members (of one role), in name order."""
        import ray

        names = sorted(n for n in _named_actors(self.namespace) if n != STATE and (role is None or
                                                                                    n.startswith(role + ":")))
        return {n: ray.get_actor(n, namespace=self.namespace) for n in names}

    def endpoint_instances(self, endpoint: str) -> dict[str, object]:
        """Actor name -> handle of an endpoint's running instances, the first (the file's) first."""
        first, actors = actor_name("endpoint", endpoint), self.actors("endpoint")
        names = [n for n in actors if n == first or n.startswith(first + ":")]
        return {n: actors[n] for n in sorted(names, key=_index)}

    def infos(self, role: str | None = None, timeout_s: float = 30.0) -> dict[str, dict | None]:
        """Actor name -> its info() (None: not answering, e.g. restarting)."""
        import ray

        out = {}
        for name, actor in self.actors(role).items():
            try:
                out[name] = ray.get(actor.info.remote(), timeout=timeout_s)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                out[name] = None
        return out

    def members(self) -> list[Member]:
        """The members as `specpool up` lists them (cluster/launcher.format_members)."""
        out = []
        for name, info in self.infos().items():
            role, _, rest = name.partition(":")
            if info is None:
                out.append(Member(role, rest, "-", 0, "not answering (restarting?)"))
            elif role == "redis":
                out.append(Member(role, rest, redacted(self.spec["redis_url"]), 0, f"node {info['node_ip']}"))
            else:
                out.append(Member(role, rest, info["address"], info["metrics_port"],
                                  f"node {info['node_ip']} ({info['node_id'][:8]})"
                                  + "".join(f"; {n}" for n in info["notes"])))
        if self.config.redis.url:
            out.append(Member("redis", "registry", redacted(self.config.redis.url), 0, "external"))
        return out

    @property
    def router_addresses(self) -> list[str]:
        return [i["address"] for i in self.infos("router").values() if i]

    @property
    def router_address(self) -> str:
        addresses = self.router_addresses
        if not addresses:
            raise RuntimeError("this cluster runs no router")
        return addresses[0]

    def token(self, tenant: str) -> str | None:
        return self.ca.token(tenant) if self.ca is not None else None

    def credentials(self, tenant: str = "alpha") -> Security:
        return self.ca.client(tenant, tenant) if self.ca is not None else Security.insecure()

    def operator_credentials(self) -> Security:
        return self.ca.operator() if self.ca is not None else Security.insecure()

    def router_channel(self, tenant: str = "alpha", index: int = 0, options=None):
        return self.credentials(tenant).channel(self.router_addresses[index], "router", options=options)

    def http_url(self, index: int = 0) -> str:
        info = list(self.infos("router").values())[index]
        host = info["address"].rpartition(":")[0]
        return f"{'http' if self.ca is None else 'https'}://{host}:{info['http_port']}/v1"

    # -- scale, down ---------------------------------------------------------------------------------------

    def scale(self, tenant: str, replicas: int, grace_s: float = 20.0, timeout_s: float = 300.0,
              progress=None) -> tuple[list[str], list[str]]:
        """The tenant's target replicas to `replicas`: new ones start (and register) beside the others;
        extra ones drain (finishing their in-flight requests) and go. Returns (added, drained) names."""
        say = progress or (lambda text: None)
        spec = next((t for t in self.config.targets if t.tenant == tenant), None)
        if spec is None:
            raise ValueError(f"no target with tenant {tenant!r} in this cluster "
                             f"(have {[t.tenant for t in self.config.targets]})")
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        running = self.actors(f"target:{tenant}")
        indices = sorted(map(_index, running))
        added, drained = [], []
        if replicas > len(indices):
            new = {actor_name("target", tenant, i): self._target(spec, i)
                   for i in _free(indices, replicas - len(indices))}
            say(f"{tenant}: adding {', '.join(new)}")
            self._wait(new, timeout_s, say)
            added = list(new)
        elif replicas < len(indices):
            drained = [actor_name("target", tenant, i) for i in indices[replicas:]]
            say(f"{tenant}: draining {', '.join(drained)}")
            _drain_all({n: running[n] for n in drained}, grace_s)
        return added, drained

    def scale_endpoint(self, endpoint: str, instances: int, grace_s: float = 20.0, timeout_s: float = 300.0,
                       progress=None) -> tuple[list[str], list[str]]:
        """The endpoint's instances to `instances` (its first, the file's, always stays). New ones start
        beside the others, each with its own id and draft slots, and take the targets added after them
        (a new target drafts on the instance with the fewest). Before an instance drains, each target
        drafting on it is replaced by a replica drafting on one that stays (up first, then the old one
        drains), so no target is left without its drafts. Returns (added, drained) actor names."""
        say = progress or (lambda text: None)
        spec = next((e for e in self.config.endpoints if e.name == endpoint), None)
        if spec is None:
            raise ValueError(f"no endpoint named {endpoint!r} in this cluster (have {[e.name for e in self.config.endpoints]})")
        if instances < 1:
            raise ValueError(f"instances must be >= 1 (an endpoint keeps the cluster file's instance), got {instances}")
        running = self.endpoint_instances(endpoint)
        indices = sorted(map(_index, running))
        added, drained = [], []
        if instances > len(indices):
            new = {actor_name("endpoint", endpoint, i): self._endpoint(spec, {}, i)
                   for i in _free(indices, instances - len(indices))}
            say(f"{endpoint}: adding {', '.join(new)}")
            self._wait(new, timeout_s, say)
            added = list(new)
        elif instances < len(indices):
            drained = [actor_name("endpoint", endpoint, i or None) for i in indices[instances:]]
            leaving = {info["address"] for name, info in self.infos("endpoint").items() if name in drained and info}
            for name, info in self.infos("target").items():
                if info is not None and info["drafts_on"] in leaving:
                    self._replace_target(name, tuple(drained), grace_s, timeout_s, say)
            say(f"{endpoint}: draining {', '.join(drained)}")
            _drain_all({n: running[n] for n in drained}, grace_s)
        return added, drained

    def _replace_target(self, name: str, avoid: tuple[str, ...], grace_s: float, timeout_s: float, say) -> None:
        """A new replica of the target `name` (drafting on an endpoint instance not in `avoid`), then `name` drained."""
        tenant = name.split(":")[1]
        spec = next(t for t in self.config.targets if t.tenant == tenant)
        replicas = self.actors(f"target:{tenant}")
        [index] = _free(list(map(_index, replicas)), 1)
        new = actor_name("target", tenant, index)
        say(f"{name}: replaced by {new}, which drafts on an endpoint instance that stays")
        self._wait({new: self._target(spec, index, avoid=avoid)}, timeout_s, say)
        _drain_all({name: replicas[name]}, grace_s)

    def down(self, grace_s: float = 20.0) -> None:
        """Drains front to back (routers, targets, endpoints, Redis: each tier's servers finish their
        in-flight requests and exit), then removes the actors, the placement groups and the state."""
        import ray
        from ray._raylet import PlacementGroupID
        from ray.util import placement_group_table, remove_placement_group
        from ray.util.placement_group import PlacementGroup

        for role in TIERS:
            _drain_all(self.actors(role), grace_s)
        for name in _named_actors(self.namespace):  # whatever is left: the state, a member that never named a tier
            try:
                ray.kill(ray.get_actor(name, namespace=self.namespace), no_restart=True)
            except ValueError:
                pass
        for pg_id, pg in placement_group_table().items():
            if (pg.get("name") or "").startswith(f"{self.namespace}:") and pg.get("state") != "REMOVED":
                remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(pg_id)))
        if self.ca is not None:
            shutil.rmtree(self.ca.dir, ignore_errors=True)
        if self._scratch is not None:
            shutil.rmtree(self._scratch.parent, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.down()


def _drain_all(actors: dict, grace_s: float) -> None:
    """Drains every actor's server at once, waits for each to exit, then removes the actors for good."""
    import ray

    pending = {name: actor.drain.remote(grace_s) for name, actor in actors.items()}
    for name, ref in pending.items():
        try:
            ray.get(ref, timeout=grace_s + 15)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            log.warning("%s: did not drain (%s); killing it (its server drains once its actor is gone)",
                        name, type(e).__name__)
    for actor in actors.values():
        ray.kill(actor, no_restart=True)


def _index(name: str) -> int:
    """A member's index: I of target:TENANT:I or endpoint:NAME:I; 0 for endpoint:NAME, the file's instance."""
    parts = name.split(":")
    return int(parts[2]) if len(parts) > 2 else 0


def _free(indices: list[int], count: int) -> list[int]:
    """The `count` lowest indices not in use."""
    return [i for i in range(len(indices) + count) if i not in indices][:count]


def _named_actors(namespace: str) -> list[str]:
    from ray.util import list_named_actors

    return [a["name"] for a in list_named_actors(all_namespaces=True) if a["namespace"] == namespace]


def _remote(cls):
    import ray

    return ray.remote(cls)


def _in_group(pg, index: int):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def _cause(error) -> str:
    """A failed actor's own exception text (its server's log)."""
    return str(getattr(error, "error_msg", None) or error)

