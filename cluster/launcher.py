"""The one launcher of specpool servers: each server's command line from its spec (cluster/config.py),
and a whole cluster as local processes. `specpool up`, the demo and the benchmarks start servers here:

    with Cluster.start(ClusterConfig.load(path).with_free_ports()) as cluster:
        stub = TargetServiceStub(cluster.router_channel("alpha"))

Servers start tier by tier (Redis, endpoints, targets, routers; the servers of one tier in
parallel, except that the first target of each model starts alone, before its siblings, so a first run
measures each step-cost table once and undisturbed) and each counts as up once it reports its ports and its
readiness (cluster/processes.py). A server's `cpus` pin it with taskset (cores this machine lacks:
unpinned, with a note) and its `threads` set torch's and OpenMP's thread counts. stop() drains
front to back: SIGTERM to every router (each drains its in-flight requests), wait, then the
targets, then the endpoints, then Redis.

Secure by default: a throwaway CA (specpool/common/security.py, in a 0700 temporary directory) gives
each server a certificate naming it, every target's tenant and every weighted tenant gets a bearer
token (`cluster.token(tenant)`, `cluster.router_channel(tenant)`), and Redis gets a random password.
Each server logs in to Redis as a user of its own, whose ACL lets it write only its role's keys
(specpool.common.registry_schema.member_acl); the default user (the password) stays the
operator's. /metrics wants $SPECPOOL_METRICS_TOKEN when it is set (the servers inherit it); else, on
loopback, they serve it with --metrics-open (cluster/processes.start_server).
Servers read the CA's directory and the Redis URL from the environment, so no secret is in a
process's arguments. `insecure=True` (`specpool up --insecure`) runs plaintext and open.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import grpc

from specpool.cluster.config import ClusterConfig, EndpointSpec, RouterSpec, TargetSpec
from specpool.cluster.processes import ServerProcess, start_server
from specpool.common.logs import LOG_FORMAT_ENV
from specpool.common.registry import redacted
from specpool.common.registry_schema import PREFIX, member_acl
from specpool.common.security import LocalCA, Security
from specpool.common.serving import REDIS_URL_ENV

# -- command lines -----------------------------------------------------------------------------------


def _optional(flag: str, value) -> list[str]:
    """[flag, value], or nothing for None: the server's own default."""
    return [] if value is None else [flag, str(value)]


def endpoint_command(e: EndpointSpec) -> list[str]:
    args = ["serve-spec", "--port", str(e.port), "--metrics-port", str(e.metrics_port),
            *_optional("--max-sessions", e.max_sessions), *_optional("--endpoint-id", e.name or None)]
    for drafter in e.drafters:
        args += ["--drafter", drafter]
    return args + _optional("--threads", e.threads or None) + list(e.args)


def target_command(t: TargetSpec, endpoint_address: str | None) -> list[str]:
    """serve-target drafting on the endpoint at endpoint_address (None: on none)."""
    args = ["serve-target", "--port", str(t.port), "--metrics-port", str(t.metrics_port), "--tenant", t.tenant,
            *_optional("--max-batch", t.max_batch), *_optional("--max-context", t.max_context), "--dtype", t.dtype,
            *_optional("--spec-endpoint", endpoint_address), *_optional("--model", t.model),
            *_optional("--datastore", t.datastore), *_optional("--threads", t.threads or None),
            *_optional("--layout-cores", t.layout_cores)]
    return args + list(t.args)


def router_name(r: RouterSpec, index: int) -> str:
    return f"router-{index}" if r.count > 1 else "router"


def router_command(r: RouterSpec, index: int) -> list[str]:
    """The index-th router: ports count up from the first (0: free ports)."""
    args = ["serve-router", "--port", str(r.port + index if r.port else 0), "--name", router_name(r, index),
            "--metrics-port", str(r.metrics_port + index if r.metrics_port else 0),
            "--http-port", str(r.http_port + index if r.http_port > 0 else r.http_port)]
    if r.tenant_weights:
        args += ["--tenant-weights", ",".join(f"{k}={v:g}" for k, v in r.tenant_weights.items())]
    return args + list(r.args)


def endpoint_of(config: ClusterConfig, t: TargetSpec) -> str:
    """The name of the endpoint t drafts on ("": none)."""
    first = config.endpoints[0].name if config.endpoints else ""
    return first if t.endpoint is None else t.endpoint


def target_tiers(targets: tuple[TargetSpec, ...]) -> list[list[TargetSpec]]:
    """The tiers targets start in: the first target of each model, dtype and thread count alone, one after
    another, then all the others. Those share a cached step-cost table, measured by the first on a first run:
    alone, so not under the load of a sibling or of another model's first measuring its own (the default
    cluster's 1.5B and SmolLM2 targets, on the same 2 cores)."""
    firsts: dict[tuple, TargetSpec] = {}
    for t in targets:
        firsts.setdefault((t.model, t.dtype, t.threads), t)
    leaders = list(firsts.values())
    others = [t for t in targets if t not in leaders]
    return [[t] for t in leaders] + ([others] if others else [])


