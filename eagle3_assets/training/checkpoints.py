"""Checkpoints and the final draft on disk: every write atomic, every resume checked against the run's fingerprint.

``checkpoints/epoch_NNNN.pt`` (one per epoch) holds the trainable weights, the optimizer and scheduler state, the RNG
state and the metric history. A re-run resumes after the newest whole checkpoint whose fingerprint (data, verifier,
model shape, hyper-parameters except ``epochs`` and the process count) matches, so raising ``epochs`` continues a
finished run and a run may resume with another number of processes (the state is replicated, not sharded).
``final/`` is the draft in speculators' format, renamed into place whole.

A read error is not corruption (issue 31): a checkpoint that cannot be read (EIO, EACCES, a stale NFS handle,
MemoryError) fails the run naming it and keeps every checkpoint, instead of resuming from an older one and writing over
it. Only a checkpoint its bytes prove corrupt (not a whole zip archive, a record whose CRC-32 does not match) is set
aside, moved to ``checkpoints/_corrupt/`` under a timestamped name, and training resumes from the next older one. A
write that fails (a full or read-only disk) names the file being written, never its temporary, and keeps what is
already there: the earlier checkpoints, and the published ``final/``.

A checkpoint of another fingerprint (a run with other data or settings) is never deleted and never resumed: it is
moved to ``checkpoints/_other_runs/<its fingerprint>/`` (by the resume, and by pruning when it finds one) and said so.
Moved, not kept in place, because its epoch names share the folder's order with the current run's: an old run's
``epoch_0010.pt`` sorts after the new run's ``epoch_0001.pt``, so pruning by name would delete the new run's
checkpoint and keep the old one, and the new run's own ``epoch_0010.pt`` would later be written over it. Moved, not
deleted, because it may be days of training that a change of settings back would want again: moving the files back
into ``checkpoints/`` resumes it. Pruning deletes only checkpoints proven to be of the current run's fingerprint.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import io
import itertools
import json
import logging
import os
import random
import re
import shutil
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from eagle3_assets.core.storage import (
    DiskSpaceError,
    archive_corrupt,
    atomic_path,
    ensure_free_space,
    fsync_dir,
    read_error_keeping,
    replace_dir_atomic,
    write_json_atomic,
)
from eagle3_assets.training.train_config import TrainConfig

CHECKPOINT_DIR = "checkpoints"
FINAL_DIR = "final"
HISTORY_FILE = "training_history.json"
CORRUPT_DIR = "_corrupt"  # under checkpoints/: checkpoints proven corrupt, kept by name and time, never overwritten
OTHER_RUNS_DIR = "_other_runs"  # under checkpoints/: checkpoints of other fingerprints, one folder per fingerprint
# Loaded again from the verifier when the model is rebuilt: not worth a copy in every checkpoint.
VERIFIER_OWNED = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
_FINGERPRINT_NAME = re.compile(r"[0-9a-f]{1,64}")  # what fingerprint() writes: safe as a folder name

logger = logging.getLogger(__name__)


def fingerprint(
    train_keys: Sequence[str],
    val_key: str,
    verifier: Path,
    layer_ids: list[int],
    vocab: int,
    config: TrainConfig,
    data_samples: int,
) -> str:
    payload = {
        "train": list(train_keys),
        "val": val_key,
        "verifier": str(verifier),
        "layer_ids": layer_ids,
        "draft_vocab_size": vocab,
        "data_samples": data_samples,
        "config": config.fingerprint_fields(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    return sorted(ckpt_dir.glob("epoch_*.pt"))


def _resume_candidates(ckpt_dir: Path) -> list[Path]:
    """The checkpoints, oldest first; a folder that cannot be listed fails naming it (a glob sees an unreadable
    folder as empty: the run would start over and write its checkpoints over the ones it could not see)."""
    try:
        os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    except OSError as error:
        remedy = "every checkpoint is kept and training did not start: fix the disk, mount or permissions and run "
        raise read_error_keeping(error, ckpt_dir, "the checkpoints folder", remedy + "draft_model again") from error
    return list_checkpoints(ckpt_dir)


def saved_fingerprint(path: Path) -> str | None:
    """The fingerprint ``path`` was saved with; None when that cannot be told (gone, unreadable, corrupt: the
    resume judges those). The tensors are memory-mapped, not read: a checkpoint's size costs nothing here."""
    # lazy: loads torch (heavy), which only this path needs
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception:  # whatever the cause, the fingerprint is unknown, and an unknown one is never deleted
        return None
    fingerprint = state.get("fingerprint") if isinstance(state, dict) else None
    return fingerprint if isinstance(fingerprint, str) else None


