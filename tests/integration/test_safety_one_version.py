"""Issue 31, clause 8: one version per reader.

A reader of a ``hidden_states`` partition pins the version it reads (``publish.pinned``): a rebuild published by
another process while the reader is between two reads neither switches the reader's files nor receives what the
reader concluded. Each test pauses the reader with a file-based barrier, lets a real subprocess re-extract the
partition from regenerated responses (publishing a new version), then resumes the reader:

* the ``hidden_states`` asset's checks read one version and record their outcomes in THAT version's lineage (the
  pointer's version was never checked: it must not look checked);
* ``eagle3 evaluate --offline-only`` simulates every sample from one version's index, dataset and state files;
* training's checkpoint fingerprint records the vocabulary mapping bytes it loaded, not a mapping a concurrent
  ``vocab_mapping`` run wrote afterwards.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from eagle3_assets.core.lineage import LINEAGE_FILE, PartitionLineage
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition, publish
from support.common import child_env, reaped
from support.hidden_states_data import cached_tiny_verifier, fabricate_responses
from support.reliability import wait_for

KEY = "00000"
LAYERS = [1, 2, 3]
CONFIG = HiddenStatesConfig(layer_ids=LAYERS, max_seq_len=96)

# A concurrent rebuild: waits for the reader's barrier, regenerates the partition's responses (other text) and
# re-extracts it (a new version published), then releases the reader.
REBUILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
    from eagle3_assets.prompts.sample_data import fabricate_responses
    from eagle3_assets.core.storage import DataLayout

    root, key, samples, verifier, paused, published = sys.argv[1:7]
    while not Path(paused).exists():
        time.sleep(0.01)
    layout = DataLayout.at(root)
    fabricate_responses(layout, key, int(samples), seed=99, min_words=10, max_words=20)
    extract_partition(layout, key, verifier, HiddenStatesConfig(layer_ids=[1, 2, 3], max_seq_len=96))
    Path(published).touch()
    """
)