# -- the running cluster -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Member:
    role: str  # redis, router, target, endpoint
    name: str
    address: str
    metrics_port: int = 0
    detail: str = ""


class Cluster:
    """Running servers of one ClusterConfig; stop() (or leaving the `with` block) drains them all."""

    def __init__(self, config: ClusterConfig, insecure: bool = False, log_format: str | None = None):
        self.config = config
        self.insecure = insecure
        self.log_format = log_format  # every server's (None: as $SPECPOOL_LOG_FORMAT, which they inherit)
        self.ca: LocalCA | None = None  # the throwaway CA (None: insecure)
        self.redis = None  # cluster.redis_server.RedisProcess when this cluster started one
        self.redis_url = config.redis.url or ""
        self.endpoints: dict[str, ServerProcess] = {}
        self.targets: dict[str, ServerProcess] = {}
        self.routers: list[ServerProcess] = []
        self.notes: list[str] = []
        self.pins: dict[str, list[int] | None] = {}  # the cores each server actually runs on (None: any)
        self._stopped = False

    # -- start -------------------------------------------------------------------------------------

    @classmethod
    def start(cls, config: ClusterConfig, echo: bool = False, timeout_s: float = 300.0,
              progress=None, insecure: bool = False, log_format: str | None = None) -> Cluster:
        """Starts every server and returns once all report readiness; on any failure stops what
        started and raises with the failing server's log. `progress(text)` hears each step."""
        cluster = cls(config, insecure, log_format)
        say = progress or (lambda text: None)
        try:
            cluster._start(echo, timeout_s, say)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start(self, echo: bool, timeout_s: float, say) -> None:
        allowed = _allowed_cpus()
        if not self.config.redis.url:
            from specpool.cluster.redis_server import start_redis

            say("redis: starting")
            data_dir = Path(self.config.redis.data_dir) if self.config.redis.data_dir else None
            self.redis = start_redis(self.config.redis.port, data_dir)
            self.redis_url = self.redis.url
        env: dict[str, str] = {}  # each server's Redis URL is added by spawn: in the environment, not an argument
        if self.log_format:
            env[LOG_FORMAT_ENV] = self.log_format
        if self.insecure:
            security_args = ["--insecure"]
        else:
            self.ca = LocalCA.temporary()
            for tenant in [t.tenant for t in self.config.targets] + list(self.config.routers.tenant_weights):
                self.ca.token(tenant)
            env.update(self.ca.env)
            security_args = []

        def spawn(name: str, args: list[str], cpus, threads, redis_url: str) -> ServerProcess:
            server_env = {**env, REDIS_URL_ENV: redis_url}
            if threads:
                server_env["OMP_NUM_THREADS"] = str(threads)
            server = start_server(name, args, timeout_s=timeout_s, cpus=self._pin(name, cpus, allowed),
                                  env=server_env, echo=echo)
            say(f"{name}: ready on {server.address}")
            return server

        jobs = {e.name: (endpoint_command(e) + security_args, e.cpus, e.threads,
                         self._registry_url("endpoint", e.name)) for e in self.config.endpoints}
        say(f"endpoints: starting {', '.join(jobs) or 'none'} (loading draft models)")
        self.endpoints = self._start_tier(jobs, spawn)

        jobs = {}
        for t in self.config.targets:
            endpoint = endpoint_of(self.config, t)
            address = self.endpoints[endpoint].address if endpoint else None
            jobs[t.tenant] = (target_command(t, address) + security_args, t.cpus, t.threads,
                              self._registry_url("target", t.tenant))
        say(f"targets: starting {', '.join(jobs) or 'none'} (loading models; the first run measures step costs)")
        for tier in target_tiers(self.config.targets):
            self.targets |= self._start_tier({t.tenant: jobs[t.tenant] for t in tier}, spawn)

        r = self.config.routers
        jobs = {router_name(r, i): (router_command(r, i) + security_args, r.cpus, None,
                                    self._registry_url("router", router_name(r, i))) for i in range(r.count)}
        if jobs:
            say(f"routers: starting {', '.join(jobs)}")
        self.routers = list(self._start_tier(jobs, spawn).values())

    def _registry_url(self, role: str, name: str) -> str:
        """A member's registry URL: on the Redis started here, a user of its own that may write only its
        role's keys (a target's: its tenant's); on an operator's Redis (redis.url), that URL."""
        if self.redis is None:
            return self.redis_url
        user = f"{role}-{name}".replace(" ", "_")
        return self.redis.add_user(user, member_acl(PREFIX, role, name))

    def _start_tier(self, jobs: dict, spawn) -> dict[str, ServerProcess]:
        """Starts one tier's servers in parallel; all of them or none (the started ones stop again)."""
        if not jobs:
            return {}
        interrupted: KeyboardInterrupt | None = None
        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = {name: pool.submit(spawn, name, *job) for name, job in jobs.items()}
            pending = set(futures.values())
            while pending:
                try:
                    _, pending = wait(pending)
                except KeyboardInterrupt as e:  # let each start end (or fail), so nothing runs on unseen
                    interrupted = e
        done = {name: f.result() for name, f in futures.items() if f.exception() is None}
        errors = [f.exception() for f in futures.values() if f.exception() is not None]
        if interrupted or errors:
            _stop_all(list(done.values()))
            raise interrupted or errors[0]
        return done

    def _pin(self, name: str, cpus, allowed: set[int]) -> list[int] | None:
        pin = list(cpus) if cpus else None
        missing = sorted(set(cpus or ()) - allowed)
        if missing:
            self.notes.append(f"{name}: cpus {list(cpus)}: {missing} not available here (have {sorted(allowed)}); "
                              "running unpinned")
            pin = None
        self.pins[name] = pin
        return pin

    # -- use -----------------------------------------------------------------------------------------

    @property
    def router_address(self) -> str:
        if not self.routers:
            raise RuntimeError("this cluster runs no router")
        return self.routers[0].address

    @property
    def router_addresses(self) -> list[str]:
        return [r.address for r in self.routers]

    def token(self, tenant: str) -> str | None:
        """The tenant's bearer token for the routers (issued now if it has none); None when insecure."""
        return self.ca.token(tenant) if self.ca is not None else None

    def credentials(self, tenant: str = "alpha") -> Security:
        """A client of this cluster: the tenant's token towards routers, and a client certificate
        (client/<tenant>) towards targets and endpoints."""
        return self.ca.client(tenant, tenant) if self.ca is not None else Security.insecure()

    def operator_credentials(self) -> Security:
        """An operator's tool (operator/ops): it reads every tenant's figures, where a tenant's reads its own."""
        return self.ca.operator() if self.ca is not None else Security.insecure()

    def router_channel(self, tenant: str = "alpha", index: int = 0, options=None) -> grpc.Channel:
        return self.credentials(tenant).channel(self.routers[index].address, "router", options=options)

    def http_url(self, index: int = 0) -> str:
        """The base URL of a router's OpenAI-compatible front (its certificate names router.specpool)."""
        router = self.routers[index]
        return f"{'http' if self.ca is None else 'https'}://127.0.0.1:{router.http_port}/v1"

    def members(self) -> list[Member]:
        out = [Member("router", r.name, r.address, r.metrics_port,
                      f"Target API (front door); capacity: http://127.0.0.1:{r.metrics_port}/capacity"
                      + (f"; OpenAI API: {self.http_url(i)}" if r.http_port else ""))
               for i, r in enumerate(self.routers)]
        for t in self.config.targets:
            s = self.targets.get(t.tenant)
            if s is not None:
                out.append(Member("target", t.tenant, s.address, s.metrics_port,
                                  f"{Path(t.model).name if t.model else 'SmolLM2-135M-Instruct'}, "
                                  f"batch {t.max_batch}, cpus {_cpus_text(self.pins.get(t.tenant))}"
                                  + (f", {s.detail}" if s.detail else "")))
        for e in self.config.endpoints:
            s = self.endpoints.get(e.name)
            if s is not None:
                out.append(Member("endpoint", e.name, s.address, s.metrics_port,
                                  f"{e.max_sessions} sessions, cpus {_cpus_text(self.pins.get(e.name))}"))
        if self.redis_url:
            out.append(Member("redis", "registry", redacted(self.redis_url), 0,
                              "started here" if self.redis is not None else "external"))
        return out

    def servers(self) -> list[ServerProcess]:
        return [*self.routers, *self.targets.values(), *self.endpoints.values()]

    def dead(self) -> list[ServerProcess]:
        return [s for s in self.servers() if not s.alive()]

    # -- stop ----------------------------------------------------------------------------------------

    def stop(self, grace_s: float = 20.0) -> None:
        """Drains front to back: routers, targets, endpoints (SIGTERM each, wait), then Redis."""
        if self._stopped:
            return
        self._stopped = True
        for tier in (self.routers, list(self.targets.values()), list(self.endpoints.values())):
            _stop_all(tier, grace_s)
        if self.redis is not None:
            self.redis.close()
        if self.ca is not None:
            shutil.rmtree(self.ca.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _stop_all(servers: list[ServerProcess], grace_s: float = 20.0) -> None:
    """SIGTERM every server at once (each drains), then wait for each; SIGKILL what outlives grace_s."""
    for s in servers:
        if s.alive():
            s.proc.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace_s
    for s in servers:
        try:
            s.proc.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            s.kill()


def _allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def _cpus_text(cpus) -> str:
    return ",".join(map(str, cpus)) if cpus else "any"


def format_members(cluster: Cluster) -> str:
    rows = [("role", "name", "address", "metrics", "")]
    for m in cluster.members():
        host = m.address.rpartition(":")[0]
        metrics = f"http://{host}:{m.metrics_port}/metrics" if m.metrics_port else "-"
        rows.append((m.role, m.name, m.address, metrics, m.detail))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
