"""Issue 22, crash-safe publish: a rebuilt hidden_states partition replaces the published one by ONE atomic switch.

A real child process re-extracts a published partition from regenerated responses and is SIGKILLed at each rename
of the publish sequence (and at seeded random moments of it). After every kill the partition folder is whole and
readable (the old build before the switch, the new one after it: index, lineage and files of one build), ``eagle3
status`` and ``backfill --missing`` report it truthfully (the old build is stale: built from other responses), and
a re-run publishes the new build and leaves no leftover. Before this change, the folder was missing between two
renames while its old index and lineage remained (status fine, nothing planned, training crashed), and the
``.KEY.old-PID`` folder leaked. Training pins the version it reads: a rebuild meanwhile never swaps its files.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from eagle3_assets.core import storage
from eagle3_assets.core.lineage import PartitionLineage
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
from eagle3_assets.hidden_states.versions import hidden_states_staging_dir
from support.common import child_env
from support.hidden_states_data import cached_tiny_verifier, fabricate_responses
from support.reliability import sigkill_child_when, wait_for

KEY = "00000"
N = 8
CONFIG = {"layer_ids": [1, 2, 3], "batch_tokens": 600, "max_seq_len": 256}
PUBLISH_RENAMES = 6  # after the dataset's state.json: token_freq, metadata, index, lineage, the version, the switch

CHILD = textwrap.dedent(
    f"""
    import os, sys, time
    root, verifier, mode, arg, marker = sys.argv[1:6]
    partition = os.path.join(os.path.realpath(root), "hidden_states", "{KEY}")
    state = {{"armed": False, "n": 0}}

    def hooked(real):
        def call(src, dst, *args, **kwargs):
            dst_path = os.path.abspath(str(dst))
            if mode == "switch":  # the rename that puts something at the partition's own path
                hit = dst_path == partition
            else:  # the N-th rename after the training dataset's state.json (the publish sequence)
                state["n"] += state["armed"]
                hit = state["armed"] and state["n"] == int(arg)
                state["armed"] |= os.path.basename(dst_path) == "state.json"
            if hit:
                open(marker, "w").close()
                time.sleep(3600)
            return real(src, dst, *args, **kwargs)
        return call

    if mode != "none":
        os.replace, os.rename = hooked(os.replace), hooked(os.rename)
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
    from eagle3_assets.core.storage import DataLayout
    print("START", flush=True)
    extract_partition(DataLayout.at(root), "{KEY}", verifier, HiddenStatesConfig(**{CONFIG!r}))
    print("DONE", flush=True)
    time.sleep(3600)
    """
)


@pytest.fixture(autouse=True)
def _no_configured_verifier(monkeypatch: pytest.MonkeyPatch) -> None:
    """status compares the responses only (the settings comparison has its own tests)."""
    monkeypatch.delenv("EAGLE3_VERIFIER_PATH", raising=False)


def _extract(layout: DataLayout, verifier: Path, key: str = KEY) -> None:
    extract_partition(layout, key, verifier, HiddenStatesConfig(**CONFIG))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A data dir with partition KEY published from responses A; the responses B that regenerate it; and the
    index of a build from A and one from B (what either complete build looks like)."""
    verifier = cached_tiny_verifier()
    base = tmp_path_factory.mktemp("publish") / "data"
    layout = DataLayout.at(base)
    fabricate_responses(layout, KEY, N, seed=0, min_words=10, max_words=30)
    responses_a = layout.responses_path(KEY).read_bytes()
    _extract(layout, verifier)
    old_index = pl.read_parquet(layout.hidden_states_index_path(KEY))
    other = DataLayout.at(base.parent / "other")
    fabricate_responses(other, KEY, N, seed=1, min_words=10, max_words=30)
    _extract(other, verifier)
    return {
        "verifier": verifier,
        "base": base,
        "responses_a": responses_a,
        "responses_b": other.responses_path(KEY).read_bytes(),
        "old": old_index.drop("bytes"),
        "new": pl.read_parquet(other.hidden_states_index_path(KEY)).drop("bytes"),
    }


def _fresh(prepared: dict, tmp_path: Path) -> DataLayout:
    """A copy of the published data dir whose responses were regenerated (B) since the states were built."""
    root = tmp_path / "data"
    shutil.copytree(prepared["base"], root, symlinks=True)
    layout = DataLayout.at(root)
    storage.write_bytes_atomic(prepared["responses_b"], layout.responses_path(KEY))
    return layout


