"""`specpool up`: a whole specpool cluster as local processes, described by a YAML file.

The embedded default (cluster/default.yaml) is Redis, one router, two target services (tenants
"alpha" and "beta" of SmolLM2-135M-Instruct) and one speculation endpoint, all registering in
Redis. Other topologies are other files (cluster/examples/). As a library:

    with Cluster.start(ClusterConfig.load(path).with_free_ports()) as cluster:
        stub = TargetServiceStub(cluster.router_channel("alpha"))

Servers start tier by tier (Redis, endpoints, targets, routers; the servers of one tier in
parallel, except that the first target of each model starts before its siblings, so a first run
measures the shared step-cost table once) and each counts as up once its gRPC health service
reports `readiness` SERVING. A server's `cpus` pin it with taskset (cores this machine lacks:
unpinned, with a note) and its `threads` set torch's and OpenMP's thread counts. stop() drains
front to back: SIGTERM to every router (each drains its in-flight requests), wait, then the
targets, then the endpoints, then Redis.

Secure by default: a throwaway CA (specpool/security.py, in a 0700 temporary directory) gives each
server a certificate naming it, every target's tenant and every weighted tenant gets a bearer token
(`cluster.token(tenant)`, `cluster.router_channel(tenant)`), and Redis gets a random password. Servers
read the CA's directory and the Redis URL from the environment, so no secret is in a process's
arguments. `insecure=True` (`specpool up --insecure`) runs plaintext and open, with a warning.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Self

import grpc
import yaml
from specpool.cluster.processes import ServerProcess, start_server

from specpool.common.registry import redacted
from specpool.common.security import LocalCA, Security
from specpool.common.serving import REDIS_URL_ENV

DEFAULT_CONFIG = Path(__file__).with_name("default.yaml")


class ConfigError(ValueError):
    """A cluster file that does not describe a cluster; the message names the key."""


# -- configuration ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RedisConfig:
    port: int = 0  # 0: a free port
    url: str | None = None  # an external Redis: nothing is started
    data_dir: str | None = None  # keep the registry on disk across restarts


@dataclass(frozen=True, slots=True)
class RouterConfig:
    count: int = 1
    port: int = 0  # of the first router; the others take the next ports (0: free ports)
    metrics_port: int = 0
    tenant_weights: dict[str, float] = field(default_factory=dict)
    cpus: tuple[int, ...] | None = None
    args: tuple[str, ...] = ()  # further serve-router flags


@dataclass(frozen=True, slots=True)
class EndpointConfig:
    name: str = "spec"
    drafters: tuple[str, ...] = ()  # NAME=TARGET_GGUF[,draft=DIR][,datastore=NPZ]; empty: the default model's
    max_sessions: int = 32
    threads: int | None = 1
    cpus: tuple[int, ...] | None = None
    port: int = 0
    metrics_port: int = 0
    args: tuple[str, ...] = ()  # further serve-spec flags


@dataclass(frozen=True, slots=True)
class TargetConfig:
    tenant: str
    model: str | None = None  # a GGUF path; None: SmolLM2-135M-Instruct
    max_batch: int = 8
    max_context: int = 1024
    threads: int | None = 1
    cpus: tuple[int, ...] | None = None
    endpoint: str | None = None  # name of the endpoint it drafts on (None: the first; "": none)
    datastore: str | None = None  # local n-gram datastore (None: serve-target's default; "": none)
    dtype: str = "auto"
    port: int = 0
    metrics_port: int = 0
    args: tuple[str, ...] = ()  # further serve-target flags


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    redis: RedisConfig = RedisConfig()
    routers: RouterConfig = RouterConfig()
    endpoints: tuple[EndpointConfig, ...] = ()
    targets: tuple[TargetConfig, ...] = ()

    @classmethod
    def load(cls, path: Path | str | None = None) -> ClusterConfig:
        path = Path(path) if path else DEFAULT_CONFIG
        return cls.from_dict(yaml.safe_load(path.read_text()) or {}, str(path))

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config") -> ClusterConfig:
        _check_keys(raw, cls, where)
        endpoints = tuple(_build(EndpointConfig, e, f"{where}: endpoints[{i}]")
                          for i, e in enumerate(_list(raw.get("endpoints"), f"{where}: endpoints")))
        targets = tuple(_build(TargetConfig, t, f"{where}: targets[{i}]")
                        for i, t in enumerate(_list(raw.get("targets"), f"{where}: targets")))
        config = cls(
            redis=_build(RedisConfig, raw.get("redis") or {}, f"{where}: redis"),
            routers=_build(RouterConfig, raw.get("routers") or {}, f"{where}: routers"),
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
            if t.max_batch < 1 or t.max_context < 64:
                raise ConfigError(f"{where}: targets[{i}]: max_batch must be >= 1 and max_context >= 64")
        for i, e in enumerate(self.endpoints):
            if e.max_sessions < 1:
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
            routers=replace(self.routers, port=0, metrics_port=0),
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
        elif f.name == "model" and value == "default":
            value = None
        elif value is not None or "None" not in f.type:
            expected = {"int": int, "float": (int, float), "str": str}.get(f.type.split(" |")[0], object)
            if not isinstance(value, expected) or isinstance(value, bool):
                raise ConfigError(f"{where}.{f.name}: expected {f.type.split(' |')[0]}, got {value!r}")
        values[f.name] = value
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from e


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

    def __init__(self, config: ClusterConfig, insecure: bool = False):
        self.config = config
        self.insecure = insecure
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
              progress=None, insecure: bool = False) -> Cluster:
        """Starts every server and returns once all report readiness; on any failure stops what
        started and raises with the failing server's log. `progress(text)` hears each step."""
        cluster = cls(config, insecure)
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
        env = {REDIS_URL_ENV: self.redis_url}  # not an argument: `ps` shows those
        if self.insecure:
            redis_args = ["--insecure"]
        else:
            self.ca = LocalCA.temporary()
            for tenant in [t.tenant for t in self.config.targets] + list(self.config.routers.tenant_weights):
                self.ca.token(tenant)
            env.update(self.ca.env)
            redis_args = []

        def spawn(name: str, args: list[str], cpus, threads) -> ServerProcess:
            server_env = {**env, "OMP_NUM_THREADS": str(threads)} if threads else env
            server = start_server(name, args, timeout_s=timeout_s, cpus=self._pin(name, cpus, allowed),
                                  env=server_env, echo=echo)
            try:
                _wait_ready(server, timeout_s=30.0)
            except BaseException:
                server.stop()
                raise
            say(f"{name}: ready on {server.address}")
            return server

        jobs = {}
        for e in self.config.endpoints:
            args = ["serve-spec", "--port", str(e.port), "--metrics-port", str(e.metrics_port),
                    "--max-sessions", str(e.max_sessions), "--endpoint-id", e.name, *redis_args]
            for drafter in e.drafters:
                args += ["--drafter", drafter]
            if e.threads:
                args += ["--threads", str(e.threads)]
            jobs[e.name] = (args + list(e.args), e.cpus, e.threads)
        say(f"endpoints: starting {', '.join(jobs) or 'none'} (loading draft models)")
        self.endpoints = self._start_tier(jobs, spawn)

        jobs = {}
        first = self.config.endpoints[0].name if self.config.endpoints else ""
        for t in self.config.targets:
            args = ["serve-target", "--port", str(t.port), "--metrics-port", str(t.metrics_port),
                    "--tenant", t.tenant, "--max-batch", str(t.max_batch), "--max-context", str(t.max_context),
                    "--dtype", t.dtype, *redis_args]
            endpoint = first if t.endpoint is None else t.endpoint
            if endpoint:
                args += ["--spec-endpoint", self.endpoints[endpoint].address]
            if t.model:
                args += ["--model", t.model]
            if t.datastore is not None:
                args += ["--datastore", t.datastore]
            if t.threads:
                args += ["--threads", str(t.threads)]
            jobs[t.tenant] = (args + list(t.args), t.cpus, t.threads)
        say(f"targets: starting {', '.join(jobs) or 'none'} (loading models; the first run measures step costs)")
        # Targets of one model, dtype and thread count share a cached step-cost table: the first of
        # each starts alone, so a first run measures it once and not under its siblings' load.
        firsts: dict[tuple, str] = {}
        for t in self.config.targets:
            firsts.setdefault((t.model, t.dtype, t.threads), t.tenant)
        leaders = set(firsts.values())
        self.targets = self._start_tier({k: v for k, v in jobs.items() if k in leaders}, spawn)
        self.targets |= self._start_tier({k: v for k, v in jobs.items() if k not in leaders}, spawn)

        r = self.config.routers
        jobs = {}
        for i in range(r.count):
            name = f"router-{i}" if r.count > 1 else "router"
            args = ["serve-router", "--port", str(r.port + i if r.port else 0), "--name", name,
                    "--metrics-port", str(r.metrics_port + i if r.metrics_port else 0), *redis_args]
            if r.tenant_weights:
                args += ["--tenant-weights", ",".join(f"{k}={v:g}" for k, v in r.tenant_weights.items())]
            jobs[name] = (args + list(r.args), r.cpus, None)
        if jobs:
            say(f"routers: starting {', '.join(jobs)}")
        self.routers = list(self._start_tier(jobs, spawn).values())

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

    def router_channel(self, tenant: str = "alpha", index: int = 0, options=None) -> grpc.Channel:
        return self.credentials(tenant).channel(self.routers[index].address, "router", options=options)

    def members(self) -> list[Member]:
        out = [Member("router", r.name, r.address, r.metrics_port,
                      f"Target API (front door); capacity: http://127.0.0.1:{r.metrics_port}/capacity")
               for r in self.routers]
        for t in self.config.targets:
            s = self.targets.get(t.tenant)
            if s is not None:
                out.append(Member("target", t.tenant, s.address, s.metrics_port,
                                  f"{Path(t.model).name if t.model else 'SmolLM2-135M-Instruct'}, "
                                  f"batch {t.max_batch}, cpus {_cpus_text(self.pins.get(t.tenant))}"))
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


