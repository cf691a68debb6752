"""The draft vocabulary: the most frequent assistant tokens, mapped with speculators' own function.

Frequencies are the partitions' ``token_freq.pt`` (loss-masked tokens only, as speculators counts them),
summed over the given partitions. ``build_vocab_mappings_from_distribution`` picks the top ``draft_vocab_size``
ids and returns ``d2t`` (int64 [draft], target id = i + d2t[i]) and ``t2d`` (bool [target]).

A configured draft vocabulary larger than the target's is capped at the target's size (a draft cannot have
more tokens than the verifier; this is the case for tiny verifiers with the default 32000) and the result
says so in ``notes``. When the two sizes are equal speculators treats the draft as full-vocabulary and ignores
the mappings, which is exactly right.

Written to ``layout.vocab_mapping_dir``: ``vocab_mapping.safetensors`` (``d2t`` and ``t2d`` in ONE file written
atomically, so they always come from the same build; checked on every load), ``token_freq.pt`` (the merged counts)
and ``vocab.json`` (sizes, coverage). speculators' CLI takes ``--d2t-path``/``--t2d-path`` as .npy files:
``python -c "from safetensors.numpy import load_file; import numpy as np; m = load_file('vocab_mapping.safetensors');
[np.save(k + '.npy', v) for k, v in m.items()]"`` writes them.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.core.hashing import digest, file_digest
from eagle3_assets.core.lineage import NO_VOCAB_MAPPING
from eagle3_assets.core.settings import ConfigError
from eagle3_assets.core.storage import DataLayout, exclusive_lock, write_bytes_atomic, write_json_atomic
from eagle3_assets.hidden_states import publish
from eagle3_assets.hidden_states.extract import TOKEN_FREQ_FILE
from eagle3_assets.speculators_adapter import build_vocab_mappings

MAPPING_FILE = "vocab_mapping.safetensors"
DRAFT_VOCAB_SIZE = 32000  # speculators' default draft vocabulary (capped at the verifier's)
# the real-model recipe's (SmolLM2's 49k tokens): the demo-real run, the ablation and the recipe benchmarks
RECIPE_DRAFT_VOCAB_SIZE = 8192
LEGACY_FILES = ("d2t.npy", "t2d.npy")  # two separate files of earlier versions (could disagree): replaced
FREQ_FILE = "token_freq.pt"
SUMMARY_FILE = "vocab.json"
REMEDY = (
    "re-materialize vocab_mapping (the UI, or `dagster asset materialize -m eagle3_assets.definitions "
    "--select vocab_mapping`)"
)


class VocabMappingError(ValueError):
    """A vocabulary mapping that is missing a tensor, has the wrong shapes, or whose d2t and t2d disagree."""


@dataclass
class VocabResult:
    draft_vocab_size: int  # the size used (after capping)
    requested_draft_vocab_size: int
    target_vocab_size: int
    capped: bool
    distinct_tokens: int  # distinct loss-masked token ids seen
    loss_tokens: int  # loss-masked tokens counted
    coverage: float  # share of loss-masked tokens whose id is in the draft vocabulary
    partitions: list[str]
    mapping_path: Path  # vocab_mapping.safetensors: d2t and t2d
    token_freq_path: Path
    notes: list[str] = field(default_factory=list)


def check_vocab_mapping(d2t: Any, t2d: Any, path: Path, remedy: str = REMEDY) -> None:
    """Raise VocabMappingError (naming ``path`` and ``remedy``) unless d2t (int [draft]) and t2d (bool [target])
    describe the same draft vocabulary: t2d marks exactly ``draft`` target ids, and draft id i is target id
    i + d2t[i] for each of them, in order."""
    # lazy: loads torch (heavy), which only this path needs
    import torch

    def fail(why: str) -> VocabMappingError:
        return VocabMappingError(f"vocabulary mapping {path}: {why}; {remedy}")

    if d2t is None or t2d is None:
        raise fail("d2t or t2d is missing")
    if d2t.dim() != 1 or t2d.dim() != 1 or d2t.dtype.is_floating_point or t2d.dtype != torch.bool:
        raise fail(f"d2t must be a 1-D integer tensor and t2d a 1-D bool one, got {d2t.dtype}{list(d2t.shape)} "
                   f"and {t2d.dtype}{list(t2d.shape)}")  # fmt: skip
    draft, target = int(d2t.shape[0]), int(t2d.shape[0])
    if draft > target or int(t2d.sum()) != draft:
        raise fail(f"d2t has {draft} draft tokens but t2d marks {int(t2d.sum())} of {target} target tokens")
    mapped = torch.arange(draft, dtype=torch.long) + d2t.long()
    if not torch.equal(torch.nonzero(t2d).flatten(), mapped):
        raise fail("d2t and t2d disagree on which target token a draft token is (built by two different runs?)")


def save_vocab_mapping(d2t: Any, t2d: Any, path: Path) -> None:
    """Both tensors in one safetensors file, written to a temporary name and renamed: never half of a pair."""
    # lazy: loads torch (heavy), which only this path needs
    from safetensors.torch import save

    data = save(
        {"d2t": d2t.to(dtype=d2t.dtype).contiguous(), "t2d": t2d.contiguous()},
        metadata={"draft_vocab_size": str(int(d2t.shape[0])), "target_vocab_size": str(int(t2d.shape[0]))},
    )
    write_bytes_atomic(_sorted_header(data), path)


def _sorted_header(data: bytes) -> bytes:
    """safetensors bytes with the metadata in their JSON header sorted by key, padded to the header's length.
    safetensors writes the metadata from a hash map: its order, so the file's bytes, changed from one build of the
    same mapping to the next, and with them the checkpoint fingerprint that hashes the file: a finished draft trained
    again from scratch after an unchanged ``vocab_mapping`` re-run (one time in two). Only the metadata is sorted:
    the tensors' entries keep safetensors' order, so the bytes are those of one of its two layouts, and a
    checkpoint trained on a mapping written in that layout still resumes."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(text) > length:  # not from the same keys and values in safetensors' compact form: leave it as written
        return data
    return data[:8] + text.ljust(length) + data[8 + length :]


