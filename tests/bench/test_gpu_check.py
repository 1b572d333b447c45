"""The GPU check (bench/gpu_check.py) in its dry mode on the CPU: the same code a GPU run takes, so it
cannot rot; its sampling check tells a biased twin from the real verifier."""

import json

import pytest

from specpool.bench import gpu_check


@pytest.mark.slow
def test_the_gpu_check_runs_dry_on_the_cpu_and_passes(tmp_path):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--dry-run", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["tensor_channel_backend"] == "gloo"
    assert report["greedy"]["equal"] and report["ok"]
    sampling = report["sampling"]
    assert sampling["tv"] < sampling["bound"] < sampling["biased_twin_tv"]
    assert set(report["speed"]) == {"ar", "sd:4", "ssd:4", "ok"}
    assert all(row["equal_to_ar"] for mode, row in report["speed"].items() if mode != "ok")
    assert report["speed"]["sd:4"]["tokens_per_step"] > 1.0  # drafts were verified and accepted


def test_the_sampling_check_fails_a_verifier_told_the_wrong_q():
    import torch

    rows = 20_000
    bound = gpu_check.check_sampling(torch.device("cpu"), rows)["bound"]
    assert gpu_check.tv_of_first_token(torch.device("cpu"), rows, misreport_q=True) > 2 * bound