def set_aside(path: Path, its_fingerprint: str, say: Callable[[str], None]) -> Path:
    """Move a checkpoint of another run to ``_other_runs/<its fingerprint>/``, under its own name unless that is
    taken (then a timestamped one: an earlier set-aside is never replaced), and say where it went."""
    name = its_fingerprint if _FINGERPRINT_NAME.fullmatch(its_fingerprint) else "unknown"
    folder = path.parent / OTHER_RUNS_DIR / name
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    candidates = itertools.chain([path.name], (f"{path.stem}.{stamp}-{os.getpid()}-{n}.pt" for n in itertools.count()))
    for candidate in candidates:
        target = folder / candidate
        try:
            os.link(path, target)  # fails when the name exists, where rename would replace it
        except FileExistsError:
            continue
        break
    fsync_dir(folder)
    path.unlink()
    fsync_dir(path.parent)
    say(
        f"checkpoint {path.name} was made for different data or settings (fingerprint {its_fingerprint}); moved "
        f"to {target}, not resumed and not deleted (move it back into {path.parent} to resume that run)"
    )
    return target


def checkpoint_corruption(data: bytes) -> str | None:
    """Why ``data`` cannot be a whole checkpoint, None when it is sound.

    A checkpoint is a zip archive (torch.save's format) whose records carry a CRC-32: torch.load alone does not
    compare them, so a flipped bit in the weights would load without a word. Parsed from memory, a failure here is
    about the bytes alone, never about the disk they came from.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for record in archive.infolist():
                if not record.CRC:  # saved without checksums (torch.serialization.set_crc32_options(False))
                    continue
                with archive.open(record) as member:  # zipfile compares the CRC-32 at the end of the record
                    while member.read(1 << 24):
                        pass
    except MemoryError:
        raise
    except Exception as error:  # parsed from memory: whatever zipfile raises, the bytes are not an archive
        return f"{type(error).__name__}: {error}"
    return None


def _read_checkpoint(path: Path) -> bytes | None:
    """The checkpoint's bytes; None when it is gone since it was listed (another rank archived it).

    Read here, apart from parsing, so that a read error keeps its errno and is never taken for corruption.
    """
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        remedy = (
            "every checkpoint is kept and training did not start: fix the disk, mount or permissions and run "
            "draft_model again (it resumes from this checkpoint)"
        )
        raise read_error_keeping(error, path, "the checkpoint", remedy) from error
    except MemoryError as error:
        raise MemoryError(
            f"out of memory reading the checkpoint {path}; every checkpoint is kept: free memory and run again"
        ) from error


def load_latest_checkpoint(
    ckpt_dir: Path, expected: str, notes: list[str], archive: bool = True
) -> dict[str, Any] | None:
    """The state of the newest whole checkpoint made with the fingerprint ``expected``; None when there is none.

    A checkpoint proven corrupt is skipped with a note and, when ``archive`` (one rank of a multi-process run does
    it), moved to ``_corrupt/``; one of another fingerprint is skipped with a note and, when ``archive``, moved to
    ``_other_runs/`` (:func:`set_aside`). A read error, a MemoryError, or a whole checkpoint that this environment
    cannot load fails the run naming the file: resuming from an older checkpoint would write over the newer one.
    """
    # lazy: loads torch (heavy), which only this path needs
    import torch

    for path in reversed(_resume_candidates(ckpt_dir)):
        data = _read_checkpoint(path)
        if data is None:
            continue
        why = checkpoint_corruption(data)
        if why is not None:
            # under a timestamped name, never over another file: a later save of this epoch cannot write over it,
            # and its bytes stay for a post-mortem
            if archive:
                archive_corrupt(path, path.parent / CORRUPT_DIR, why, notes.append, "resuming from an older checkpoint")
            else:
                notes.append(f"{path} is corrupt ({why}); skipped, resuming from an older checkpoint")
            continue
        try:
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        except MemoryError as error:
            raise MemoryError(
                f"out of memory loading the checkpoint {path}; every checkpoint is kept: free memory and run again"
            ) from error
        except Exception as error:
            # every record's checksum matched: the file is whole, this environment cannot load it (another torch or
            # numpy version). Not corruption: skipping it would let this run write over it.
            raise RuntimeError(
                f"cannot load the checkpoint {path} ({type(error).__name__}: {error}); its checksums match, so it "
                "is whole and every checkpoint is kept: run draft_model with the torch and numpy versions that "
                f"wrote it, or move {path} aside to resume from an older checkpoint"
            ) from error
        del data
        its_fingerprint = state.get("fingerprint")
        if its_fingerprint == expected:
            return state
        del state
        # an older checkpoint of this run may follow (another run's epoch names sort among this run's)
        if archive:
            set_aside(path, str(its_fingerprint), notes.append)
        else:
            notes.append(f"skipped checkpoint {path.name}: made for different data or settings")
    return None


def rng_state() -> dict[str, Any]:
    # lazy: loads numpy (heavy), which only this path needs
    import numpy as np

    # lazy: loads torch (heavy), which only this path needs
    import torch

    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    # lazy: loads numpy (heavy), which only this path needs
    import numpy as np

    # lazy: loads torch (heavy), which only this path needs
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


# How writers in Rust (safetensors) report an OS error in their own exception: "... (os error 28)".
_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")


def _os_errno(error: BaseException) -> int | None:
    if isinstance(error, OSError):
        return error.errno
    match = _OS_ERROR_IN_TEXT.search(str(error))
    return int(match.group(1)) if match else None


@contextlib.contextmanager
def named_write_errors(path: Path, what: str) -> Iterator[None]:
    """An OS error while writing ``what`` (a full or read-only disk, EIO) names ``path``, the file or folder being
    written rather than its temporary, and says what is kept and how to go on; a full disk stays a DiskSpaceError."""
    try:
        yield
    except Exception as error:
        code = _os_errno(error)
        if code is None:
            raise
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        disk_full = code in (errno.ENOSPC, errno.EDQUOT)
        remedy = {errno.EROFS: f"make {path.parent} writable (remount its disk read-write)"}.get(
            code, f"free space on the disk of {path.parent}" if disk_full else "fix the disk, mount or permissions"
        )
        message = (
            f"cannot write {what} {path} ({reason}); nothing already written is lost (the earlier checkpoints, "
            f"the published final/): {remedy}, then run draft_model again: it resumes after the newest whole "
            "checkpoint"
        )
        kind = DiskSpaceError if disk_full else OSError  # OSError(code, ...) is already its subclass (EACCES: ...)
        raise kind(code, message, str(path)) from error


def save_final(model: Any, final_dir: Path, dtype: str) -> None:

    # lazy: loads torch (heavy), which only this path needs
    import torch

    tmp = final_dir.with_name(f".{final_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    to_save = model if dtype == "float32" else copy.deepcopy(model).to(getattr(torch, dtype))
    try:
        with named_write_errors(final_dir, "the final draft"):
            to_save.save_pretrained(str(tmp))
            replace_dir_atomic(tmp, final_dir)  # the old final/ moved aside, the new one renamed in, the old removed
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a half-written draft holds the space the re-run needs
        raise


def save_history(record: dict[str, Any], out_dir: Path) -> None:
    path = out_dir / HISTORY_FILE
    with named_write_errors(path, "the training history"):
        write_json_atomic(record, path)


def save_checkpoint(
    ckpt_dir: Path,
    epoch: int,
    model: Any,
    optimizers: list,
    schedulers: list,
    history: dict,
    fingerprint: str,
    config: TrainConfig,
    say: Callable[[str], None] = logger.info,
) -> None:
    """The trainable weights, optimizer, scheduler and RNG state and the history after ``epoch``, written atomically;
    only the newest ``keep_checkpoints`` of this ``fingerprint`` are kept, another fingerprint's are set aside
    (:func:`set_aside`, told through ``say``). Called on rank 0 only (every rank holds the same state)."""
    # lazy: loads torch (heavy), which only this path needs
    import torch

    weights = {k: v.detach().cpu() for k, v in model.state_dict().items() if k not in VERIFIER_OWNED}
    state = {
        "epoch": epoch,
        "fingerprint": fingerprint,
        "model": weights,
        "optimizers": [o.state_dict() for o in optimizers],
        "schedulers": [s.state_dict() for s in schedulers],
        "rng": rng_state(),
        "history": history,
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    path = ckpt_dir / f"epoch_{epoch:04d}.pt"
    with named_write_errors(path, "the checkpoint"):
        ensure_free_space(path, len(data), "draft_model checkpoint")
        with atomic_path(path, needed_bytes=len(data)) as tmp:
            tmp.write_bytes(data)
    prune_checkpoints(ckpt_dir, fingerprint, config.keep_checkpoints, say)


def prune_checkpoints(ckpt_dir: Path, fingerprint: str, keep: int, say: Callable[[str], None]) -> None:
    """Delete all but the newest ``keep`` checkpoints of ``fingerprint``; set aside another fingerprint's (never
    counted, never deleted); leave one whose fingerprint cannot be read where it is (the next resume judges it:
    a corrupt one is archived, an unreadable one fails naming it)."""
    ours: list[Path] = []
    for path in list_checkpoints(ckpt_dir):
        its_fingerprint = saved_fingerprint(path)
        if its_fingerprint == fingerprint:
            ours.append(path)
        elif its_fingerprint is not None:
            set_aside(path, its_fingerprint, say)
    for old in ours[:-keep]:
        old.unlink(missing_ok=True)
