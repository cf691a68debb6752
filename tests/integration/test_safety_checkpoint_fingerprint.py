"""Issue 31: an upgrade or a change of settings never costs the draft_model checkpoints of a run.

* The checkpoint fingerprint's vocabulary part is the value every earlier version recorded (``files_digest`` over the
  vocab_mapping folder's files, None without a folder), now computed from the mapping bytes the run loaded: with
  unchanged inputs, a checkpoint written by the earlier formula (copied below from 5fde7e0) resumes. Before, the
  part became ``"vocab_mapping.safetensors:<sha256>"`` and every existing checkpoint was "made for different data or
  settings": days of training started over on upgrade.
* Pruning (keep the newest ``keep_checkpoints``) sorts by epoch name. A folder holding another run's
  ``epoch_0009.pt`` and ``epoch_0010.pt`` made pruning delete the new run's ``epoch_0000.pt`` as soon as it was
  written, so a run killed after its first checkpoint (a real SIGKILL) started from scratch again. Now the other
  run's checkpoints are moved to ``checkpoints/_other_runs/<fingerprint>/`` (never deleted) and the re-run resumes.
"""

from __future__ import annotations

import hashlib
import os
import select
import shutil
import signal
import traceback
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from eagle3_assets.core import hashing, lineage
from eagle3_assets.core.hashing import digest
from eagle3_assets.core.storage import DataLayout
from support.safety_training import TRAIN, VAL, build_inputs, config, copy_data

KEYS = [*TRAIN, VAL]


# ----------------------------------------------------- the fingerprint's inputs part as 5fde7e0 computed it


def files_digest_5fde7e0(paths: Iterable[Path]) -> str:
    return digest(
        [(Path(p).name, hashing.file_digest(Path(p), 64)) for p in sorted(paths, key=str) if os.path.exists(p)]
    )


def training_inputs_digest_5fde7e0(
    layout: DataLayout,
    keys: Iterable[str],
    verifier_path: Path,
    dirs: Mapping[str, Path] | None = None,
    vocab_digest: str | None = None,  # not in 5fde7e0's signature: today's caller passes it, the formula ignores it
) -> str:
    parts: list[Any] = []
    for key in sorted(keys):
        folder = (dirs or {}).get(key) or layout.hidden_states_dir(key)
        recorded = lineage.PartitionLineage.load_file(folder / "lineage.json")
        index = folder / "index.parquet"
        parts.append(
            [key, recorded.data_version if recorded else None, hashing.file_digest(index) if index.exists() else None]
        )
    vocab_dir = layout.vocab_mapping_dir
    vocab = files_digest_5fde7e0(p for p in vocab_dir.glob("*") if p.is_file()) if vocab_dir.is_dir() else None
    verifier = lineage.verifier_fingerprint(verifier_path, cache_dir=layout.asset_dir("hidden_states"))
    return digest([parts, vocab, verifier])


# ------------------------------------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DataLayout]:
    return build_inputs(tmp_path_factory.mktemp("fingerprint_inputs") / "data")


def _train_recording_fingerprints(
    layout: DataLayout, verifier: Path, epochs: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, list[tuple[str, str]]]:
    """train_draft, with each fingerprint the run computed beside 5fde7e0's for the same inputs at that moment."""
    from eagle3_assets.training import train_draft

    real = lineage.training_fingerprint
    seen: list[tuple[str, str]] = []

    def recorded(base: str, layout_: DataLayout, keys: Any, verifier_path: Path, *rest: Any) -> str:
        value = real(base, layout_, keys, verifier_path, *rest)
        dirs = rest[0] if rest else None
        seen.append((value, digest([base, training_inputs_digest_5fde7e0(layout_, keys, verifier_path, dirs)], 16)))
        return value

    with monkeypatch.context() as patch:
        patch.setattr(lineage, "training_fingerprint", recorded)
        result = train_draft(layout, TRAIN, VAL, verifier, config(epochs))
    assert seen, "the run computed no fingerprint"
    return result, seen