def _which_build(layout: DataLayout, prepared: dict, where: str) -> str:
    """'old' or 'new': the published partition is one whole build (index, files, dataset, lineage agree)."""
    import hashlib

    from datasets import load_from_disk
    from safetensors import safe_open

    folder = layout.hidden_states_dir(KEY)
    assert folder.is_dir(), f"{where}: the partition folder {folder} is missing"
    index = pl.read_parquet(layout.hidden_states_index_path(KEY)).drop("bytes")
    build = "old" if index.equals(prepared["old"]) else "new" if index.equals(prepared["new"]) else None
    assert build is not None, f"{where}: the index is neither build's"
    dataset = load_from_disk(str(folder)).with_format(None)
    assert len(dataset) == index.height, where
    for row, ids in enumerate(dataset["input_ids"]):
        with safe_open(str(folder / "hidden_states" / f"hs_{row}.safetensors"), framework="pt") as handle:
            assert handle.get_tensor("token_ids").tolist() == list(ids), f"{where}: sample file {row}"
    lineage = PartitionLineage.load(layout, "hidden_states", KEY)
    assert lineage is not None, f"{where}: no lineage beside the published folder"
    read = prepared["responses_a" if build == "old" else "responses_b"]
    assert lineage.inputs["responses_data_version"] == hashlib.sha256(read).hexdigest()[:32], where
    return build


def _instance_with_both_materialized(instance: dg.DagsterInstance) -> None:
    instance.add_dynamic_partitions("prompt_partitions", [KEY])
    for asset in ("synthetic_responses", "hidden_states"):
        instance.report_runless_asset_event(dg.AssetMaterialization(asset, partition=KEY))


def _stale_and_planned(instance: dg.DagsterInstance, layout: DataLayout) -> tuple[str, list[str]]:
    from eagle3_assets.operations import backfill, status

    rows = {(r.asset, r.partition_key): r for r in status.partition_table(instance, layout)}
    row = rows[("hidden_states", KEY)]
    assert row.where == "both" and row.disk_rows is not None and not row.error, row
    plan = backfill.plan_missing(instance, layout=layout)
    return row.stale, plan.targets["hidden_states"]


def _leftovers(layout: DataLayout) -> list[str]:
    """Temporary entries, moved-aside folders, unfinished builds and versions other than the current one."""
    folder = layout.asset_dir("hidden_states")
    left = [str(p.relative_to(folder)) for p in folder.rglob(".*")]
    left += [p.name for p in folder.iterdir() if ".old-" in p.name]
    staging = hidden_states_staging_dir(layout, KEY)
    left += [str(staging)] if staging.exists() and any(staging.iterdir()) else []
    versions = folder / "_versions" / KEY
    current = layout.hidden_states_dir(KEY).resolve()
    left += [str(v) for v in versions.iterdir() if v != current] if versions.is_dir() else []
    return left


def _after_a_kill(instance: dg.DagsterInstance, layout: DataLayout, prepared: dict, where: str) -> None:
    build = _which_build(layout, prepared, where)
    stale, planned = _stale_and_planned(instance, layout)
    if build == "old":  # the old build stays published and readable, and says what it was built from
        assert "other responses" in stale and planned == [KEY], (where, stale, planned)
    else:
        assert stale == "" and planned == [], (where, stale, planned)
    _extract(layout, prepared["verifier"])  # the re-run
    assert _which_build(layout, prepared, where + ", re-run") == "new"
    assert _stale_and_planned(instance, layout) == ("", []), where
    assert _leftovers(layout) == [], where


