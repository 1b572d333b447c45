"""Start specpool servers as separate processes and wait until they serve.

A launched server finds a file path in its environment (SPECPOOL_READY_FILE) and writes its bound
ports there once it serves (specpool.common.serving.report_ready), so port 0 works; it counts as up
once its /readyz answers 200 as well.

/metrics refuses every scrape without $SPECPOOL_METRICS_TOKEN unless the server has --metrics-open. A
server started here with neither (nor --insecure; an env that sets the token empty counts as one that
chose) gets --metrics-open when it listens on loopback, where only this machine reaches it, and a fresh
token otherwise; ServerProcess.metric_total and metrics_text send its token when it has one.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from weakref import WeakValueDictionary

from specpool.common.metrics_http import METRICS_TOKEN_ENV
from specpool.common.serving import LAUNCHER_PID, READY_FILE


def wait_for(predicate, timeout_s: float = 20.0, interval_s: float = 0.05):
    """Polls until predicate() is truthy and returns that value; TimeoutError after timeout_s."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"condition not met in {timeout_s}s")


@dataclass
class ServerProcess:
    """A server this process started (`start_server`), its log kept; LIVE holds those still referenced."""

    name: str
    proc: subprocess.Popen
    port: int = 0
    metrics_port: int = 0
    http_port: int = 0  # a router's OpenAI-compatible HTTP front (0: none)
    detail: str = ""  # what the server reported of itself when ready (a target: its format, its start)
    log_tail: deque = field(default_factory=lambda: deque(maxlen=400))
    command: list[str] = field(default_factory=list)  # what started it, for restart()
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"  # the address it listens on (--host; a Ray node's own on Ray)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM (graceful drain), then SIGKILL if it does not exit in time."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()

    def restart(self, timeout_s: float = 180.0) -> None:
        """A crash and a supervisor's restart: SIGKILL, then the same command on the same ports, so
        peers that know its address find it again. Blocks until it serves."""
        self.kill()
        cmd = list(self.command)
        for flag, port in (("--port", self.port), ("--metrics-port", self.metrics_port),
                           ("--http-port", self.http_port)):
            if flag in cmd:
                cmd[cmd.index(flag) + 1] = str(port)
        _launch(self, cmd, timeout_s, echo=False)

    def logs(self) -> str:
        return "".join(self.log_tail)

    def stacks(self, wait_s: float = 1.0) -> str:
        """Its log after asking it for every thread's stack (SIGUSR1, specpool/common/serving.py): where a
        server that stopped answering waits."""
        if self.alive():
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(wait_s)
        return self.logs()

    def metric_total(self, sample: str, **labels: str) -> float:
        """The sum of one sample name's values (e.g. specpool_target_generated_tokens_total) over the
        series on the server's /metrics whose labels include `labels`; OSError when it does not answer."""
        text = self.metrics_text()
        total = 0.0
        for m in re.finditer(rf"^{re.escape(sample)}(?:{{(.*)}})? (\S+)$", text, re.MULTILINE):
            if all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
                total += float(m.group(2))
        return total

    @property
    def metrics_token(self) -> str | None:
        """The token its /metrics wants (None: it has none)."""
        return self.env.get(METRICS_TOKEN_ENV) or None

    def metrics_text(self) -> str:
        """Its /metrics, read with its metrics token; OSError when it does not answer."""
        headers = {"Authorization": f"Bearer {self.metrics_token}"} if self.metrics_token else {}
        request = urllib.request.Request(f"http://{self.host}:{self.metrics_port}/metrics", headers=headers)
        with urllib.request.urlopen(request, timeout=5) as r:
            return r.read().decode()

    def ready(self) -> bool:
        """Whether its /readyz (the metrics port, plain HTTP: no credentials needed) answers 200: the
        HTTP face of the readiness its gRPC health service reports."""
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.metrics_port}/readyz", timeout=2.0) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False


def start_server(
    name: str,
    args: list[str],
    timeout_s: float = 180.0,
    cpus: list[int] | None = None,
    env: dict[str, str] | None = None,
    echo: bool = False,
    module: str = "specpool.cli",
    host: str = "127.0.0.1",
) -> ServerProcess:
    """Run `specpool <args>` (`python -m <module> <args>`) and block until it serves; raises with its
    log if it dies or is not ready in timeout_s. The server drains and exits by itself if this process
    dies (specpool/common/serving.py). `host`: the address args make it listen on (--host)."""
    cmd = [sys.executable, "-m", module, *args]
    if cpus is not None:
        cmd = ["taskset", "-c", ",".join(map(str, cpus)), *cmd]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", LAUNCHER_PID: str(os.getpid()), **(env or {})}
    if (METRICS_TOKEN_ENV not in env and not {"--metrics-open", "--insecure"} & set(args)
            and {"serve-router", "serve-target", "serve-spec"} & set(args)):
        if _on_loopback(_flag(args, "--metrics-host") or _flag(args, "--host") or "127.0.0.1"):
            cmd.append("--metrics-open")  # only this machine reaches it
        else:
            env[METRICS_TOKEN_ENV] = secrets.token_urlsafe(24)
    server = ServerProcess(name, None, env=env, host=host)
    _launch(server, cmd, timeout_s, echo)
    return server


def _flag(args: list[str], name: str) -> str | None:
    """The last value given to a flag (`--name V` or `--name=V`), as argparse takes it."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _on_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


# pid -> the ServerProcess this process started, while anything still holds it: a test past its time limit
# asks each for its stacks (tests/harness.py).
LIVE: WeakValueDictionary[int, ServerProcess] = WeakValueDictionary()


def _launch(server: ServerProcess, cmd: list[str], timeout_s: float, echo: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="specpool-ready-") as directory:
        ready_file = Path(directory) / "ready.json"  # fresh each launch: a restart reports anew
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env={**server.env, READY_FILE: str(ready_file)})
        server.proc, server.command = proc, cmd
        LIVE[proc.pid] = server
        log = threading.Thread(target=_keep_log, args=(server, echo), daemon=True, name=f"log-{server.name}")
        log.start()
        end = time.monotonic() + timeout_s
        while not ready_file.exists():
            _check_running(server, log, end, timeout_s)
            time.sleep(0.05)
        report = json.loads(ready_file.read_text())
    server.port, server.metrics_port = report["port"], report["metrics_port"]
    server.http_port = report.get("http_port", 0)
    server.detail = report.get("detail", "")
    while not server.ready():
        _check_running(server, log, end, timeout_s)
        time.sleep(0.1)


def _keep_log(server: ServerProcess, echo: bool) -> None:
    for line in server.proc.stdout:
        server.log_tail.append(line)
        if echo:
            sys.stderr.write(f"[{server.name}] {line}")


def _check_running(server: ServerProcess, log: threading.Thread, end: float, timeout_s: float) -> None:
    """Raises with the server's log (killing it) once it has exited or the time is up."""
    exited = server.proc.poll()
    if exited is None and time.monotonic() <= end:
        return
    server.kill()
    log.join(5.0)  # its last lines say why
    why = f"exited with {exited}" if exited is not None else f"not ready in {timeout_s}s"
    raise RuntimeError(f"{server.name} {why}; its log:\n{server.logs()}")
