"""Inputs, settings and a child training process for the draft_model data-safety tests (issue 31, clauses 2 and 13).

The child runs ``train_draft`` the way a worker does and injects one fault into itself at a chosen point:

- ``read:<ERRNO or MemoryError>`` from the start: every open of ``target`` (the builtins' and ``io``'s, which
  torch.load and ``Path.read_bytes`` use) raises that error, as a failing disk or a stale NFS handle would;
- ``fill`` / ``read-only`` at ``epoch:<n>`` (just before epoch n's checkpoint is written) or ``checkpoint:<n>`` (just
  after it, so the next write is the final draft's): the filesystem holding ``target`` is filled with a ballast file
  (``target/ballast``), or a read-only bind mount is put over the folder ``target``.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from eagle3_assets.core.storage import DataLayout
from support.common import child_env
from support.root_file_access import file_modes_enforced

TRAIN, VAL = ["00000"], "00001"
LAYERS = [1, 2, 3]
# 3 steps of 256 packed tokens an epoch, one validation batch: an epoch is well under a second on a CPU
CONFIG: dict[str, Any] = dict(
    tokens_per_batch=256, lr=3e-3, max_steps_per_epoch=3, max_val_batches=1, num_threads=1, seed=7
)

CHILD = textwrap.dedent(
    """
    import builtins, errno, io, os, subprocess, sys

    root, verifier, config, fault, when, target = sys.argv[1:7]

    def fill(folder):
        # a ballast file until the filesystem is full
        fd = os.open(os.path.join(folder, "ballast"), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            while True:
                os.write(fd, b"\\0" * 65536)
        except OSError as error:
            assert error.errno == errno.ENOSPC, error
        finally:
            os.close(fd)
        # the last partial block too: not one byte is left
        fd = os.open(os.path.join(folder, "ballast-tail"), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            while True:
                os.write(fd, b"\\0")
        except OSError as error:
            assert error.errno == errno.ENOSPC, error
        finally:
            os.close(fd)

    def read_only(folder):
        subprocess.run(["mount", "--bind", folder, folder], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", folder], check=True)

    def inject():
        print(f"FAULT {fault} at {when}: {target}", flush=True)
        (fill if fault == "fill" else read_only)(target)

    if fault.startswith("read:"):
        error_name = fault.split(":", 1)[1]
        def failing(opener):
            def open_(file, *args, **kwargs):
                if isinstance(file, (str, os.PathLike)) and os.fspath(file) == target:
                    if error_name == "MemoryError":
                        raise MemoryError()
                    code = getattr(errno, error_name)
                    raise OSError(code, os.strerror(code), target)
                return opener(file, *args, **kwargs)
            return open_
        builtins.open, io.open = failing(builtins.open), failing(io.open)

    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.training import TrainConfig, train_draft
    from eagle3_assets.training import checkpoints

    on_epoch = None
    kind, _, at = when.partition(":")
    if kind == "epoch":  # called before that epoch's checkpoint is written
        def on_epoch(metrics):
            if metrics["epoch"] == int(at) + 1:
                inject()
    elif kind == "checkpoint":
        save_checkpoint = checkpoints.save_checkpoint
        def saved_then_fault(ckpt_dir, epoch, *args, **kwargs):
            save_checkpoint(ckpt_dir, epoch, *args, **kwargs)
            if epoch == int(at):
                inject()
        checkpoints.save_checkpoint = saved_then_fault

    result = train_draft(DataLayout.at(root), ["00000"], "00001", verifier, TrainConfig(**eval(config)),
                         log=lambda m: print(m, flush=True), on_epoch=on_epoch)
    print(f"DONE resumed_from_epoch={result.resumed_from_epoch}", flush=True)
    """
)


def config(epochs: int) -> Any:
    from eagle3_assets.training import TrainConfig

    return TrainConfig(epochs=epochs, **CONFIG)


def build_inputs(root: Path) -> tuple[Path, DataLayout]:
    """(the tiny verifier, a data dir with the hidden states of a 24-sample training and an 8-sample validation
    partition and their vocabulary mapping)."""
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
    from eagle3_assets.training import build_vocab_mapping
    from support.hidden_states_data import cached_tiny_verifier, fabricate_responses

    verifier = cached_tiny_verifier()
    layout = DataLayout.at(root)
    for key, n in ((TRAIN[0], 24), (VAL, 8)):
        fabricate_responses(layout, key, n, min_words=20, max_words=40)
        extract_partition(layout, key, verifier, HiddenStatesConfig(layer_ids=LAYERS))
    build_vocab_mapping(layout, TRAIN, draft_vocab_size=256, target_vocab_size=1024)
    return verifier, layout


def copy_data(src: DataLayout, dst: Path) -> DataLayout:
    """Every asset of ``src`` (the training inputs, and a draft_model folder when there is one), without locks."""
    for asset in ("hidden_states", "vocab_mapping", "draft_model"):
        if src.asset_dir(asset).exists():
            shutil.copytree(src.asset_dir(asset), dst / asset, ignore=shutil.ignore_patterns("_locks"))
    return DataLayout.at(dst)


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` with its content hash (lock files excluded: their holder note changes)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.suffix != ".lock"
    }


def run_child(
    tmp: Path,
    layout: DataLayout,
    verifier: Path,
    epochs: int,
    fault: str,
    when: str,
    target: Path,
    drop_root_file_access: bool = False,
) -> subprocess.CompletedProcess:
    script = tmp / "train_child.py"
    script.write_text(CHILD)
    args = [str(layout.root), str(verifier), repr({**CONFIG, "epochs": epochs}), fault, when, str(target)]
    return subprocess.run(
        [sys.executable, str(script), *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp,
        preexec_fn=file_modes_enforced(drop_root_file_access),
    )


def last_error_line(child: subprocess.CompletedProcess) -> str:
    lines = child.stderr.strip().splitlines()
    return lines[-1] if lines else ""


def strerror(name: str) -> str:
    return os.strerror(getattr(errno, name))
