"""The demo's progress line for a stage a signal stopped says so and how to resume, instead of "FAILED ... fix it"
(a SIGTERM during make demo-real's training printed DagsterExecutionInterruptedError as a failure to fix)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from eagle3_assets.operations import demo


def _result(message: str | None) -> Any:
    error = None if message is None else SimpleNamespace(message=message, cause=None)
    event = SimpleNamespace(event_specific_data=SimpleNamespace(error=error))
    return SimpleNamespace(success=message is None, run_id="r1", all_events=[event])


@pytest.mark.parametrize(
    "message,line,exit_text",
    [
        ("dagster._core.errors.DagsterExecutionInterruptedError", "stopped by a signal", "re-run the same command"),
        ("eagle3_assets.core.settings.ConfigError: EAGLE3_X='y': bad", "FAILED: EAGLE3_X='y': bad", "fix it"),
    ],
)
def test_a_stopped_stage_is_not_called_a_failure(
    monkeypatch: pytest.MonkeyPatch, message: str, line: str, exit_text: str
) -> None:
    monkeypatch.setattr(demo, "materialize_asset", lambda *_a, **_k: _result(message))
    lines: list[str] = []
    with pytest.raises(SystemExit, match=exit_text):
        demo._run_partitions(None, None, lines.append, "draft_model", None, [None], None, at_once=1)
    assert lines == [f"draft_model: {line}"]
