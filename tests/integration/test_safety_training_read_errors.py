"""Issue 31, clause 2, for draft_model: a checkpoint that cannot be read is not a corrupt checkpoint.

Training resumes after the newest checkpoint. When that one cannot be read (EACCES, EIO, a stale NFS handle, ENOSPC,
MemoryError) the run fails naming it and keeps every checkpoint byte for byte: resuming from an older one would train
again and then write the same epoch's checkpoint over the unreadable one. Only a checkpoint its bytes prove corrupt
(not a whole zip archive, a record whose CRC-32 does not match: a flipped bit torch.load alone would load) is set
aside, moved to ``checkpoints/_corrupt/`` under a timestamped name, and training resumes from the next older one.

The read faults are injected into a real ``train_draft`` child: EACCES for real (chmod 000; a root child runs without
the capabilities that bypass file modes), the others by making every open of that one file raise the error.
"""

from __future__ import annotations

import importlib
import io
import os
import struct
import sys
import zipfile
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from eagle3_assets.core.storage import DataLayout
from support.safety_training import (
    TRAIN,
    VAL,
    build_inputs,
    config,
    copy_data,
    last_error_line,
    run_child,
    strerror,
    tree,
)

FIRST_EPOCHS, EPOCHS = 2, 3  # trained to 2 epochs; the run under test raises epochs to 3 and resumes after epoch 1
NEWEST = "epoch_0001.pt"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DataLayout]:
    """(verifier, a data dir whose draft was trained for 2 epochs: checkpoints of epochs 0 and 1, final/)"""
    from eagle3_assets.training import train_draft

    verifier, layout = build_inputs(tmp_path_factory.mktemp("safety_training") / "data")
    train_draft(layout, TRAIN, VAL, verifier, config(FIRST_EPOCHS))
    assert sorted(p.name for p in (layout.draft_model_dir / "checkpoints").glob("epoch_*.pt")) == [
        "epoch_0000.pt",
        NEWEST,
    ]
    return verifier, layout


class Copy(NamedTuple):
    """A test's own copy of the trained data dir, to damage."""

    verifier: Path
    layout: DataLayout
    out: Path  # its draft_model folder
    newest: Path  # the newest checkpoint in it


@pytest.fixture
def copied(trained: tuple[Path, DataLayout], tmp_path: Path) -> Copy:
    verifier, source = trained
    layout = copy_data(source, tmp_path / "data")
    return Copy(verifier, layout, layout.draft_model_dir, layout.draft_model_dir / "checkpoints" / NEWEST)


def _train(copied: Copy) -> Any:
    """``train_draft`` on the copy, raised to EPOCHS epochs: it resumes after its newest usable checkpoint."""
    from eagle3_assets.training import train_draft

    return train_draft(copied.layout, TRAIN, VAL, copied.verifier, config(EPOCHS))


# EACCES for real: the newest checkpoint with mode 000, or the checkpoints folder with mode 0300 (writable, not
# listable: a glob sees it empty), read by a child without root's file capabilities; the others raised by every open
# of the newest checkpoint
REAL_MODES = {"EACCES": ("checkpoints/" + NEWEST, 0o000, 0o644), "EACCES-folder": ("checkpoints", 0o300, 0o755)}


@pytest.mark.slow  # a training child process (~10 s: torch and speculators imports)
@pytest.mark.parametrize("fault", ["EACCES", "EACCES-folder", "EIO", "ESTALE", "ENOSPC", "MemoryError"])
def test_an_unreadable_checkpoint_fails_the_run_naming_it_and_keeps_every_checkpoint(
    copied: Copy, tmp_path: Path, fault: str
) -> None:
    verifier, layout, out, newest = copied
    before = tree(out)
    unreadable, mode, usual_mode = REAL_MODES.get(fault, ("checkpoints/" + NEWEST, None, None))
    if mode is not None:
        os.chmod(out / unreadable, mode)
    try:
        injected = "none" if mode is not None else f"read:{fault}"
        child = run_child(
            tmp_path, layout, verifier, EPOCHS, injected, "start", newest, drop_root_file_access=mode is not None
        )
    finally:
        if usual_mode is not None and (out / unreadable).exists():  # a run that went on may have replaced it
            os.chmod(out / unreadable, usual_mode)

    assert child.returncode != 0, f"training went on over an unreadable {unreadable}:\n{child.stdout}"
    message = last_error_line(child)
    assert f"{out / unreadable} (" in message or f"{out / unreadable};" in message, child.stderr  # it, not within it
    expected = {"MemoryError": "out of memory"}.get(fault) or strerror(fault.split("-")[0])
    assert expected in message, child.stderr
    assert "DONE" not in child.stdout, child.stdout
    assert tree(out) == before  # every checkpoint, final/ and the history kept byte for byte
    assert not (out / "checkpoints" / "_corrupt").exists()  # a read error is not corruption

    result = _train(copied)  # the fault cleared: it resumes
    assert result.resumed_from_epoch == 1 and result.epochs_run == 1 and not result.notes


