"""Installs the Prometheus server the dashboard's live check runs (tests/cluster/test_dashboard_prometheus.py;
`make test-deps`, which `make test` runs): `prometheus` on PATH, else Debian's `prometheus` package
copied into .cache/prometheus/, no install as root needed: `apt-get download prometheus` fetches the .deb
from the machine's configured Debian mirror (after `apt-get update` when the package lists lack it and this
runs as root) and `dpkg-deb -x` unpacks it, of which only the binary is kept. It is a static Go binary
needing only libc; the package's other dependencies (the web UI's JavaScript libraries, adduser) serve
nothing the HTTP API needs.

    python scripts/install_prometheus.py    # prints the binary's path (downloads it once)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGE = "prometheus"
CACHE = Path(__file__).resolve().parents[1] / ".cache" / "prometheus"
INSTALL_COMMAND = "make test-deps"
WHAT_TO_INSTALL = (f"run `{INSTALL_COMMAND}` (as root, or after `sudo apt-get update`), or `sudo apt-get install "
                   f"{PACKAGE}`, or put a prometheus binary on PATH")


class PrometheusInstallError(Exception):
    """No Prometheus could be installed here: the message says what to install."""


def cached_path(cache: Path = CACHE) -> Path:
    return cache / "prometheus"


def find_prometheus(cache: Path = CACHE) -> Path | None:
    """A runnable prometheus already here (on PATH, or the cached one), else None."""
    for found in (shutil.which("prometheus"), cached_path(cache)):
        if found and _version(Path(found)):
            return Path(found)
    return None


def ensure_prometheus(cache: Path = CACHE, timeout_s: float = 300.0) -> Path:
    """A runnable prometheus: the one found here, or Debian's package unpacked first."""
    found = find_prometheus(cache)
    if found is not None:
        return found
    missing = [tool for tool in ("apt-get", "dpkg-deb") if shutil.which(tool) is None]
    if missing:
        raise PrometheusInstallError(f"no {' or '.join(missing)} here to fetch Debian's {PACKAGE} package: "
                                     f"{WHAT_TO_INSTALL}")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        # apt-get download writes the .deb into its working directory; as root it warns that its _apt user
        # cannot write there and downloads unsandboxed, which is harmless.
        try:
            _run(["apt-get", "download", PACKAGE], tmp, timeout_s)
        except PrometheusInstallError:
            if os.geteuid() != 0:
                raise
            # A fresh machine's package lists may not name it yet (or name a version the mirror dropped).
            _run(["apt-get", "update"], tmp, timeout_s)
            _run(["apt-get", "download", PACKAGE], tmp, timeout_s)
        debs = sorted(Path(tmp).glob(f"{PACKAGE}_*.deb"))
        if not debs:
            raise PrometheusInstallError(f"apt-get download {PACKAGE} left no {PACKAGE}_*.deb: {WHAT_TO_INSTALL}")
        unpacked = Path(tmp) / "root"
        _run(["dpkg-deb", "-x", str(debs[-1]), str(unpacked)], tmp, timeout_s)
        shipped, binary = unpacked / "usr" / "bin" / "prometheus", cached_path(cache)
        if not shipped.is_file():
            raise PrometheusInstallError(f"{debs[-1].name} has no usr/bin/prometheus: {WHAT_TO_INSTALL}")
        os.replace(shipped, binary)  # renamed into place: a concurrent run never sees half a binary
    if not _version(binary):
        raise PrometheusInstallError(f"{binary} from Debian's {PACKAGE} package does not run here: "
                                     f"{WHAT_TO_INSTALL}")
    return binary


def _run(command: list[str], cwd: str, timeout_s: float) -> None:
    what = " ".join(command)
    try:
        out = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PrometheusInstallError(f"{what} failed ({e}): {WHAT_TO_INSTALL}") from e
    if out.returncode != 0:
        raise PrometheusInstallError(f"{what} exited with {out.returncode}: {out.stderr.strip()[-500:]}\n"
                                     f"{WHAT_TO_INSTALL}")


def _version(binary: Path) -> str:
    """Its `--version` line ("" when it does not run)."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False)
    except OSError:
        return ""
    return (out.stdout or out.stderr).strip().splitlines()[0] if out.returncode == 0 else ""


def main() -> int:
    try:
        print(ensure_prometheus())
    except PrometheusInstallError as e:
        print(f"install_prometheus: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
