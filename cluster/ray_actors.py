"""The actors a Ray-launched cluster runs (cluster/ray_launcher.py starts them): the state actor, each
member's server supervised as a child process on its node, and the registry's Redis. This code runs in
Ray's worker processes, on whichever node Ray picked."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from specpool.cluster.processes import start_server
from specpool.cluster.ray_plan import STATE, with_host, with_ports
from specpool.common.security import TLS_DIR_ENV


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
    """The registry's Redis as a member: on this node's address, with the cluster's password and each
    member's own user (the state actor's redis_users: a restarted one makes them again)."""

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
        for user, (secret, rules) in ray.get(state.get.remote()).get("redis_users", {}).items():
            self.redis.add_user(user, rules, password=secret)
        state.remember.remote("redis", {"node_ip": self.node_ip, "ports": {"--port": self.redis.port},
                                        "pid": self.redis.proc.pid})
        self._draining = False
        threading.Thread(target=self._supervise, daemon=True, name="supervise-redis").start()

    def _supervise(self) -> None:
        self.redis.proc.wait()
        if not self._draining:
            os._exit(1)

    def add_user(self, name: str, password: str, rules: list[str]) -> None:
        """A member's Redis user (specpool.common.registry_schema.member_acl's rules), made now."""
        self.redis.add_user(name, rules, password=password)

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

