"""Every flag of every command says what it does and shows its default in --help.

Walks the real parsers: the full `specpool` parser (every TOOLS module imported, torch included) and
the standalone benchmarks', so a flag added without help fails here.
"""

import argparse
import contextlib
import io

import pytest

from specpool import cli
from specpool.bench import ar_speed, grey_failure, soak


def _parsers(parser: argparse.ArgumentParser, name: str):
    """(name, parser) for parser and every subcommand below it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def _all_parsers():
    yield from _parsers(cli.build_parser(tools=cli.TOOLS), "specpool")
    for module in (soak, grey_failure, ar_speed):
        yield from _parsers(module.build_parser(), module.__name__)


def test_every_flag_has_help_and_shows_defaults():
    missing, plain = [], []
    parsers = list(_all_parsers())
    assert len(parsers) > len(cli.TOOLS) + 3  # the subcommands were found
    for name, parser in parsers:
        if not issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter):
            plain.append(name)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                # The subcommands themselves: each needs its one line in the parent's list.
                missing += [f"{name} {a.dest}" for a in action._choices_actions if not (a.help or "").strip()]
            elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)) \
                    and not (action.help or "").strip():
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"flags without help: {missing}"
    assert not plain, f"parsers that do not show defaults: {plain}"


def test_help_shows_a_default(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # no line breaks inside "(default: ...)"
    text = dict(_parsers(cli.build_parser(tools=()), "specpool"))["specpool generate"].format_help()
    assert "(default: 128)" in text  # --max-tokens
    assert "(default: None)" not in text  # unset flags say what unset means instead


def test_version():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert out.getvalue().startswith("specpool ")
    assert out.getvalue().split()[1] == cli.version()
