"""The client package (client/) installs into a fresh virtual environment without torch, and its
example streams a completion from a cluster that `specpool up` starts (two SmolLM2 targets), equal (greedy) to
what the router returns to the main environment's stubs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_client_installs_without_torch_and_its_example_runs_against_specpool_up(tmp_path):
    from specpool.cluster.config import SMOLLM2_CONFIG, ClusterConfig
    from specpool.cluster.launcher import Cluster
    from specpool_client import generate_request, generate_result
    from specpool_client.v1 import target_pb2_grpc

    venv = tmp_path / "venv"
    # The base interpreter, not this environment's: nothing of the project's is installed there.
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "--quiet", str(REPO / "client")], check=True, timeout=600)
    no_torch = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True, check=False)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr, no_torch.stderr
    installed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                               check=True).stdout
    assert "specpool-client" in installed and "torch" not in installed, installed

    cluster = Cluster.start(ClusterConfig.load(SMOLLM2_CONFIG).with_free_ports())
    try:
        router = cluster.routers[0].address
        token = cluster.token("alpha")
        ca = cluster.ca.dir / "ca.crt"
        example = subprocess.run(
            [python, str(REPO / "client" / "examples" / "generate.py"), "--address", router, "--ca-cert", str(ca),
             "--token", token, "--prompt", "def fibonacci(n):", "--max-tokens", "24"],
            capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
        assert example.returncode == 0, example.stderr
        text, _, stats = example.stdout.rpartition("\n[")
        assert stats.startswith("24 tokens, FINISH_REASON_LENGTH") or "FINISH_REASON_STOP" in stats, stats
        stub = target_pb2_grpc.TargetServiceStub(cluster.router_channel("alpha"))
        want = generate_result(stub, generate_request("def fibonacci(n):", max_tokens=24, speculation="none"),
                               timeout=300).completions[0].text
        assert text == want
    finally:
        cluster.stop()
