"""Each bench mode states the cores its target and drafter used, so its speedups are taken against
AR on the same cores."""

import os

from specpool.bench.modes import mode_hardware


def test_in_process_modes_share_the_bench_threads():
    for mode in ("ar", "sd", "sd:3", "ngram", "head:4", "head-tree:8", "sd-tree", "sd-suffix"):
        hw = mode_hardware(mode, 2)
        assert (hw.target_cores, hw.cores) == (2, 2), mode


def test_ssd_is_compared_with_ar_on_its_target_core_and_on_both_cores():
    hw = mode_hardware("ssd", 2)
    assert (hw.target_cores, hw.cores) == (1, 2)
    assert "cpus" in hw.layout


def test_servers_on_every_core_are_compared_with_ar_on_every_core():
    for mode in ("sd-remote", "ssd-shared"):
        hw = mode_hardware(mode, 2)
        assert (hw.target_cores, hw.cores) == (2, len(os.sched_getaffinity(0))), mode
    assert mode_hardware("ar@1", 2).cores == 1


def test_two_targets_and_their_endpoint_share_every_core():
    for mode in ("sd-remote-x2", "sd-remote-x2:4", "ar-remote-x2"):
        hw = mode_hardware(mode, 2)
        assert (hw.target_cores, hw.cores) == (2, len(os.sched_getaffinity(0))), mode
        assert hw.layout.startswith("two target processes and an endpoint"), mode
