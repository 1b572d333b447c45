"""Start specpool servers as separate processes and wait until they serve.

Every server logs one line "serving <Service> on port N, metrics on port M" once it is ready;
launchers (tests, the benchmark, `specpool up`) read the bound ports from it, so port 0 works.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field

from specpool.common.serving import LAUNCHER_PID

READY = re.compile(r"serving (\w+) on port (\d+), metrics on port (\d+)")


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
    name: str
    proc: subprocess.Popen
    port: int = 0
    metrics_port: int = 0
    log_tail: deque = field(default_factory=lambda: deque(maxlen=200))
    command: list[str] = field(default_factory=list)  # what started it, for restart()
    env: dict[str, str] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

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
        for flag, port in (("--port", self.port), ("--metrics-port", self.metrics_port)):
            if flag in cmd:
                cmd[cmd.index(flag) + 1] = str(port)
        _launch(self, cmd, timeout_s, echo=False)

    def logs(self) -> str:
        return "".join(self.log_tail)

    def metric_total(self, sample: str, **labels: str) -> float:
        """The sum of one sample name's values (e.g. specpool_target_generated_tokens_total) over the
        series on the server's /metrics whose labels include `labels`; OSError when it does not answer."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for m in re.finditer(rf"^{re.escape(sample)}(?:{{(.*)}})? (\S+)$", text, re.MULTILINE):
            if all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
                total += float(m.group(2))
        return total


def start_server(
    name: str,
    args: list[str],
    timeout_s: float = 180.0,
    cpus: list[int] | None = None,
    env: dict[str, str] | None = None,
    echo: bool = False,
    module: str = "specpool.cli",
) -> ServerProcess:
    """Run `specpool <args>` (`python -m <module> <args>`) and block until its ready line; raises with
    its log if it dies first. The server drains and exits by itself if this process dies
    (specpool/serving.py)."""
    cmd = [sys.executable, "-m", module, *args]
    if cpus is not None:
        cmd = ["taskset", "-c", ",".join(map(str, cpus)), *cmd]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", LAUNCHER_PID: str(os.getpid()), **(env or {})}
    server = ServerProcess(name, None, env=env)
    _launch(server, cmd, timeout_s, echo)
    return server


def _launch(server: ServerProcess, cmd: list[str], timeout_s: float, echo: bool) -> None:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env=server.env)
    server.proc, server.command, name = proc, cmd, server.name
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            server.log_tail.append(line)
            if echo:
                sys.stderr.write(f"[{name}] {line}")
            m = READY.search(line)
            if m and not ready.is_set():
                server.port, server.metrics_port = int(m.group(2)), int(m.group(3))
                ready.set()

    threading.Thread(target=pump, daemon=True, name=f"log-{name}").start()
    end = time.monotonic() + timeout_s
    while not ready.wait(0.1):
        if proc.poll() is not None or time.monotonic() > end:
            server.kill()
            why = f"exited with {proc.returncode}" if proc.returncode is not None else f"not ready in {timeout_s}s"
            raise RuntimeError(f"{name} {why}; its log:\n{server.logs()}")
