"""A suite that cannot hang: every test has a time limit, and a test that kills its worker is reported as
a failure naming it while the rest of its file still runs (tests/conftest.py imports these hooks).

Issue 48: llama.cpp died with SIGILL inside a test on an Intel VM (AMX advertised, faulting). pytest-xdist's
`--dist loadfile` put the crashed test back in the queue with the rest of its file, so each replacement
worker ran it again and died too; after the third, the controller and the new workers waited on each
other with no CPU use until CI's wall. tests/test_harness.py reproduces both in a child pytest run.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading

import pytest

# Per-test limits by mark, in seconds: over 3x the slowest such test seen in a loaded CI run (an unmarked
# test takes under 10 s; test_dashboard_prometheus, the slowest slow one, 179 s). A test's own
# @pytest.mark.timeout wins. At its limit pytest-timeout's signal method fails the test where it waits, so
# its own handlers still run (the server tests print their servers' logs) and the worker goes on. A test
# that does not come back from that (signals blocked, a C call that never returns) is ended by the backstop
# a quarter of its limit later: every thread's stack, then the process exits, and the worker's death is
# reported as that test's failure (below) while a new worker takes the rest of its file.
TIMEOUT_S = {"slow": 600, "serial": 600}
# The servers a test started are asked for their stacks this long before its limit (a test's cleanup, run
# by the limit's failure, may stop them first), and the report of a test that failed there carries them.
STACKS_BEFORE_S = 2.0
SERVER_STACKS = pytest.StashKey[list]()
DEFAULT_TIMEOUT_S = 120


def timeout_for(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return max([TIMEOUT_S[mark] for mark in TIMEOUT_S if item.get_closest_marker(mark)], default=DEFAULT_TIMEOUT_S)


def backstop_after(limit_s: float) -> float:
    return 1.25 * limit_s + 5


def add_time_limits(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(timeout_for(item), method="signal"))


def pytest_collection_modifyitems(config, items):
    add_time_limits(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    def end_the_process() -> None:
        capture = item.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:  # write past pytest's capture of the running test, as pytest-timeout does
            capture.suspend_global_capture(in_=True)
        sys.stderr.write(f"\n{item.nodeid} outlived its time limit by a quarter and did not stop: every thread's "
                         f"stack, then this process ends\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
        os._exit(1)

    def ask_servers_for_stacks() -> None:  # just before the limit: the test's own cleanup may stop them
        from specpool.cluster.processes import LIVE

        item.stash[SERVER_STACKS] = [(f"{s.name} (pid {pid}) at the time limit", s.stacks()[-20000:])
                                     for pid, s in list(LIVE.items()) if s.alive()]

    limit = timeout_for(item)
    timers = [threading.Timer(max(0.0, limit - STACKS_BEFORE_S), ask_servers_for_stacks),
              threading.Timer(backstop_after(limit), end_the_process)]
    for timer in timers:
        timer.daemon = True
        timer.start()
    try:
        return (yield)
    finally:
        for timer in timers:
            timer.cancel()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that failed at its time limit carries the stacks of the servers it started (cluster/processes.py
    LIVE, each asked by SIGUSR1 just before): where the wait it was stuck in came from."""
    report = yield
    if report.when == "call" and report.failed and "Timeout" in str(report.longrepr):
        report.sections += item.stash.get(SERVER_STACKS, [])
    return report


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` that never runs a test which killed its worker again (see the module docstring)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class CrashOnceLoadFile(LoadFileScheduling):
        def remove_node(self, node):
            workload = self.assigned_work.get(node, {})
            crashed = next((nodeid for unit in workload.values() for nodeid, done in unit.items() if not done), None)
            if crashed is None:
                return super().remove_node(node)
            # The test that was running is the crash (xdist reports it as failed): mark it done, so only the
            # rest of its file goes back in the queue, and drop a file left with nothing to run.
            workload[self._split_scope(crashed)][crashed] = True
            for scope in [scope for scope, unit in workload.items() if all(unit.values())]:
                del workload[scope]
            super().remove_node(node)
            return crashed

    return CrashOnceLoadFile(config, log)
