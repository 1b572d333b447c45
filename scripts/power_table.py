"""tests/README.md's power table from a run of the lossless tests: every LOSSLESS and TWIN line that
tests/stats.py's `report` printed, under the test that printed it.

    SPECPOOL_TEST_FULL_POWER=1 .venv/bin/pytest -n 2 --dist loadfile -m slow -rP \\
        -k "lossless or twin or biased or harness" > power.log      # what `make test-full` runs of them
    .venv/bin/python scripts/power_table.py power.log               # the Markdown table

`-rP` prints each passed test's captured output under a header naming it (pytest -s loses it under xdist).
"""

from __future__ import annotations

import re
import sys

HEADER = re.compile(r"^_{3,} (\S.*?) _{3,}$")
CHECK = re.compile(r"^(LOSSLESS|TWIN) \| (?P<name>.*?): TV (?P<tv>[\d.]+) vs threshold (?P<threshold>[\d.]+) "
                   r"\(null mean [\d.]+, sd [\d.]+, n (?P<n>\d+)\)(?P<rest>.*)$")
TWIN_TAIL = re.compile(r"(?P<times>[\d.]+)x threshold; 95%-power limit along this bias at n (?P<at>\d+): "
                       r"(?P<limit>[\d.]+)")


def rows(log: str) -> list[dict]:
    """One dict per LOSSLESS or TWIN line: the test, the check's name and figures, its shares."""
    test, found = "", []
    for line in log.splitlines():
        if header := HEADER.match(line):
            test = header[1]
        elif check := CHECK.match(line):
            parts = [p.strip() for p in check["rest"].split("|") if p.strip()]
            twin = TWIN_TAIL.search(parts[-1]) if check[1] == "TWIN" else None
            shares = parts[:-1] if twin else parts
            found.append({"kind": check[1], "test": test, "name": check["name"], "tv": check["tv"],
                          "threshold": check["threshold"], "n": int(check["n"]), "shares": ", ".join(shares),
                          "times": twin and twin["times"], "limit": twin and f"{twin['limit']} at {int(twin['at']):,}"})
    return found


def table(found: list[dict]) -> str:
    lines = ["| test | check | rows | through the path | TV / threshold | twin: x threshold | limit (95%) |",
             "|---|---|---|---|---|---|---|"]
    for r in found:
        lines.append(f"| {r['test']} | {'twin: ' if r['kind'] == 'TWIN' else ''}{r['name']} | {r['n']:,} | "
                     f"{r['shares']} | {r['tv']} / {r['threshold']} | {r['times'] + 'x' if r['times'] else ''} | "
                     f"{r['limit'] or ''} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        print(table(rows(f.read())))
