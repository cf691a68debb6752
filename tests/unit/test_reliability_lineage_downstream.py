"""Issue 14, downstream follows upstream: hidden states are recomputed when the verifier's content or the layer ids
change, a failed re-extraction keeps the old partition whole, draft training uses only partitions whose checks
passed, and a training checkpoint's fingerprint follows the content of what it trains on."""

from __future__ import annotations

import shutil
from pathlib import Path

import polars as pl
import pytest

from eagle3_assets.core import hashing, lineage
from eagle3_assets.core.lineage import PartitionLineage
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
from eagle3_assets.hidden_states import extract as extract_module
from support.hidden_states_data import cached_tiny_verifier, fabricate_responses

LAYERS = [1, 2, 3]


@pytest.fixture
def verifier(tmp_path: Path) -> Path:
    """A private copy of the tiny verifier, so a test can change its weights in place."""
    path = tmp_path / "verifier"
    shutil.copytree(cached_tiny_verifier(), path)
    return path


def extract(layout: DataLayout, verifier: Path, key: str = "00000", layers: list[int] = LAYERS):
    return extract_partition(layout, key, verifier, HiddenStatesConfig(layer_ids=layers, max_seq_len=128))


def test_hidden_states_are_recomputed_when_the_verifier_weights_change(tmp_path: Path, verifier: Path) -> None:
    layout = DataLayout.at(tmp_path / "data")
    fabricate_responses(layout, "00000", 6)
    first = extract(layout, verifier)
    assert first.stored == 6
    assert extract(layout, verifier).skipped_existing == 6  # same verifier: nothing recomputed
    # other weights of the same shapes, at the same path (a fine-tuned verifier copied over the old one)
    shutil.copy2(cached_tiny_verifier(seed=1) / "model.safetensors", verifier / "model.safetensors")
    again = extract(layout, verifier)
    assert (again.stored, again.skipped_existing) == (6, 0)


def test_hidden_states_are_recomputed_when_the_layer_ids_change(tmp_path: Path, verifier: Path) -> None:
    layout = DataLayout.at(tmp_path / "data")
    fabricate_responses(layout, "00000", 6)
    extract(layout, verifier, layers=[1, 2, 3])
    again = extract(layout, verifier, layers=[0, 1, 3])  # as many layers, other ones: the files fit the shape
    assert (again.stored, again.skipped_existing) == (6, 0)
    assert extract_module.read_meta(layout, "00000")["layer_ids"] == [0, 1, 3]


