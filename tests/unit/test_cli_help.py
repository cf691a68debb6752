"""The ``eagle3`` command explains itself: every flag has help, ``--version``, ``backfill`` without ``--missing``."""

from __future__ import annotations

import argparse
import importlib

import pytest

from eagle3_assets import __version__, cli


def _parsers() -> list[argparse.ArgumentParser]:
    """eagle3's parser, its subcommands' parsers and the parsers of the forwarded subcommands."""
    found = [cli.build_parser()]
    for module, _help in cli.FORWARDED.values():
        found.append(importlib.import_module(module).build_parser())
    queue, out = list(found), []
    while queue:
        parser = queue.pop()
        out.append(parser)
        for action in parser._actions:  # argparse keeps subparsers only here
            if isinstance(action, argparse._SubParsersAction):
                queue.extend(action.choices.values())
    return out


def test_every_flag_and_argument_has_help() -> None:
    missing = [
        f"{parser.prog}: {'/'.join(action.option_strings) or action.dest}"
        for parser in _parsers()
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
        and (not action.help or action.help == argparse.SUPPRESS)
    ]
    assert not missing, f"flags without help: {missing}"
    assert len(_parsers()) >= 12  # eagle3, its 6 subcommands, demo, tiny-model, evaluate, serve-local (+4)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"eagle3 {__version__}"


def test_backfill_without_missing_explains_itself(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["backfill"]) == 2
    err = capsys.readouterr().err
    assert (
        "add --missing" in err and "eagle3 backfill --missing --dry-run" in err and "dagster asset materialize" in err
    )
