"""Issue 31, clause 1: any folder under the data dir may be a symlink to another disk; nothing published is deleted.

An operator moves the biggest folder to a bigger disk and leaves a symlink behind::

    mv data/hidden_states /mnt/big/ && ln -s /mnt/big/hidden_states data/hidden_states

Before the fix, ``publish.sweep`` compared the pointer's resolved target with unresolved version paths, so the
current version never matched and ``eagle3 status`` (which finishes interrupted publishes) deleted every
partition's published hidden states. Here the real ``eagle3`` commands run as subprocesses over a data dir whose
``hidden_states``, ``hidden_states/_versions``, ``_versions/{key}`` or the data dir itself is a symlink, and a
rebuild is published through the same link: the published build is whole after every command, the rebuild's is
whole after the rebuild, and only the version it replaced is swept.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest

from eagle3_assets.core import storage
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
from support.common import child_env
from support.hidden_states_data import cached_tiny_verifier, fabricate_responses
from support.operations import make_dagster_home

KEY = "00000"
N = 6
CONFIG = {"layer_ids": [1, 2, 3], "batch_tokens": 600, "max_seq_len": 256}
# what is moved to the other disk, relative to the data dir ("." the data dir itself)
MOVED = ["hidden_states", "hidden_states/_versions", f"hidden_states/_versions/{KEY}", "."]


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A data dir with partition KEY's hidden states published, and the responses of a regeneration."""
    verifier = cached_tiny_verifier()
    base = tmp_path_factory.mktemp("moved") / "data"
    layout = DataLayout.at(base)
    fabricate_responses(layout, KEY, N, seed=0, min_words=8, max_words=20)
    extract_partition(layout, KEY, verifier, HiddenStatesConfig(**CONFIG))  # type: ignore[arg-type]
    other = DataLayout.at(base.parent / "other")
    fabricate_responses(other, KEY, N, seed=1, min_words=8, max_words=20)
    return {
        "verifier": verifier,
        "base": base,
        "index": pl.read_parquet(layout.hidden_states_index_path(KEY)),
        "responses_b": other.responses_path(KEY).read_bytes(),
    }


def _move_behind_a_symlink(base: Path, tmp_path: Path, moved: str, big: Path | None = None) -> Path:
    """Copy the published data dir, move ``moved`` to another folder ``big`` ("the big disk") and link it back;
    returns the data dir path the commands are given (the link itself when the data dir was moved)."""
    data = tmp_path / "data"
    shutil.copytree(base, data, symlinks=True)
    if big is None:
        big = tmp_path / "big"
        big.mkdir()
    source = data / moved if moved != "." else data
    target = big / source.name
    shutil.move(str(source), str(target))
    source.symlink_to(target, target_is_directory=True)
    return data


def _published_build_is_whole(data: Path, where: str) -> pl.DataFrame:
    """The partition's published index, after checking every sample file it names exists and matches its tokens."""
    from safetensors import safe_open

    layout = DataLayout.at(data)
    folder = layout.hidden_states_dir(KEY)
    assert folder.is_dir(), f"{where}: the published version of {KEY} is gone ({folder} dangles)"
    index = pl.read_parquet(layout.hidden_states_index_path(KEY))
    assert index.height > 0, where
    for row in index["row"].to_list():
        path = folder / "hidden_states" / f"hs_{row}.safetensors"
        assert path.is_file(), f"{where}: {path} is gone"
        with safe_open(str(path), framework="pt") as handle:
            assert handle.get_tensor("token_ids").numel() > 0, where
    assert (folder / "lineage.json").is_file(), where
    return index


def _eagle3(args: list[str], data: Path, home: Path) -> subprocess.CompletedProcess[str]:
    env = child_env(DAGSTER_HOME=str(home), EAGLE3_DATA_DIR=str(data))
    env.pop("EAGLE3_VERIFIER_PATH", None)
    command = [sys.executable, "-m", "eagle3_assets.cli", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture
def other_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs mounted for the test: a real second filesystem (skipped where mounting is not permitted)."""
    point = tmp_path / "other_disk"
    point.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=256m,mode=0755", "tmpfs", str(point)]
    try:
        subprocess.run(mount, check=True, capture_output=True, text=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as error:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {getattr(error, 'stderr', '') or error}")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False, capture_output=True)


@pytest.mark.slow
@pytest.mark.parametrize("moved", MOVED)
def test_status_backfill_sync_and_a_rebuild_keep_the_published_version_of_a_moved_folder(
    moved: str, published: dict, tmp_path: Path
) -> None:
    _commands_and_a_rebuild_keep_the_published_version(
        _move_behind_a_symlink(published["base"], tmp_path, moved), moved, published, tmp_path
    )


@pytest.mark.slow
def test_versions_on_another_filesystem_publish_and_keep_the_published_version(
    published: dict, tmp_path: Path, other_filesystem: Path
) -> None:
    """``_versions`` on another disk: the build in progress is made beside the versions, so publishing it is a rename
    within one filesystem (it was made under ``hidden_states/_staging``, and the publish failed with EXDEV)."""
    moved = "hidden_states/_versions"
    data = _move_behind_a_symlink(published["base"], tmp_path, moved, big=other_filesystem)
    _commands_and_a_rebuild_keep_the_published_version(data, moved, published, tmp_path)


def _commands_and_a_rebuild_keep_the_published_version(data: Path, moved: str, published: dict, tmp_path: Path) -> None:
    home = make_dagster_home(tmp_path)
    assert _published_build_is_whole(data, "after the move").equals(published["index"])
    for command in (["status"], ["backfill", "--missing", "--dry-run"], ["sync"], ["status"]):
        result = _eagle3(command, data, home)
        where = (
            f"after `eagle3 {' '.join(command)}` with {moved} moved (exit {result.returncode}: {result.stderr[-600:]})"
        )
        assert _published_build_is_whole(data, where).equals(published["index"]), where

    # a rebuild from regenerated responses, published through the link: the new build is current and whole, the
    # version it replaced is swept, the build in progress is gone
    layout = DataLayout.at(data)
    storage.write_bytes_atomic(published["responses_b"], layout.responses_path(KEY))
    extract_partition(layout, KEY, published["verifier"], HiddenStatesConfig(**CONFIG))  # type: ignore[arg-type]
    rebuilt = _published_build_is_whole(data, "after the rebuild")
    assert not rebuilt.equals(published["index"]), "the rebuild did not publish"
    versions = sorted(p.name for p in (layout.asset_dir("hidden_states") / "_versions" / KEY).iterdir())
    assert versions == [Path(layout.hidden_states_dir(KEY).readlink()).name], versions
    result = _eagle3(["status"], data, home)
    assert _published_build_is_whole(data, f"status after the rebuild: {result.stderr[-600:]}").equals(rebuilt)