def _flip_a_weight_byte(path: Path) -> bytes:
    """Flip one byte in the middle of the checkpoint's largest tensor record (bit rot inside a whole file)."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as archive:
        record = max(archive.infolist(), key=lambda info: info.file_size)
    # a record's bytes follow its local header: 30 fixed bytes, the name, the extra field
    name_length, extra_length = struct.unpack_from("<HH", data, record.header_offset + 26)
    start = record.header_offset + 30 + name_length + extra_length
    data[start + record.file_size // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return bytes(data)


def _archived(out: Path) -> list[Path]:
    archive_dir = out / "checkpoints" / "_corrupt"
    return sorted(archive_dir.iterdir()) if archive_dir.exists() else []


@pytest.mark.parametrize("damage", ["flipped-byte", "truncated"])
def test_a_corrupt_checkpoint_is_archived_and_training_resumes_from_the_older_one(copied: Copy, damage: str) -> None:
    out, newest = copied.out, copied.newest
    if damage == "flipped-byte":
        broken = _flip_a_weight_byte(newest)
    else:
        broken = newest.read_bytes()[: newest.stat().st_size // 2]
        newest.write_bytes(broken)

    result = _train(copied)

    assert result.resumed_from_epoch == 0  # proven corrupt: never a resume point
    (archived,) = _archived(out)
    assert archived.name.startswith(f"{NEWEST}.") and archived.read_bytes() == broken  # kept as it was
    assert any(str(newest) in note and "corrupt" in note and str(archived) in note for note in result.notes)
    assert newest.read_bytes() != broken  # epoch 1 trained again from epoch 0's checkpoint and saved whole

    # a second corrupt copy of the same checkpoint never replaces the first archive
    (out / "checkpoints" / "epoch_0002.pt").unlink()
    newest.write_bytes(broken)
    again = _train(copied)
    assert again.resumed_from_epoch is None  # no whole checkpoint left (epoch 0's was pruned): from the start
    assert [p.read_bytes() for p in _archived(out)] == [broken, broken]


def test_a_whole_checkpoint_this_environment_cannot_load_fails_the_run_and_is_kept(
    copied: Copy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every checksum matches but unpickling fails (written with a module this environment lacks, as another numpy
    or torch version would): the file is whole, so it is neither skipped nor archived; the run names it."""
    import torch

    out, newest = copied.out, copied.newest
    module_dir = tmp_path / "modules"
    module_dir.mkdir()
    (module_dir / "safety_gone_module.py").write_text("class Stored:\n    pass\n")
    monkeypatch.syspath_prepend(str(module_dir))
    # the module written just above (imported by name: it exists only for this test, deleted below)
    safety_gone_module = importlib.import_module("safety_gone_module")

    state = torch.load(newest, map_location="cpu", weights_only=False)
    state["extra"] = safety_gone_module.Stored()
    torch.save(state, newest)
    monkeypatch.delitem(sys.modules, "safety_gone_module")
    (module_dir / "safety_gone_module.py").unlink()
    before = tree(out)

    with pytest.raises(RuntimeError, match="cannot load the checkpoint") as raised:
        _train(copied)
    assert str(newest) in str(raised.value) and "safety_gone_module" in str(raised.value)
    assert tree(out) == before and not _archived(out)