@dataclass(frozen=True)
class LoadedVocabMapping:
    """A checked mapping and the digest of exactly the bytes it was loaded from (what a training fingerprint
    records: the file may be rebuilt by a concurrent ``vocab_mapping`` run right after it was read)."""

    d2t: Any
    t2d: Any
    digest: str  # :func:`mapping_folder_digest` with the loaded bytes


def mapping_folder_digest(folder: Path, loaded: bytes | None) -> str:
    """The vocabulary part of a training checkpoint's fingerprint, the value every earlier version recorded
    (``hashing.files_digest`` over the files in ``folder``), so a checkpoint of an earlier version trained with the
    same mapping still resumes. The mapping file's entry is of ``loaded``, the bytes the run built its draft from
    (None: it loaded none, and a mapping written since is not counted), never of the file on disk now, which a
    concurrent ``vocab_mapping`` run may have rebuilt. The other files (the counts and summary the mapping was built
    from) are read now, as before: a rebuild in between only makes the fingerprint match nothing, and the run
    starts fresh rather than resuming a draft of another vocabulary."""
    hashes: dict[str, str] = {}
    if loaded is not None:
        hashes[MAPPING_FILE] = hashlib.sha256(loaded).hexdigest()
    for path in folder.glob("*") if folder.is_dir() else ():
        if path.name == MAPPING_FILE or not path.is_file():
            continue
        with contextlib.suppress(FileNotFoundError):  # gone since it was listed: files_digest skipped it too
            hashes[path.name] = file_digest(path, 64)
    # files_digest's list: (name, sha256 hex) in path order, which within one folder is name order
    return digest(sorted(hashes.items()))


def fingerprint_part(layout: DataLayout, loaded: LoadedVocabMapping | None) -> str:
    """What a training run's checkpoint fingerprint records for the vocabulary it trained with (``loaded``: what
    :func:`read_vocab_mapping` returned): the loaded mapping's :func:`mapping_folder_digest`, or, when it loaded
    none, that of the folder's other files, or ``lineage.NO_VOCAB_MAPPING`` when there is no folder."""
    if loaded is not None:
        return loaded.digest
    if not layout.vocab_mapping_dir.is_dir():
        return NO_VOCAB_MAPPING
    return mapping_folder_digest(layout.vocab_mapping_dir, None)


def load_vocab_mapping(layout: DataLayout) -> tuple[Any, Any] | None:
    """(d2t, t2d) as torch tensors, checked (VocabMappingError names the file and the remedy); None when no
    mapping was built."""
    loaded = read_vocab_mapping(layout)
    return None if loaded is None else (loaded.d2t, loaded.t2d)


