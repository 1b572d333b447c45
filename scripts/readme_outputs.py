"""Regenerate the command outputs README.md shows, so that they cannot go stale.

A generated block is whatever lies between two HTML comments (Markdown does not render them):

    <!-- generated: specpool plan --demand cluster/examples/demand.yaml --stats ... -->
    ```
    $ specpool plan --demand cluster/examples/demand.yaml --stats ...
    (what it prints)
    ```
    <!-- end generated -->

To add one, write the two comments and run this. Only a command whose output follows from files
committed here may have one: no timings, nothing from the machine's caches (~/.cache/specpool) or
the network. Each runs in this process from the repository root, with argparse's wrapping width
fixed, so the output is the same on every machine.

    python scripts/readme_outputs.py          # rewrite the blocks (`make readme`)
    python scripts/readme_outputs.py --check  # change nothing; print a diff and exit 1 when one is stale
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
START = "<!-- generated: "
END = "<!-- end generated -->"
# argparse wraps --help at the terminal's width (COLUMNS first): fixed, help reads the same everywhere.
COLUMNS = "100"

# The body may not run into the next block's start: a missing end marker is an error, not a merge.
BLOCK = re.compile(re.escape(START) + r"(?P<command>.+?) -->\n(?P<body>(?:(?!" + re.escape(START) + r").)*?)"
                   + re.escape(END), re.DOTALL)


def run(command: str) -> str:
    """What a `specpool ...` command line prints on stdout."""
    argv = shlex.split(command)
    if argv[:1] != ["specpool"]:
        raise ValueError(f"{command!r}: only specpool commands are generated")
    from specpool import cli

    out, err = io.StringIO(), io.StringIO()
    with (mock.patch.dict(os.environ, {"COLUMNS": COLUMNS}), contextlib.chdir(REPO),
          contextlib.redirect_stdout(out), contextlib.redirect_stderr(err)):
        try:
            code = cli.main(argv[1:])
        except SystemExit as exc:  # --help and --version exit
            code = exc.code
    if code:
        raise RuntimeError(f"{command!r} exited with {code}:\n{err.getvalue()}")
    return out.getvalue()


def render(text: str, run: Callable[[str], str] = run) -> str:
    """text with every generated block rewritten from its command's output."""
    if text.count(START) != len(BLOCK.findall(text)):
        raise ValueError(f"every '{START}COMMAND -->' needs its '{END}' before the next block starts")

    def block(match: re.Match) -> str:
        command = match["command"].strip()
        # Trailing spaces would not survive editors that strip them, and the check would then fail.
        output = "\n".join(line.rstrip() for line in run(command).rstrip().splitlines())
        return f"{START}{command} -->\n```\n$ {command}\n{output}\n```\n{END}"

    return BLOCK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--check", action="store_true",
                   help="change nothing: print a diff and exit 1 when a block is stale")
    p.add_argument("--readme", type=Path, default=README, help="the Markdown file whose blocks to generate")
    args = p.parse_args(argv)
    old = args.readme.read_text()
    new = render(old)
    if new == old:
        print(f"{args.readme.name}: generated blocks are current")
        return 0
    if args.check:
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                                   str(args.readme), f"{args.readme} (regenerated)"))
        print(f"{args.readme.name}: generated blocks are stale; `make readme` rewrites them", file=sys.stderr)
        return 1
    args.readme.write_text(new)
    print(f"{args.readme.name}: generated blocks rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
