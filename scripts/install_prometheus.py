"""Finds a Prometheus server for the dashboard's live check (tests/cluster/test_dashboard_prometheus.py):
`prometheus` on PATH, else Debian's `prometheus` package unpacked into .cache/prometheus/, no root
needed: `apt-get download prometheus` fetches the .deb from the machine's configured Debian mirror and
`dpkg-deb -x` unpacks it. The package is a static Go binary needing only libc; its other
dependencies (the web UI's JavaScript libraries, adduser) serve nothing the HTTP API needs.

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
WHAT_TO_INSTALL = ("install Debian's prometheus package (`sudo apt-get update && sudo apt-get install "
                   "prometheus`) or put a prometheus binary on PATH")


class PrometheusUnavailable(Exception):
    """No way to install it here: no apt-get or dpkg-deb (not a Debian-like system)."""


class PrometheusInstallError(Exception):
    """apt-get is here but the download or the unpacking failed: the message says what to install."""


def cached_path(cache: Path = CACHE) -> Path:
    return cache / "root" / "usr" / "bin" / "prometheus"


def ensure_prometheus(cache: Path = CACHE, timeout_s: float = 300.0) -> Path:
    """A runnable prometheus: the one on PATH, the cached one, or Debian's package unpacked first."""
    for found in (shutil.which("prometheus"), cached_path(cache)):
        if found and _version(Path(found)):
            return Path(found)
    missing = [tool for tool in ("apt-get", "dpkg-deb") if shutil.which(tool) is None]
    if missing:
        raise PrometheusUnavailable(f"no {' or '.join(missing)} here to fetch Debian's {PACKAGE} package: "
                                    f"{WHAT_TO_INSTALL}")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        # apt-get download writes the .deb into its working directory; as root it warns that its _apt user
        # cannot write there and downloads unsandboxed, which is harmless.
        _run(["apt-get", "download", PACKAGE], tmp, timeout_s, "apt-get download prometheus")
        debs = sorted(Path(tmp).glob(f"{PACKAGE}_*.deb"))
        if not debs:
            raise PrometheusInstallError(f"apt-get download {PACKAGE} left no {PACKAGE}_*.deb: {WHAT_TO_INSTALL}")
        unpacked = Path(tmp) / "root"
        _run(["dpkg-deb", "-x", str(debs[-1]), str(unpacked)], tmp, timeout_s, f"dpkg-deb -x {debs[-1].name}")
        # Swapped in whole: a concurrent run never sees half a tree.
        target = cache / "root"
        if target.exists():
            shutil.rmtree(target)
        os.replace(unpacked, target)
    binary = cached_path(cache)
    if not _version(binary):
        raise PrometheusInstallError(f"{binary} from Debian's {PACKAGE} package does not run here: "
                                     f"{WHAT_TO_INSTALL}")
    return binary


def _run(command: list[str], cwd: str, timeout_s: float, what: str) -> None:
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
    except (PrometheusUnavailable, PrometheusInstallError) as e:
        print(f"install_prometheus: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
