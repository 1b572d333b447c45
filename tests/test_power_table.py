"""scripts/power_table.py reads the LOSSLESS and TWIN lines tests/stats.py's `report` prints under pytest's
-rP headers into tests/README.md's table."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests import stats

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "power_table.py"


def test_the_table_has_a_row_per_reported_check_under_its_test(capsys):
    spec = importlib.util.spec_from_file_location("power_table", SCRIPT)
    power_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(power_table)
    import torch

    exact = torch.tensor([0.5, 0.3, 0.2])
    fair = torch.multinomial(exact, 5000, replacement=True, generator=torch.Generator().manual_seed(0))
    log = ""
    for test, outcomes, twin in [("test_fair", fair, False), ("test_twin", torch.zeros(5000, dtype=torch.long), True)]:
        stats.report(stats.check_tv(test, outcomes, exact), twin=twin, **{"cache hit": 0.5})
        log += f"____ {test} ____\n{capsys.readouterr().out}"
    [fair_row, twin_row] = power_table.rows(log)
    assert (fair_row["test"], fair_row["kind"], fair_row["n"], fair_row["shares"]) == ("test_fair", "LOSSLESS", 5000,
                                                                                    "cache hit 0.500")
    assert twin_row["test"] == "test_twin" and twin_row["times"] and twin_row["limit"].endswith("at 5,000")
    assert power_table.table([fair_row, twin_row]).count("\n") == 3
