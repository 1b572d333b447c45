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

Each member logs in to the cluster's Redis as a user of its own (as `specpool up`'s do: its role's
ACL, specpool.common.registry_schema.member_acl): the launcher makes the user on the Redis actor and
records it in the state actor, so a restarted Redis gets its users back and `scale` reuses a tenant's.
On an operator's Redis (redis.url) every member gets that URL.

Secure by default as `specpool up`: every member's /metrics wants the cluster's metrics token (the
state actor's metrics_token: $SPECPOOL_METRICS_TOKEN when set, else a fresh one); one throwaway CA;
its directory (certificate, key, tokens) travels
to each actor in its arguments (held by Ray's GCS, to restart it) and the cluster's state actor,
which `scale` and clients in other processes read. Run with --insecure only on a private network.
The parts: ray_plan.py works out names, flags, resources and placement groups without Ray;
ray_actors.py holds the actors (the state, a member's server, Redis) that run on Ray's nodes;
ray_members.py finds a running cluster's members from any process (RayMembers, attach()); this
module starts, scales and stops them (RayCluster).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import urllib.parse
from collections import Counter
from dataclasses import replace
from typing import Self

from specpool.cluster.config import ClusterConfig, EndpointSpec, RaySpec, TargetSpec
from specpool.cluster.launcher import (
    endpoint_command,
    endpoint_of,
    router_command,
    router_name,
    target_command,
    target_tiers,
)
from specpool.cluster.ray_actors import ClusterState, MemberServer, RedisServer
from specpool.cluster.ray_members import RayMembers, _named_actors, connect
from specpool.cluster.ray_plan import NAMESPACE, STATE, _free, _index, actor_name, placement_groups, resources
from specpool.common.logs import LOG_FORMAT_ENV
from specpool.common.metrics_http import METRICS_TOKEN_ENV
from specpool.common.registry_schema import PREFIX, member_acl
from specpool.common.security import LocalCA
from specpool.common.serving import REDIS_URL_ENV

log = logging.getLogger(__name__)

TIERS = ("router", "target", "endpoint", "redis")  # the order down() drains them in


class RayCluster(RayMembers):
    """A cluster file's members on a Ray cluster: start() them, or attach() to them started elsewhere
    (ray_members.py), then scale() and down()."""

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
                "metrics_token": None if insecure else os.environ.get(METRICS_TOKEN_ENV) or secrets.token_urlsafe(24),
                "redis_users": {},  # user -> (password, ACL rules): each member's own, on the Redis started here
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
            actor_name("router", router_name(r, i)), "router", router_command(r, i), r.ray, None, r.cpus, True, None,
            router_name(r, i))
            for i in range(r.count)}, timeout_s, say)

    def _endpoint(self, e: EndpointSpec, strategies: dict, index: int = 0):
        """The endpoint's first instance (the file's), or one more (`scale_endpoint`): its own id, NAME-i,
        and free ports."""
        name = actor_name("endpoint", e.name, index or None)
        spec = replace(e, name=f"{e.name or 'endpoint'}-{index}", port=0, metrics_port=0) if index else e
        return self._member(name, "endpoint", endpoint_command(spec), e.ray, e.threads, e.cpus, True,
                            strategies.get(name), spec.name)

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
                            t.threads, t.cpus, False, strategy, t.tenant)

    def _least_loaded(self, endpoint: str, avoid: tuple[str, ...] = ()) -> dict:
        """The info of the endpoint's instance (not in `avoid`) the fewest targets draft on; the first on a tie."""
        import ray

        instances = [ray.get(a.info.remote()) for n, a in self.endpoint_instances(endpoint).items() if n not in avoid]
        if len(instances) == 1:  # as at start, while the targets are not up to count
            return instances[0]
        load = Counter(i["drafts_on"] for i in self.infos("target").values() if i)
        return min(instances, key=lambda i: load[i["address"]])

    def _member(self, name: str, role: str, args: list[str], ray_spec: RaySpec, threads, cpus, keep_ports: bool,
                strategy, registers_as: str):
        env = {REDIS_URL_ENV: self._registry_url(role, registers_as)}
        if self.spec["log_format"]:
            env[LOG_FORMAT_ENV] = self.spec["log_format"]
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        if self.spec.get("metrics_token"):
            env[METRICS_TOKEN_ENV] = self.spec["metrics_token"]
        if self.spec["insecure"]:
            args = args + ["--insecure"]
        return _remote(MemberServer).options(name=name, **self._actor_options(ray_spec, threads, strategy)).remote(
            name, role, args, env, self.spec["ca_files"], list(cpus) if cpus else None, keep_ports, self.namespace)

    def _registry_url(self, role: str, name: str) -> str:
        """A member's registry URL: on the Redis started here, a user of its own that may write only its
        role's keys (a target's: its tenant's), as `specpool up` makes; on an operator's Redis, that URL.
        A user is made once (a tenant's replicas share theirs) and kept in the state actor, whence a
        restarted Redis actor makes it again."""
        import ray

        if self.config.redis.url or not self.spec["redis_url"]:
            return self.spec["redis_url"]
        user = f"{role}-{name}".replace(" ", "_")
        users = self.spec.setdefault("redis_users", {})
        if user not in users:
            users[user] = (secrets.token_urlsafe(24), member_acl(PREFIX, role, name))
            ray.get(self._state().update.remote(redis_users=users))  # first: a Redis restarting now reads it
            redis = ray.get_actor(actor_name("redis", "registry"), namespace=self.namespace)
            ray.get(redis.add_user.remote(user, *users[user]))
        address = urllib.parse.urlsplit(self.spec["redis_url"]).netloc.rpartition("@")[2]
        return f"redis://{urllib.parse.quote(user, safe='')}:{users[user][0]}@{address}/0"

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


def _remote(cls):
    import ray

    return ray.remote(cls)


def _in_group(pg, index: int):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def _cause(error) -> str:
    """A failed actor's own exception text (its server's log)."""
    return str(getattr(error, "error_msg", None) or error)

