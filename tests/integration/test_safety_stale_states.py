"""Issue 31, clause 7: stale hidden states never train and are never measured.

Only ``eagle3 status`` and ``backfill --missing`` looked at a partition's lineage: ``draft_model`` trained on, and
``eagle3 evaluate`` measured a draft on, hidden states of another verifier, other layers or other responses. Now
both check the lineage of the version they read (``versions.stale_hidden_states``, the rule status and backfill
use) and refuse a stale one, naming the partition, what differs and the remedy.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets.core import hashing, lineage
from eagle3_assets.core.lineage import PartitionLineage
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
from eagle3_assets.hidden_states.versions import StaleHiddenStatesError
from support.hidden_states_data import cached_tiny_verifier, fabricate_responses

KEYS = ["00000", "00001"]
LAYERS = [1, 2, 3]
REMEDY = r"[Rr]e-materialize hidden_states .*eagle3 backfill --missing"


@pytest.fixture(scope="module")
def extracted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two partitions extracted with the tiny verifier and recorded as their assets record them (checks passed)."""
    root = tmp_path_factory.mktemp("stale") / "data"
    layout = DataLayout.at(root)
    for key in KEYS:
        fabricate_responses(layout, key, 4, seed=int(key), min_words=10, max_words=20)
        extract_partition(layout, key, cached_tiny_verifier(), HiddenStatesConfig(layer_ids=LAYERS, max_seq_len=96))
        _record_checks(layout, key)
    return root


def _record_checks(layout: DataLayout, key: str) -> None:
    digest = hashing.file_digest(layout.responses_path(key))
    PartitionLineage("synthetic_responses", key, digest, checks={"responses_complete": True}).save(layout)
    lineage.record_checks(layout, "hidden_states", key, {"hidden_states_finite": True})


@pytest.fixture
def data(extracted: Path, tmp_path: Path) -> DataLayout:
    target = tmp_path / "data"
    shutil.copytree(extracted, target, symlinks=True, ignore=shutil.ignore_patterns("_locks"))
    return DataLayout.at(target)


@pytest.fixture
def verifier(tmp_path: Path) -> Path:
    """A private copy of the tiny verifier (same content, so the partitions are current for it until changed)."""
    path = tmp_path / "verifier"
    shutil.copytree(cached_tiny_verifier(), path)
    return path


def _materialize_draft(layout: DataLayout, verifier: Path, layer_ids: str) -> dg.ExecuteInProcessResult:
    from eagle3_assets.defs.draft import draft_model
    from eagle3_assets.defs.resources import DataStoreResource, VerifierResource

    config = {"epochs": 1, "max_steps_per_epoch": 1, "tokens_per_batch": 256, "max_val_batches": 1}
    return dg.materialize(
        [draft_model],
        resources={
            "data_store": DataStoreResource(data_dir=str(layout.root)),
            "verifier": VerifierResource(path=str(verifier), layer_ids=layer_ids, device="cpu"),
        },
        run_config={"ops": {"draft_model": {"config": config}}},
        raise_on_error=False,
    )


def _failure(result: dg.ExecuteInProcessResult) -> str:
    assert not result.success, "draft_model trained on stale hidden states"
    (failure,) = result.get_step_failure_events()
    error = failure.step_failure_data.error
    assert error is not None
    return "\n".join(e.message for e in [error, *([error.cause] if error.cause else [])])


def test_draft_model_refuses_hidden_states_of_another_verifier_or_other_layers(
    data: DataLayout, verifier: Path
) -> None:
    """The Dagster asset: the environment's verifier now has other weights at the same path (a fine-tuned
    verifier copied over the old one), then other layer ids; both times the run fails before training."""
    shutil.copy2(cached_tiny_verifier(seed=1) / "model.safetensors", verifier / "model.safetensors")
    message = _failure(_materialize_draft(data, verifier, "1,2,3"))
    assert "stale hidden_states" in message
    assert "00000 (built with other settings (verifier))" in message
    assert "00001 (built with other settings (verifier))" in message
    assert re.search(REMEDY, message), message
    assert not (data.draft_model_dir / "final").exists()

    shutil.copy2(cached_tiny_verifier() / "model.safetensors", verifier / "model.safetensors")
    message = _failure(_materialize_draft(data, verifier, "0,1,3"))  # as many layers, other ones
    assert "00000 (built with other settings (layer_ids))" in message
    assert not (data.draft_model_dir / "final").exists()


