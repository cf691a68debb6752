"""The eagle3 command line around the operations: argument handling and errors that say what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_assets import cli


def test_forwarded_subcommands_receive_leading_options(capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main(["tiny-model", "--help"])  # argparse's REMAINDER alone would reject a leading --help
    assert stopped.value.code == 0
    assert "usage: eagle3 tiny-model" in capsys.readouterr().out
    assert set(cli.FORWARDED) == {"tiny-model", "serve-local", "demo", "evaluate", "plan", "tables"}
    assert cli.FORWARDED["evaluate"][0] == "eagle3_assets.cli.evaluate_command"


def test_operations_need_a_dagster_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    assert cli.main(["status", "--data-dir", str(tmp_path)]) == 2
    assert "DAGSTER_HOME=''" in capsys.readouterr().err
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "nope"))
    assert cli.main(["backfill", "--missing", "--dry-run"]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_backfill_requires_missing(capsys) -> None:
    assert cli.main(["backfill", "--dry-run"]) == 2
    assert "add --missing" in capsys.readouterr().err
