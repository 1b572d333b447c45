"""`specpool` builds its parser without importing torch or any server: a subcommand's modules load
only when that subcommand runs or shows its help."""

from __future__ import annotations

import json
import subprocess
import sys

from specpool.cli import TOOLS

HEAVY = ["torch", *(module for module, _ in TOOLS.values())]


def imported_after(argv: list[str]) -> dict:
    """What main(argv) printed and which HEAVY modules it imported, in a fresh interpreter."""
    script = f"""
import contextlib, io, json, sys
from specpool.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        main({argv!r})
    except SystemExit:
        pass
print(json.dumps({{"out": out.getvalue(), "imported": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_top_level_help_lists_every_command_and_imports_nothing_heavy():
    result = imported_after(["--help"])
    assert result["imported"] == []
    for command in [*TOOLS, "generate", "bench", "build-datastore", "train-draft"]:
        assert command in result["out"]


def test_a_fast_subcommand_parses_without_torch_or_servers():
    assert imported_after(["build-datastore", "--help"])["imported"] == []


def test_a_tools_help_imports_only_that_tool():
    result = imported_after(["serve-router", "--help"])
    assert "--tenant-weights" in result["out"]
    # The router never loads the engine's torch, not even through the shared speculation vocabulary.
    assert result["imported"] == ["specpool.router.server"]