def test_training_refuses_a_partition_built_from_other_responses(data: DataLayout, verifier: Path) -> None:
    """``train_draft`` (what every torchrun rank runs): the held-out partition's responses were generated again
    after its states were extracted."""
    from eagle3_assets.training import TrainConfig, train_draft

    fabricate_responses(data, KEYS[1], 4, seed=77, min_words=10, max_words=20)
    config = TrainConfig(epochs=1, tokens_per_batch=256, max_steps_per_epoch=1, max_val_batches=1, device="cpu")
    with pytest.raises(StaleHiddenStatesError, match=r"00001 \(built from other responses than those on disk\)"):
        train_draft(data, KEYS[:1], KEYS[1], verifier, config)
    assert not (data.draft_model_dir / "final").exists()


def _draft(verifier: Path, folder: Path, layers: list[int]) -> Path:
    import torch

    from eagle3_assets.training import TrainConfig
    from eagle3_assets.training.model import build_draft

    torch.manual_seed(0)
    build_draft(verifier, layers, TrainConfig(ttt_steps=2), None).save_pretrained(str(folder))
    return folder


def test_eagle3_evaluate_refuses_a_stale_held_out_partition(
    data: DataLayout, verifier: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``eagle3 evaluate --offline-only``: a draft of other layers than the partition's, other verifier weights, and
    a held-out partition whose responses were generated again are each refused (exit 1, the reason printed)."""
    from eagle3_assets.cli.evaluate_command import main

    base = ["--verifier", str(verifier), "--data-dir", str(data.root), "--partition", KEYS[1]]
    base += ["--offline-only", "--no-untrained", "--max-samples", "1", "--k", "2", "--out", str(tmp_path / "out")]
    current = _draft(verifier, tmp_path / "draft", LAYERS)
    assert main(["--draft", str(current), *base]) == 0  # current: measured
    capsys.readouterr()

    other_layers = _draft(verifier, tmp_path / "draft-013", [0, 1, 3])
    assert main(["--draft", str(other_layers), *base]) == 1
    error = capsys.readouterr().err
    assert "00001 (built with other settings (layer_ids))" in error and "evaluation" in error

    shutil.copy2(cached_tiny_verifier(seed=1) / "model.safetensors", verifier / "model.safetensors")
    assert main(["--draft", str(current), *base]) == 1
    assert "00001 (built with other settings (verifier))" in capsys.readouterr().err
    shutil.copy2(cached_tiny_verifier() / "model.safetensors", verifier / "model.safetensors")

    fabricate_responses(data, KEYS[1], 4, seed=78, min_words=10, max_words=20)
    assert main(["--draft", str(current), *base]) == 1
    error = capsys.readouterr().err
    assert "00001 (built from other responses than those on disk)" in error
    assert re.search(REMEDY, error), error


def test_hidden_states_extracted_again_from_the_same_responses_keep_what_a_draft_resumes_on(
    data: DataLayout,
) -> None:
    """Re-materializing hidden_states over unchanged responses (a re-run of the whole pipeline) publishes a new
    version; its lineage and index must hash as before, or the draft's checkpoint fingerprint changes and a
    finished draft trains again from scratch. (The mapping's bytes varied one rebuild in two: a single rebuild here
    catches that only by chance; tests/unit/test_vocab_mapping_bytes.py is its guard.)"""
    from eagle3_assets.training.vocab import build_vocab_mapping

    build_vocab_mapping(data, KEYS, 64, target_vocab_size=1024)
    before = lineage.training_inputs_digest(data, KEYS, cached_tiny_verifier())
    versions = {key: data.hidden_states_dir(key).resolve() for key in KEYS}
    for key in KEYS:
        extract_partition(data, key, cached_tiny_verifier(), HiddenStatesConfig(layer_ids=LAYERS, max_seq_len=96))
        _record_checks(data, key)
    build_vocab_mapping(data, KEYS, 64, target_vocab_size=1024)  # vocab_mapping runs again too
    assert {key: data.hidden_states_dir(key).resolve() for key in KEYS} != versions  # published again
    assert lineage.training_inputs_digest(data, KEYS, cached_tiny_verifier()) == before