@contextmanager
def concurrent_rebuild(layout: DataLayout, samples: int, barrier: Path) -> Iterator[tuple[Path, Path]]:
    """(paused, published) marker paths: touch ``paused`` where the reader stops, wait for ``published``."""
    script, paused, published = barrier / "rebuild.py", barrier / "paused", barrier / "published"
    script.write_text(REBUILD)
    args = [str(layout.root), KEY, str(samples), str(cached_tiny_verifier()), str(paused), str(published)]
    child = subprocess.Popen(
        [sys.executable, str(script), *args], env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    with reaped(child):
        yield paused, published
        assert child.wait(120) == 0, child.stdout.read().decode()[-3000:] if child.stdout else ""


def pause_here(paused: Path, published: Path) -> None:
    """The reader's barrier: the rebuild runs now, and has published when this returns."""
    paused.touch()
    wait_for(published.exists, 120, "the concurrent rebuild to publish")


def _prepare(root: Path, samples: int) -> DataLayout:
    layout = DataLayout.at(root)
    fabricate_responses(layout, KEY, samples, seed=1, min_words=10, max_words=20)
    return layout


@pytest.mark.slow
def test_asset_checks_record_their_outcomes_in_the_version_they_read(
    tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hidden_states asset (Dagster) is paused inside its first check while another process publishes a
    rebuild: the outcomes go into the lineage of the version checked; the new version stays unchecked (so it is
    not trained on until its own run checks it), and the run's data version is the checked version's."""
    import eagle3_assets.hidden_states as hidden_states_package
    from eagle3_assets.defs.hidden_states import hidden_states
    from eagle3_assets.defs.resources import DataStoreResource, VerifierResource

    layout = _prepare(tmp_path / "data", 4)
    instance.add_dynamic_partitions("prompt_partitions", [KEY])
    real_check = hidden_states_package.check_token_ids
    checked: list[Path] = []

    with concurrent_rebuild(layout, 4, tmp_path) as (paused, published):

        def paused_check(*args: Any) -> Any:
            checked.append(publish.current_version(layout, KEY))  # type: ignore[arg-type]
            pause_here(paused, published)
            return real_check(*args)

        monkeypatch.setattr(hidden_states_package, "check_token_ids", paused_check)
        result = dg.materialize(
            [hidden_states],
            partition_key=KEY,
            instance=instance,
            resources={
                "data_store": DataStoreResource(data_dir=str(layout.root)),
                "verifier": VerifierResource(path=str(cached_tiny_verifier()), layer_ids="1,2,3", device="cpu"),
            },
        )
    assert result.success
    (version_read,) = checked
    current = publish.current_version(layout, KEY)
    assert current is not None and current.name != version_read.name  # the rebuild was published meanwhile
    rebuilt = PartitionLineage.load_file(current / LINEAGE_FILE)
    assert rebuilt is not None and rebuilt.checks == {}, f"a version nobody checked records checks: {rebuilt}"
    read = PartitionLineage.load_file(version_read / LINEAGE_FILE)
    assert read is not None and read.checks_passed and len(read.checks) == 3
    (event,) = result.get_asset_materialization_events()
    assert event.materialization.tags["dagster/data_version"] == read.data_version
    assert {e.asset_check_key.name: e.passed for e in result.get_asset_check_evaluations()} == dict.fromkeys(
        read.checks, True
    )


def test_eagle3_evaluate_reads_every_sample_from_one_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``eagle3 evaluate --offline-only`` is paused after its first chunk of samples (index and dataset read, the
    later chunks' state files not yet) while another process publishes a rebuild from other responses: every
    sample it simulates is the first version's (tokens and states), none a mix."""
    import torch

    from eagle3_assets.cli.evaluate_command import main
    from eagle3_assets.evaluation import offline
    from eagle3_assets.training import TrainConfig
    from eagle3_assets.training.model import build_draft

    samples = offline.FETCH_CHUNK + 4  # two chunks: the second one's files are opened after the pause
    layout = _prepare(tmp_path / "data", samples)
    verifier = cached_tiny_verifier()
    extract_partition(layout, KEY, verifier, CONFIG)
    before = {sid: (ids, states) for sid, ids, _mask, states in offline.iter_samples(layout, KEY)}
    version_read = publish.current_version(layout, KEY)
    torch.manual_seed(0)
    build_draft(verifier, LAYERS, TrainConfig(ttt_steps=2), None).save_pretrained(str(tmp_path / "draft"))

    real_chunk = offline._chunk_samples
    seen: dict[str, tuple[Any, Any]] = {}
    chunks = [0]
    with concurrent_rebuild(layout, samples, tmp_path) as (paused, published):

        def chunk_after_a_pause(*args: Any, **kwargs: Any) -> Iterator[Any]:
            chunks[0] += 1
            if chunks[0] == 2:
                pause_here(paused, published)
            for sid, ids, mask, states in real_chunk(*args, **kwargs):
                seen[sid] = (ids, states)
                yield sid, ids, mask, states

        monkeypatch.setattr(offline, "_chunk_samples", chunk_after_a_pause)
        argv = ["--draft", str(tmp_path / "draft"), "--verifier", str(verifier), "--data-dir", str(layout.root)]
        # named: built here without the assets, the partition has no recorded checks for the hold-out rule to see
        argv += ["--partition", KEY, "--offline-only", "--no-untrained", "--max-samples", "0", "--k", "2"]
        argv += ["--out", str(tmp_path / "o")]
        code = main(argv)
    assert code == 0, capsys.readouterr().err[-2000:]
    assert published.exists() and set(seen) == set(before)
    for sid, (ids, states) in seen.items():
        old_ids, old_states = before[sid]
        assert torch.equal(ids, old_ids), f"{sid}: tokens of another build"
        assert states.shape == old_states.shape and torch.equal(states, old_states), f"{sid}: states of another build"
    assert publish.current_version(layout, KEY) != version_read  # the rebuild is the partition's version now


@pytest.mark.slow
def test_the_training_fingerprint_is_of_the_vocabulary_bytes_it_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``vocab_mapping`` run (a real subprocess) replaces the mapping right after training loaded it. The
    checkpoint must say it was trained with the mapping it loaded: a re-run with the NEW mapping on disk starts
    over (resuming would load a checkpoint of another draft vocabulary), and with the loaded mapping put back it
    resumes."""
    import shutil

    from eagle3_assets.training import TrainConfig, build_vocab_mapping, train_draft
    from eagle3_assets.training import loop as loop_module
    from eagle3_assets.training.vocab import MAPPING_FILE

    layout = DataLayout.at(tmp_path / "data")
    verifier = cached_tiny_verifier()
    keys = ["00000", "00001"]
    for key in keys:
        fabricate_responses(layout, key, 4, seed=int(key), min_words=10, max_words=20)
        extract_partition(layout, key, verifier, CONFIG)
    build_vocab_mapping(layout, keys[:1], draft_vocab_size=64, target_vocab_size=1024)
    loaded_bytes = (layout.vocab_mapping_dir / MAPPING_FILE).read_bytes()
    # the folder as loaded: the fingerprint counts its other files too (as every earlier version did)
    loaded_folder = {p.name: p.read_bytes() for p in layout.vocab_mapping_dir.iterdir() if p.is_file()}
    rebuild = (
        "import sys; from eagle3_assets.core.storage import DataLayout; from eagle3_assets.training import "
        "build_vocab_mapping; build_vocab_mapping(DataLayout.at(sys.argv[1]), ['00000'], 128, target_vocab_size=1024)"
    )
    real_build = loop_module.build_draft

    def build_then_a_concurrent_vocab_run(*args: Any, **kwargs: Any) -> Any:  # the mapping is loaded by now
        subprocess.run([sys.executable, "-c", rebuild, str(layout.root)], env=child_env(), check=True)
        return real_build(*args, **kwargs)

    one = TrainConfig(epochs=1, tokens_per_batch=256, max_steps_per_epoch=1, max_val_batches=1, device="cpu")
    with monkeypatch.context() as patch:
        patch.setattr(loop_module, "build_draft", build_then_a_concurrent_vocab_run)
        first = train_draft(layout, keys[:1], keys[1], verifier, one)
    assert first.draft_vocab_size == 64 and (layout.vocab_mapping_dir / MAPPING_FILE).read_bytes() != loaded_bytes

    two = TrainConfig(epochs=2, tokens_per_batch=256, max_steps_per_epoch=1, max_val_batches=1, device="cpu")
    control = tmp_path / "control"  # the 64-token mapping folder the first run trained with, back in place
    shutil.copytree(layout.root, control, symlinks=True, ignore=shutil.ignore_patterns("_locks"))
    for name, data in loaded_folder.items():
        (DataLayout.at(control).vocab_mapping_dir / name).write_bytes(data)
    assert train_draft(DataLayout.at(control), keys[:1], keys[1], verifier, two).resumed_from_epoch == 0

    again = train_draft(layout, keys[:1], keys[1], verifier, two)  # the 128-token mapping: another draft
    assert again.resumed_from_epoch is None and again.draft_vocab_size == 128


@pytest.mark.slow
def test_draft_model_trains_only_on_the_checked_versions_it_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """draft_model chose its partitions by their recorded checks; another process publishes a rebuild of one of
    them before training pins it. The rebuild is unchecked (its run records its checks after publishing), so the
    run refuses it, naming the partition, instead of training on it."""
    from eagle3_assets.core import hashing, lineage
    from eagle3_assets.defs import draft as draft_module
    from eagle3_assets.defs.resources import DataStoreResource, VerifierResource

    layout = DataLayout.at(tmp_path / "data")
    verifier = cached_tiny_verifier()
    for key in (KEY, "00001"):
        fabricate_responses(layout, key, 4, seed=int(key) + 1, min_words=10, max_words=20)
        extract_partition(layout, key, verifier, CONFIG)
        digest = hashing.file_digest(layout.responses_path(key))
        PartitionLineage("synthetic_responses", key, digest, checks={"responses_complete": True}).save(layout)
        lineage.record_checks(layout, "hidden_states", key, {"hidden_states_finite": True})
    real_split = draft_module.split_partitions

    with concurrent_rebuild(layout, 4, tmp_path) as (paused, published):

        def split_then_pause(*args: Any) -> Any:
            chosen = real_split(*args)
            pause_here(paused, published)
            return chosen

        monkeypatch.setattr(draft_module, "split_partitions", split_then_pause)
        config = {"epochs": 1, "max_steps_per_epoch": 1, "tokens_per_batch": 256, "max_val_batches": 1}
        result = dg.materialize(
            [draft_module.draft_model],
            resources={
                "data_store": DataStoreResource(data_dir=str(layout.root)),
                "verifier": VerifierResource(path=str(verifier), layer_ids="1,2,3", device="cpu"),
            },
            run_config={"ops": {"draft_model": {"config": config}}},
            raise_on_error=False,
        )
    assert not result.success, "draft_model trained on a version whose checks never ran"
    (failure,) = result.get_step_failure_events()
    error = failure.step_failure_data.error
    assert error is not None
    message = "\n".join(e.message for e in [error, *([error.cause] if error.cause else [])])
    assert f"{KEY} (hidden_states checks not recorded)" in message, message
    assert not (layout.draft_model_dir / "final").exists()
