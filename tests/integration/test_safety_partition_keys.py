"""Issue 31, clause 4: partition keys are data, not paths.

Dagster accepts almost any string as a dynamic partition key (the UI's "Add partition", ``add_dynamic_partitions``).
A key such as ``../../../victim`` turned into ``data/synthetic_responses/_locks/../../../victim.lock``: materializing
it opened (and truncated) a file outside the data directory. Here such keys are registered by hand in a real
DAGSTER_HOME, the real ``dagster asset materialize`` command runs each partitioned asset for them, and the real
``eagle3`` commands see them: every run is refused with a message naming the key, nothing outside the data
directory changes, and ``eagle3 status`` still reports the valid partitions.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets.core.storage import DataLayout
from support.common import child_env, fake_server_pipeline_env, write_jsonl
from support.operations import make_dagster_home

# each resolves, from a folder two or three levels below the data dir, to the file "victim" beside it
PATH_LIKE_KEYS = ["../../../victim", "00000/../../../../victim"]
PRECIOUS = "a file outside the data directory\n"


def _tree(root: Path, skip: set[Path]) -> dict[str, bytes]:
    """Every file under ``root`` outside the ``skip`` folders, with its bytes."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not any(path.is_relative_to(folder) for folder in skip):
            found[str(path.relative_to(root))] = path.read_bytes()
    return found


@pytest.fixture
def hand_added(tmp_path: Path) -> dict:
    home = make_dagster_home(tmp_path)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": f"s{i}", "prompt": f"question {i}"} for i in range(4)])
    (tmp_path / "victim.lock").write_text(PRECIOUS)
    (tmp_path / "victim.parquet").write_text(PRECIOUS)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        instance.add_dynamic_partitions("prompt_partitions", PATH_LIKE_KEYS)
    layout = DataLayout.at(tmp_path / "data")
    env = child_env(**fake_server_pipeline_env(home, layout, prompts, "http://127.0.0.1:9/v1"))
    raw_prompts = [_dagster(), "asset", "materialize", "-m", "eagle3_assets.definitions", "--select", "raw_prompts"]
    result = _run(raw_prompts, env, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return {"home": home, "env": env, "data": tmp_path / "data", "root": tmp_path}


def _dagster() -> str:
    return str(Path(sys.executable).with_name("dagster"))


def _run(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow
def test_a_path_like_partition_added_by_hand_is_refused_by_every_asset_and_nothing_outside_is_written(
    hand_added: dict,
) -> None:
    root, env = hand_added["root"], hand_added["env"]
    before = _tree(root, {hand_added["data"], hand_added["home"]})
    for asset in ("hidden_states", "synthetic_responses"):
        for key in PATH_LIKE_KEYS:
            command = [_dagster(), "asset", "materialize", "-m", "eagle3_assets.definitions", "--select", asset]
            result = _run([*command, "--partition", key], env, root)
            output = result.stdout + result.stderr
            outside = _tree(root, {hand_added["data"], hand_added["home"]})
            assert outside == before, f"{asset} {key!r} changed files outside the data dir: {sorted(outside)}"
            assert result.returncode != 0, f"{asset} {key!r} was materialized:\n{output[-2000:]}"
            assert f"invalid partition key {key!r}" in output, output[-3000:]
    assert (root / "victim.lock").read_text() == PRECIOUS


@pytest.mark.slow
def test_eagle3_commands_name_a_path_like_key_and_write_nothing_for_it(hand_added: dict) -> None:
    root, env = hand_added["root"], hand_added["env"]
    before = _tree(root, {hand_added["data"], hand_added["home"]})
    eagle3 = [sys.executable, "-m", "eagle3_assets.cli"]

    status = _run([*eagle3, "status"], env, root)
    assert status.returncode == 0, status.stderr[-2000:]
    assert repr(PATH_LIKE_KEYS[0]) in status.stderr, status.stderr[-2000:]  # reported, not turned into a path

    backfill = _run([*eagle3, "backfill", "--missing", "--dry-run", "--partitions", PATH_LIKE_KEYS[0]], env, root)
    assert backfill.returncode == 2, backfill.stdout + backfill.stderr
    assert f"invalid partition key {PATH_LIKE_KEYS[0]!r}" in backfill.stderr, backfill.stderr[-2000:]

    evaluate = _run(
        [*eagle3, "evaluate", "--draft", str(root), "--offline-only", "--partition", PATH_LIKE_KEYS[0]], env, root
    )
    assert evaluate.returncode != 0
    assert f"invalid partition key {PATH_LIKE_KEYS[0]!r}" in evaluate.stdout + evaluate.stderr, evaluate.stderr[-2000:]

    assert _tree(root, {hand_added["data"], hand_added["home"]}) == before, "a file outside the data dir changed"
