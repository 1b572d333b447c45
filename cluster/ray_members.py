"""A Ray-launched cluster as any process sees it: connect() joins the Ray cluster, and RayMembers finds
the running members' actors in the cluster's Ray namespace, asks each for its info, lists them as
`specpool up` does, and holds the credentials and addresses clients reach them with. RayCluster
(cluster/ray_launcher.py) adds starting, scaling and stopping them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Self

from specpool.cluster.config import ClusterConfig
from specpool.cluster.launcher import Member
from specpool.cluster.ray_actors import _write_ca
from specpool.cluster.ray_plan import NAMESPACE, STATE, _index, actor_name
from specpool.common.registry import redacted
from specpool.common.security import LocalCA, Security


def connect(address: str | None = None, node_ip: str | None = None, namespace: str = NAMESPACE) -> None:
    """Joins the Ray cluster at address ("auto": the local node's, or $RAY_ADDRESS) unless this process
    already has; node_ip: this process's own address towards it (default: Ray's choice)."""
    import ray

    if ray.is_initialized():
        return
    ray.init(address=address or "auto", namespace=namespace, _node_ip_address=node_ip, log_to_driver=False,
             logging_level=logging.WARNING)


class RayMembers:
    """The members of the cluster in one Ray namespace (attach() to one started elsewhere)."""

    def __init__(self, namespace: str, spec: dict, ca: LocalCA | None):
        self.namespace = namespace
        self.spec = spec  # config, ca_files, redis_url, insecure, log_format
        self.config: ClusterConfig = spec["config"]
        self.ca = ca
        self._scratch: Path | None = None  # the local copy of an attached cluster's CA

    # -- attach, use -------------------------------------------------------------------------------------

    @classmethod
    def attach(cls, address: str | None = None, node_ip: str | None = None, namespace: str = NAMESPACE) -> Self:
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



def _named_actors(namespace: str) -> list[str]:
    from ray.util import list_named_actors

    return [a["name"] for a in list_named_actors(all_namespaces=True) if a["namespace"] == namespace]