def read_vocab_mapping(layout: DataLayout) -> LoadedVocabMapping | None:
    """:func:`load_vocab_mapping` with the digest of the bytes read: the file is read ONCE, and both the tensors
    and the digest come from those bytes. None when no mapping was built."""
    # lazy: loads safetensors (heavy), which only this path needs
    from safetensors import SafetensorError

    # lazy: loads torch (heavy), which only this path needs
    from safetensors.torch import load

    path = layout.vocab_mapping_dir / MAPPING_FILE
    if not path.exists():
        legacy = [
            layout.vocab_mapping_dir / name for name in LEGACY_FILES if (layout.vocab_mapping_dir / name).exists()
        ]
        if legacy:
            raise VocabMappingError(
                f"vocabulary mapping {legacy[0]} is in the two-file layout of an earlier version (d2t and t2d written "
                f"separately, never checked to agree); {REMEDY}"
            )
        return None
    try:
        data = path.read_bytes()
        tensors = load(data)
    except (SafetensorError, OSError, ValueError) as error:
        raise VocabMappingError(f"vocabulary mapping {path} is unreadable ({error}); {REMEDY}") from error
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    check_vocab_mapping(d2t, t2d, path)
    return LoadedVocabMapping(d2t, t2d, mapping_folder_digest(layout.vocab_mapping_dir, data))


def build_vocab_mapping(
    layout: DataLayout,
    partition_keys: Sequence[str],
    draft_vocab_size: int = DRAFT_VOCAB_SIZE,
    *,
    target_vocab_size: int,
) -> VocabResult:
    # Cheap checks first: importing torch and speculators takes ~20 s.
    if draft_vocab_size <= 0:
        raise ConfigError(f"draft_vocab_size={draft_vocab_size!r}: must be a positive integer")
    if target_vocab_size <= 0:
        raise ConfigError(f"target_vocab_size={target_vocab_size!r}: must be a positive integer")
    if not partition_keys:
        raise ValueError("vocab_mapping needs at least one hidden_states partition")

    # lazy: loads torch (heavy), which only this path needs
    import torch

    counts: Counter[int] = Counter()
    with publish.pinned(layout, partition_keys) as dirs:  # the versions read: never swept or switched meanwhile
        for key in partition_keys:
            path = dirs[key] / TOKEN_FREQ_FILE
            if not path.exists():
                raise FileNotFoundError(f"hidden_states partition {key} has no {TOKEN_FREQ_FILE} at {path}")
            counts.update(torch.load(path, weights_only=True))
    if any(t < 0 or t >= target_vocab_size for t in counts):
        raise ValueError(f"token ids outside the target vocabulary of {target_vocab_size}: wrong verifier?")

    notes = []
    size = draft_vocab_size
    if size > target_vocab_size:
        size = target_vocab_size
        notes.append(
            f"draft_vocab_size {draft_vocab_size} capped at the target vocabulary size {target_vocab_size} "
            "(full vocabulary: speculators ignores the mapping)"
        )
    freq = dict(counts)
    d2t, t2d = build_vocab_mappings(freq, draft_vocab_size=size, target_vocab_size=target_vocab_size)

    loss_tokens = sum(freq.values())
    covered = sum(n for t, n in freq.items() if bool(t2d[t]))
    coverage = covered / loss_tokens if loss_tokens else 0.0
    if len(freq) < size:
        notes.append(f"only {len(freq)} distinct assistant tokens seen; the rest of the draft vocabulary is filler")

    out = layout.vocab_mapping_dir
    with exclusive_lock(layout.lock_path("vocab_mapping"), "vocab_mapping"):
        buffer = io.BytesIO()
        torch.save(freq, buffer)
        write_bytes_atomic(buffer.getvalue(), out / FREQ_FILE)
        check_vocab_mapping(d2t, t2d, out / MAPPING_FILE, "a bug in the vocabulary build: report it")
        save_vocab_mapping(d2t, t2d, out / MAPPING_FILE)
        for name in LEGACY_FILES:  # an earlier version's pair would contradict the one mapping
            (out / name).unlink(missing_ok=True)
        result = VocabResult(
            draft_vocab_size=size,
            requested_draft_vocab_size=draft_vocab_size,
            target_vocab_size=target_vocab_size,
            capped=size != draft_vocab_size,
            distinct_tokens=len(freq),
            loss_tokens=loss_tokens,
            coverage=coverage,
            partitions=list(partition_keys),
            mapping_path=out / MAPPING_FILE,
            token_freq_path=out / FREQ_FILE,
            notes=notes,
        )
        summary = {k: (str(v) if isinstance(v, Path) else v) for k, v in result.__dict__.items()}
        write_json_atomic(summary, out / SUMMARY_FILE)
    return result