def _wait_ready(server: ServerProcess, timeout_s: float) -> None:
    """Until the server's /readyz (its metrics port, plain HTTP: no credentials needed) answers 200."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/readyz", timeout=2.0) as reply:
                status = reply.status
            if status == 200:
                return
        except (urllib.error.URLError, OSError) as e:
            status = getattr(e, "code", None) or str(e)
        if not server.alive() or time.monotonic() > end:
            raise RuntimeError(f"{server.name} on {server.address} is not ready (/readyz: {status}); "
                               f"its log:\n{server.logs()}")
        time.sleep(0.2)


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
        metrics = f"http://127.0.0.1:{m.metrics_port}/metrics" if m.metrics_port else "-"
        rows.append((m.role, m.name, m.address, metrics, m.detail))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# -- `specpool up` ----------------------------------------------------------------------------------


def add_arguments(p) -> None:
    p.add_argument("--config", default=None, help=f"cluster YAML (default: {DEFAULT_CONFIG.name}, the embedded "
                                                  "default: Redis, a router, two targets, one endpoint)")
    p.add_argument("--free-ports", action="store_true", help="let every server pick a free port")
    p.add_argument("--verbose", action="store_true", help="echo every server's log lines to stderr")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per server, to come up")
    p.add_argument("--insecure", action="store_true",
                   help="no TLS, tokens or certificates (anyone reaching a port is any tenant); Redis keeps its password")


def main(args) -> int:
    config = ClusterConfig.load(args.config)
    if args.free_ports:
        config = config.with_free_ports()
    stop = threading.Event()

    def on_signal(signum: int, _frame) -> None:
        stop.set()
        raise KeyboardInterrupt  # also interrupts a start in progress

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    try:
        try:
            cluster = Cluster.start(config, echo=args.verbose, timeout_s=args.timeout_s, insecure=args.insecure,
                                    progress=lambda text: print(f"[up] {text}", file=sys.stderr, flush=True))
        except KeyboardInterrupt:
            print("[up] interrupted while starting; stopped what had started", file=sys.stderr)
            return 130
        try:
            print(f"specpool cluster up in {time.monotonic() - started:.0f}s ({args.config or DEFAULT_CONFIG}):")
            print(format_members(cluster))
            for note in cluster.notes:
                print(f"note: {note}")
            if cluster.routers:
                print(f"\nsend requests to {cluster.router_address} (specpool.v1.TargetService); Ctrl-C stops "
                      "everything", flush=True)
            if cluster.ca is not None:
                print(f"TLS: CA certificate {cluster.ca.dir / 'ca.crt'} (verify the router as router.specpool); "
                      f"tenants' bearer tokens in {cluster.ca.dir / 'tokens.yaml'}", flush=True)
            else:
                print("WARNING: --insecure: plaintext and no authentication on every port", flush=True)
            while not stop.wait(1.0):
                dead = cluster.dead()
                if dead:
                    for s in dead:
                        print(f"[up] {s.name} exited with {s.proc.returncode}; its log:\n{s.logs()}", file=sys.stderr)
                    return 1
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the drain short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            print("[up] stopping: routers, targets, endpoints, redis (each drains)", file=sys.stderr, flush=True)
            cluster.stop()
            print("[up] stopped", file=sys.stderr)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
