"""Issue 31, clause 13, for draft_model: a full or read-only disk in the middle of a training run.

The data dir lives on a small tmpfs the test mounts (skipped where mount is not permitted). A real ``train_draft``
child resumes an earlier run (its epoch-0 checkpoint, its published ``final/``) and, at a chosen point, its disk
fills up (a ballast file takes every free byte) or turns read-only (a read-only bind mount over the folder being
written): just before epoch 1's checkpoint is written, or just after it, when the final draft is saved. The run must
fail with an error naming the file it was writing (not a temporary), lose nothing already written, leave no
temporary behind, and, once space is freed or the disk writable again, resume after the newest whole checkpoint.
"""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from eagle3_assets.core.storage import DataLayout
from support.safety_training import TRAIN, VAL, build_inputs, config, copy_data, last_error_line, run_child, tree

EPOCHS = 2  # the earlier run trained epoch 0; this one trains epoch 1, then saves the final draft


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DataLayout]:
    """(verifier, a data dir whose draft was trained for 1 epoch: epoch 0's checkpoint and a published final/)"""
    from eagle3_assets.training import train_draft

    verifier, layout = build_inputs(tmp_path_factory.mktemp("safety_training_disk") / "data")
    train_draft(layout, TRAIN, VAL, verifier, config(1))
    return verifier, layout


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


def _unmount_all(point: Path) -> None:
    """Every mount stacked on ``point`` (a test's bind mounts over a tmpfs), top first."""
    while subprocess.run(["mountpoint", "-q", str(point)], check=False).returncode == 0:
        subprocess.run(["umount", "-l", str(point)], check=True, capture_output=True)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    point = tmp_path / "small_fs"
    point.mkdir()
    try:
        _mount("-t", "tmpfs", "-o", "size=32m,mode=0755", "tmpfs", str(point))
    except (subprocess.CalledProcessError, FileNotFoundError) as error:
        detail = getattr(error, "stderr", "") or error
        pytest.skip(f"cannot mount a size-limited tmpfs here (needs root / CAP_SYS_ADMIN): {detail}")
    try:
        yield point
    finally:
        _unmount_all(point)


# (fault, when, the folder it hits, what the failing write is, the epoch the re-run resumes after)
CASES = [
    pytest.param("fill", "epoch:1", "fs", "checkpoints/epoch_0001.pt", 0, id="full-at-checkpoint"),
    pytest.param("fill", "checkpoint:1", "fs", "final", 1, id="full-at-final-save"),
    pytest.param("read-only", "epoch:1", "checkpoints", "checkpoints/epoch_0001.pt", 0, id="read-only-at-checkpoint"),
    pytest.param("read-only", "checkpoint:1", "draft_model", "final", 1, id="read-only-at-final-save"),
]


@pytest.mark.slow  # a training child process (~10 s: torch and speculators imports)
@pytest.mark.parametrize(("fault", "when", "hits", "failing", "resumes_after"), CASES)
def test_a_full_or_read_only_disk_fails_training_naming_the_file_keeps_everything_and_the_rerun_resumes(
    trained: tuple[Path, DataLayout],
    small_fs: Path,
    tmp_path: Path,
    fault: str,
    when: str,
    hits: str,
    failing: str,
    resumes_after: int,
) -> None:
    from eagle3_assets.training import train_draft

    verifier, source = trained
    layout = copy_data(source, small_fs / "data")
    out = layout.draft_model_dir
    target = {"fs": small_fs, "checkpoints": out / "checkpoints", "draft_model": out}[hits]
    before = tree(out)
    assert {"checkpoints/epoch_0000.pt", "final/model.safetensors", "training_history.json"} <= set(before)

    child = run_child(tmp_path, layout, verifier, EPOCHS, fault, when, target)

    assert f"FAULT {fault}" in child.stdout, child.stdout + child.stderr  # the fault came where it was meant to
    assert child.returncode != 0, f"training finished on a {fault} disk:\n{child.stdout}"
    message = last_error_line(child)
    code = errno.ENOSPC if fault == "fill" else errno.EROFS
    assert f"{out / failing} (" in message and f"[Errno {code}]" in message, child.stderr
    assert ".tmp-" not in message, message  # the file being written, never its temporary
    after = tree(out)
    assert {name: after.get(name) for name in before} == before  # earlier checkpoint, final/, history: kept
    assert not [p for p in out.rglob(".*")], "a temporary was left behind"  # it would hold the space a re-run needs

    # space freed (the ballast removed) or the disk writable again (the read-only mount gone): the re-run resumes
    if fault == "fill":
        for ballast in small_fs.glob("ballast*"):
            ballast.unlink()
    else:
        _unmount_all(target)
    result = train_draft(layout, TRAIN, VAL, verifier, config(EPOCHS))
    assert result.resumed_from_epoch == resumes_after and result.epochs == EPOCHS
    assert (out / "final" / "model.safetensors").exists() and (out / "checkpoints" / "epoch_0001.pt").exists()