def test_an_unchanged_vocabulary_mapping_keeps_the_fingerprint_of_earlier_versions(
    inputs: tuple[Path, DataLayout], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With unchanged inputs a run's fingerprint is 5fde7e0's, and a checkpoint that version wrote is resumed;
    with a mapping, with a vocab_mapping folder without one, and with no folder."""
    from eagle3_assets.training import train_draft
    from eagle3_assets.training.vocab import MAPPING_FILE

    verifier, source = inputs
    layout = copy_data(source, tmp_path / "data")
    vocab_dir = layout.vocab_mapping_dir
    assert (vocab_dir / MAPPING_FILE).is_file() and len([p for p in vocab_dir.iterdir() if p.is_file()]) >= 3

    # the run before the upgrade: its checkpoint carries the fingerprint of the earlier formula
    with monkeypatch.context() as patch:
        patch.setattr(lineage, "training_inputs_digest", training_inputs_digest_5fde7e0)
        assert train_draft(layout, TRAIN, VAL, verifier, config(1)).resumed_from_epoch is None
    after, seen = _train_recording_fingerprints(layout, verifier, 2, monkeypatch)
    assert [now for now, _ in seen] == [earlier for _, earlier in seen], "the fingerprint changed with the upgrade"
    assert after.resumed_from_epoch == 0, "the upgrade made an unchanged run's checkpoint look made for other data"

    (vocab_dir / MAPPING_FILE).unlink()  # a folder without a mapping (the full vocabulary is trained)
    without, seen = _train_recording_fingerprints(copy_data(layout, tmp_path / "no_mapping"), verifier, 1, monkeypatch)
    assert [now for now, _ in seen] == [earlier for _, earlier in seen] and without.draft_vocab_size == 1024
    no_folder = copy_data(layout, tmp_path / "no_folder")
    shutil.rmtree(no_folder.vocab_mapping_dir)
    _, seen = _train_recording_fingerprints(no_folder, verifier, 1, monkeypatch)
    assert [now for now, _ in seen] == [earlier for _, earlier in seen]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _train_until_first_checkpoint_then_sigkill(layout: DataLayout, verifier: Path, epochs: int) -> None:
    """A forked child (speculators already imported: no 20 s import) trains; right after its first checkpoint is
    saved (and pruned) it says so and waits, and is killed there by a real SIGKILL."""
    from eagle3_assets.training import checkpoints, train_draft

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read_end)
            save = checkpoints.save_checkpoint

            def saved_then_wait(*args: Any, **kwargs: Any) -> None:
                save(*args, **kwargs)
                os.write(write_end, b"saved")
                signal.pause()

            checkpoints.save_checkpoint = saved_then_wait
            train_draft(layout, TRAIN, VAL, verifier, config(epochs))
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write_end)
    said = b""
    try:
        ready, _, _ = select.select([read_end], [], [], 120)
        said = os.read(read_end, 16) if ready else b""
        assert said == b"saved", f"the training child never saved a checkpoint (said {said!r})"
        os.kill(pid, signal.SIGKILL)
    finally:
        os.close(read_end)
        if not said:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"child status {status}"


def test_another_runs_checkpoints_never_cost_the_new_runs_checkpoint(
    inputs: tuple[Path, DataLayout], tmp_path: Path
) -> None:
    import torch

    from eagle3_assets.training import TrainConfig, train_draft
    from eagle3_assets.training.checkpoints import CHECKPOINT_DIR

    verifier, source = inputs
    layout = copy_data(source, tmp_path / "data")
    ckpt_dir = layout.draft_model_dir / CHECKPOINT_DIR

    # another run (another learning rate: another fingerprint) left its last two checkpoints, epochs 10 and 11
    other = TrainConfig(**{**config(1).__dict__, "lr": 1e-3})
    train_draft(layout, TRAIN, VAL, verifier, other)
    state = torch.load(ckpt_dir / "epoch_0000.pt", map_location="cpu", weights_only=False)
    (ckpt_dir / "epoch_0000.pt").unlink()
    for epoch in (9, 10):
        torch.save({**state, "epoch": epoch}, ckpt_dir / f"epoch_{epoch:04d}.pt")
    other_runs = {_sha256(ckpt_dir / f"epoch_{epoch:04d}.pt") for epoch in (9, 10)}

    _train_until_first_checkpoint_then_sigkill(layout, verifier, 3)
    assert (ckpt_dir / "epoch_0000.pt").is_file(), (
        f"pruning deleted the new run's checkpoint: {sorted(p.name for p in ckpt_dir.iterdir())}"
    )

    again = train_draft(layout, TRAIN, VAL, verifier, config(3))
    assert again.resumed_from_epoch == 0, "the re-run started from scratch"
    assert sorted(p.name for p in ckpt_dir.glob("epoch_*.pt")) == ["epoch_0001.pt", "epoch_0002.pt"]
    # the other run's checkpoints: never deleted, set aside by their fingerprint, byte for byte
    from eagle3_assets.training.checkpoints import OTHER_RUNS_DIR

    kept = {_sha256(p) for p in (ckpt_dir / OTHER_RUNS_DIR / state["fingerprint"]).glob("epoch_*.pt")}
    assert kept == other_runs

    # one of another fingerprint among this run's older ones (the resume stops before it): pruning sets it aside too
    torch.save(state, ckpt_dir / "epoch_0000.pt")
    stray = _sha256(ckpt_dir / "epoch_0000.pt")
    longer = train_draft(layout, TRAIN, VAL, verifier, config(4))
    assert longer.resumed_from_epoch == 2
    assert sorted(p.name for p in ckpt_dir.glob("epoch_*.pt")) == ["epoch_0002.pt", "epoch_0003.pt"]
    assert _sha256(ckpt_dir / OTHER_RUNS_DIR / state["fingerprint"] / "epoch_0000.pt") == stray
    assert any("epoch_0000.pt" in note and OTHER_RUNS_DIR in note for note in longer.notes), longer.notes