def test_a_failed_re_extraction_keeps_the_old_partition_whole(
    tmp_path: Path, verifier: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = DataLayout.at(tmp_path / "data")
    fabricate_responses(layout, "00000", 6)
    extract(layout, verifier)
    index = layout.hidden_states_index_path("00000")
    before = index.read_bytes()
    files = {p: p.read_bytes() for p in (layout.hidden_states_dir("00000") / "hidden_states").iterdir()}

    def fail(*_args: object, **_kwargs: object) -> int:
        raise RuntimeError("out of memory in the middle of the partition")

    with monkeypatch.context() as patch:
        patch.setattr(extract_module, "render_rows", fail)  # dies before computing anything
        with pytest.raises(RuntimeError, match="out of memory"):
            extract(layout, verifier, layers=[0, 1, 3])
    assert index.read_bytes() == before
    monkeypatch.setattr(extract_module, "_run_backend", fail)  # dies while computing the new layers
    with pytest.raises(RuntimeError, match="out of memory"):
        extract(layout, verifier, layers=[0, 1, 3])
    assert index.read_bytes() == before  # the partition still counts, with its old content
    assert {p: p.read_bytes() for p in files} == files
    assert extract_module.check_token_ids(layout, "00000").passed
    assert extract_module.check_one_per_ok_response(layout, "00000").passed


def _record_responses_checks(layout: DataLayout, key: str, passed: bool) -> None:
    PartitionLineage(
        "synthetic_responses",
        key,
        hashing.file_digest(layout.responses_path(key)),
        checks={"responses_complete": passed, "responses_error_rate": passed},
    ).save(layout)


def test_draft_training_uses_only_partitions_whose_checks_passed(tmp_path: Path, verifier: Path) -> None:
    from eagle3_assets.defs.draft import hidden_state_partitions
    from eagle3_assets.defs.resources import DataStoreResource

    layout = DataLayout.at(tmp_path / "data")
    for key in ("00000", "00001", "00002", "00003"):
        fabricate_responses(layout, key, 3, seed=int(key))
        extract(layout, verifier, key)
        _record_responses_checks(layout, key, passed=key != "00001")
        lineage.record_checks(layout, "hidden_states", key, {"hidden_states_finite": key != "00002"})
    # 00003's responses were generated again after its hidden states: they no longer describe the file on disk
    fabricate_responses(layout, "00003", 3, seed=99)
    _record_responses_checks(layout, "00003", passed=True)

    assert hidden_state_partitions(DataStoreResource(data_dir=str(layout.root))) == ["00000"]
    usable, excluded = lineage.partitions_passing_checks(layout, ["00000", "00001", "00002", "00003"])
    assert usable == ["00000"]
    assert "synthetic_responses checks" in excluded["00001"]
    assert "hidden_states_finite" in excluded["00002"]
    assert "other responses" in excluded["00003"]


def test_checkpoint_fingerprint_follows_the_content_of_the_training_inputs(tmp_path: Path, verifier: Path) -> None:
    """Same partition keys, same sample counts, same paths: other content is another training run."""
    layout = DataLayout.at(tmp_path / "data")
    for key in ("00000", "00001"):
        fabricate_responses(layout, key, 3, seed=int(key))
        extract(layout, verifier, key)
    layout.vocab_mapping_dir.mkdir(parents=True)
    (layout.vocab_mapping_dir / "d2t.npy").write_bytes(b"vocab v1")
    keys = ["00000", "00001"]

    def fingerprint() -> str:
        return lineage.training_fingerprint("config-and-keys", layout, keys, verifier)

    base = fingerprint()
    assert fingerprint() == base
    (layout.vocab_mapping_dir / "d2t.npy").write_bytes(b"vocab v2")
    after_vocab = fingerprint()
    assert after_vocab != base
    fabricate_responses(layout, "00001", 3, seed=7)  # as many samples, other text
    extract(layout, verifier, "00001")
    after_data = fingerprint()
    assert after_data != after_vocab
    assert pl.read_parquet(layout.hidden_states_index_path("00001")).height == 3
    shutil.copy2(cached_tiny_verifier(seed=1) / "model.safetensors", verifier / "model.safetensors")
    assert fingerprint() != after_data


@pytest.mark.slow
def test_a_checkpoint_trained_on_other_content_is_not_resumed(tmp_path: Path, verifier: Path) -> None:
    """Same keys, same sample counts, same paths, other hidden-states content: training starts over instead of
    resuming the checkpoint of the old data (a fingerprint of paths and counts resumed it)."""
    from eagle3_assets.training import TrainConfig, build_vocab_mapping, train_draft

    layout = DataLayout.at(tmp_path / "data")
    keys = ["00000", "00001"]
    for key in keys:
        fabricate_responses(layout, key, 6, seed=int(key), min_words=10, max_words=20)
        extract(layout, verifier, key)
    build_vocab_mapping(layout, keys[:1], draft_vocab_size=128, target_vocab_size=1024)
    one_epoch = TrainConfig(epochs=1, tokens_per_batch=256, max_steps_per_epoch=1, max_val_batches=1)
    first = train_draft(layout, keys[:1], keys[1], verifier, one_epoch)
    assert first.epochs_run == 1
    two_epochs = TrainConfig(epochs=2, tokens_per_batch=256, max_steps_per_epoch=1, max_val_batches=1)
    control = tmp_path / "control"  # the same inputs: training longer resumes the checkpoint
    shutil.copytree(layout.root, control, ignore=shutil.ignore_patterns("_locks"))
    assert train_draft(DataLayout.at(control), keys[:1], keys[1], verifier, two_epochs).resumed_from_epoch == 0

    fabricate_responses(layout, "00000", 6, seed=42, min_words=10, max_words=20)  # other answers, as many
    extract(layout, verifier, "00000")
    again = train_draft(layout, keys[:1], keys[1], verifier, two_epochs)
    assert again.resumed_from_epoch is None and again.epochs_run == 2