@pytest.mark.slow
def test_sigkill_between_the_two_renames_of_the_folder_swap_keeps_the_old_build(
    prepared: dict, tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    """The kill lands at the rename that puts the new build at the partition's path (the second rename of the old
    swap, the pointer switch now): the old build is still published, whole, and reported stale."""
    layout = _fresh(prepared, tmp_path)
    _instance_with_both_materialized(instance)
    script, marker = tmp_path / "child.py", tmp_path / "blocked"
    script.write_text(CHILD)
    args = [str(layout.root), str(prepared["verifier"]), "switch", "-", str(marker)]
    sigkill_child_when(script, args, marker.exists, 120)
    assert _which_build(layout, prepared, "killed at the switch") == "old"
    _after_a_kill(instance, layout, prepared, "killed at the switch")


@pytest.mark.slow
@pytest.mark.parametrize("rename", range(1, PUBLISH_RENAMES + 1))
def test_sigkill_at_each_rename_of_the_publish_then_status_backfill_and_a_rerun_are_right(
    rename: int, prepared: dict, tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    layout = _fresh(prepared, tmp_path)
    _instance_with_both_materialized(instance)
    script, marker = tmp_path / "child.py", tmp_path / "blocked"
    script.write_text(CHILD)
    args = [str(layout.root), str(prepared["verifier"]), "count", str(rename), str(marker)]
    sigkill_child_when(script, args, marker.exists, 120)
    _after_a_kill(instance, layout, prepared, f"killed before publish rename {rename}")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [3, 11])
def test_sigkill_at_a_random_moment_of_the_publish(
    seed: int, prepared: dict, tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    layout = _fresh(prepared, tmp_path)
    _instance_with_both_materialized(instance)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    staging = hidden_states_staging_dir(layout, KEY)
    delay = random.Random(seed).uniform(0, 0.08)
    args = [str(layout.root), str(prepared["verifier"]), "none", "-", "-"]
    published = layout.hidden_states_dir(KEY).resolve()

    def reached() -> bool:  # the dataset is written (or, on a busy machine, the whole publish already happened)
        return (staging / "state.json").exists() or layout.hidden_states_dir(KEY).resolve() != published

    sigkill_child_when(script, args, reached, 120, delay)
    _after_a_kill(instance, layout, prepared, f"seed {seed}: killed {delay:.3f} s after the dataset was written")


def test_a_folder_left_aside_by_an_interrupted_swap_is_restored_never_deleted(
    prepared: dict, tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    """What a kill between the two renames of the earlier swap left: the partition's path empty, the complete old
    folder at ``.KEY.old-PID`` (a dead pid), its index and lineage beside. status restores it; nothing is lost."""
    root = tmp_path / "data"
    layout = DataLayout.at(root)
    fabricate_responses(layout, KEY, N, seed=0, min_words=10, max_words=30)
    _extract(layout, prepared["verifier"])
    folder = layout.hidden_states_dir(KEY)
    current = folder.resolve()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    aside = folder.with_name(f".{KEY}.old-{int(dead.stdout)}")
    if folder.is_symlink():
        folder.unlink()
    shutil.move(str(current), str(aside))  # as the earlier swap left it: the whole folder moved aside
    _instance_with_both_materialized(instance)
    assert _stale_and_planned(instance, layout) == ("", [])  # restored first, then current: built from these
    assert _which_build(layout, {**prepared, "responses_a": layout.responses_path(KEY).read_bytes()}, "restored")
    assert _leftovers(layout) == []


TRAIN_CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    root, verifier, dirs_file, go = sys.argv[1:5]
    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.training import TrainConfig, loop
    real_loader, real_epoch, seen = loop.make_loader, loop._train_epoch, []

    def make_loader(dirs, *args, **kwargs):
        seen.extend(str(d) for d in dirs)
        return real_loader(dirs, *args, **kwargs)

    def train_epoch(*args, **kwargs):  # the loaders exist: say what they read, wait while the parent rebuilds
        Path(dirs_file).write_text(json.dumps(seen))
        while not os.path.exists(go):
            time.sleep(0.05)
        return real_epoch(*args, **kwargs)

    loop.make_loader, loop._train_epoch = make_loader, train_epoch
    config = TrainConfig(epochs=1, tokens_per_batch=256, max_steps_per_epoch=2, max_val_batches=1)
    loop.train_draft(DataLayout.at(root), ["00000"], "00001", verifier, config)
    print("TRAINED", flush=True)
    """
)


@pytest.mark.slow
def test_a_rebuild_during_training_never_swaps_the_files_training_reads(prepared: dict, tmp_path: Path) -> None:
    import json

    verifier = prepared["verifier"]
    layout = DataLayout.at(tmp_path / "data")
    for key in ("00000", "00001"):
        fabricate_responses(layout, key, N, seed=0, min_words=10, max_words=30)
        _extract(layout, verifier, key)
    old_index = pl.read_parquet(layout.hidden_states_index_path("00000")).drop("bytes")
    script, dirs_file, go = tmp_path / "train.py", tmp_path / "dirs.json", tmp_path / "go"
    script.write_text(TRAIN_CHILD)
    child = subprocess.Popen(
        [sys.executable, str(script), str(layout.root), str(verifier), str(dirs_file), str(go)],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: dirs_file.exists() or child.poll() is not None, 300, "training to build its loaders")
        assert child.poll() is None, child.stdout.read() if child.stdout else ""
        reading = Path(json.loads(dirs_file.read_text())[0])  # the train partition's folder, as training reads it
        before = {p.name: p.read_bytes() for p in (reading / "hidden_states").iterdir()}
        storage.write_bytes_atomic(prepared["responses_b"], layout.responses_path("00000"))
        _extract(layout, verifier)  # rebuilt and published while training reads
        assert not pl.read_parquet(layout.hidden_states_index_path("00000")).drop("bytes").equals(old_index)
        after = {p.name: p.read_bytes() for p in (reading / "hidden_states").iterdir()}
        assert after == before, f"the files under {reading} changed while training read them"
        go.touch()
        output, _ = child.communicate(timeout=300)
        assert child.returncode == 0 and "TRAINED" in output, output[-3000:]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    from eagle3_assets.hidden_states import publish

    publish.recover_idle(layout, ["00000"])  # unpinned now: the next sweep removes the old version
    assert not reading.exists() and _leftovers(layout) == []
