"""The suite's harness (tests/harness.py) in a child pytest run with `make test`'s options: a test that
executes an instruction this CPU refuses (SIGILL, as llama.cpp's AMX build died on an Intel VM) and a test
that never returns (one of them with the alarm blocked) each end as a failure naming the test, within
their limits, and every other test of their files still runs. Before tests/harness.py this run hung: pytest-xdist gave the dying test to each
replacement worker in turn, and after three the controller and the workers waited on each other."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

DYING = """
import pytest
from specpool.engine.runtime.cpu_features import _execute

@pytest.fixture(scope="module")
def shared():
    return 1

def test_before(shared):
    pass

@pytest.mark.parametrize("i", range(3))
def test_illegal_instruction(shared, i):
    _execute("ud2", bytes.fromhex("0f0bc3"))  # ud2; ret: SIGILL, the worker process dies

@pytest.mark.timeout(3)
def test_never_returns(shared):
    import time
    while True:
        time.sleep(1)

@pytest.mark.timeout(2)
def test_never_returns_and_ignores_the_alarm(shared):
    import signal, time
    signal.signal(signal.SIGALRM, signal.SIG_IGN)  # as a wait in C code that never comes back to Python
    while True:
        time.sleep(1)

def test_after(shared):
    pass
"""
FINE = """
def test_one():
    pass

def test_two():
    pass
"""


def test_a_test_that_kills_its_worker_or_hangs_is_a_failure_and_the_rest_still_runs(tmp_path):
    (tmp_path / "conftest.py").write_text("from tests.harness import *  # noqa: F403\n")
    (tmp_path / "test_dying.py").write_text(textwrap.dedent(DYING))
    (tmp_path / "test_fine.py").write_text(textwrap.dedent(FINE))
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), "-c", "/dev/null", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    took = time.monotonic() - started
    out = run.stdout + run.stderr
    failed = sorted(set(re.findall(r"^FAILED \S+::(\S+)", out, re.MULTILINE)))
    assert run.returncode == 1, out[-3000:]
    assert failed == ["test_illegal_instruction[0]", "test_illegal_instruction[1]", "test_illegal_instruction[2]",
                      "test_never_returns", "test_never_returns_and_ignores_the_alarm"], out[-3000:]
    # Each death is reported once, by name, and never rerun: one failure section each, whose text is xdist's
    # line (the short summary may repeat it: under CI=... pytest does not cut its lines to the terminal's width).
    for test in ["test_illegal_instruction[0]", "test_illegal_instruction[1]", "test_illegal_instruction[2]",
                 "test_never_returns_and_ignores_the_alarm"]:
        deaths = re.findall(rf"^worker '\w+' crashed while running '\S+{re.escape(test)}'$", out, re.MULTILINE)
        assert len(deaths) == 1, out[-3000:]
    assert "Failed: Timeout" in out  # the alarm failed the hung test where it waited; its worker went on
    assert "did not stop: every thread's stack" in out  # the backstop ended the one that ignored it
    assert re.search(r"\b4 passed\b", out), out[-3000:]  # test_before, test_after and test_fine's two
    assert took < 120, f"the run took {took:.0f} s"


STUCK_BESIDE_A_SERVER = """
import time

import pytest

from tests.cluster.test_disaggregation import start_endpoint, tiny_files

@pytest.mark.timeout(15)
def test_waits_on_a_server(tmp_path):
    gguf, draft = tiny_files(tmp_path, vocab=64, seed=3)
    endpoint = start_endpoint(gguf, draft)
    try:
        time.sleep(120)
    finally:
        endpoint.stop()  # the limit's failure runs this: the stacks were asked for before it
"""


@pytest.mark.slow
def test_a_test_failed_at_its_limit_carries_its_servers_stacks(tmp_path):
    (tmp_path / "conftest.py").write_text("from tests.harness import *  # noqa: F403\n")
    (tmp_path / "test_stuck.py").write_text(textwrap.dedent(STUCK_BESIDE_A_SERVER))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                          "-c", "/dev/null", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=240,
                         check=False)
    out = run.stdout + run.stderr
    assert run.returncode == 1 and "Failed: Timeout (>15.0s)" in out, out[-3000:]
    section = out[out.index("at the time limit"):]
    assert "Thread 0x" in section and "spec_endpoint/server.py" in section, section[:3000]
