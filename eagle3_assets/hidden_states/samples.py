"""One sample of a partition: which responses become rows, their token ids, and the sample file on disk.

Rows are the partition's ``ok`` responses sorted by ``sample_id``, so a re-run assigns every sample the same row. A
sample's tokens are the server's own ``prompt_token_ids + completion_token_ids`` (loss on the completion) when the
response has them, else the conversation re-rendered with the verifier's chat template. Each sample file
(``hidden_states/hs_{row}.safetensors``: ``hidden_states`` [T, n_aux + 1, H] and ``token_ids`` int64[T]) is
written to a temporary name and renamed, so after a kill a file either is whole or is a ``.hs_*.tmp-*`` leftover.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3_assets.core.storage import DataLayout, DiskSpaceError, atomic_path, read_error_keeping
from eagle3_assets.hidden_states import storage_format
from eagle3_assets.hidden_states.render import ChatRenderer

if TYPE_CHECKING:
    import polars as pl
    import torch

HS_SUBDIR = "hidden_states"
TMP_FILE = re.compile(r"^\.hs_\d+\.safetensors\.tmp-\d+$")
HS_FILE = re.compile(r"^hs_(\d+)\.safetensors$")
# how a Rust writer (safetensors) names the OS error it met
_OS_ERROR = re.compile(r"\(os error (\d+)\)")
# safetensors header + JSON metadata per file, and the two small per-row dataset columns (8 B each per token)
_FILE_OVERHEAD = 512
_DATASET_BYTES_PER_TOKEN = 16
TOKEN_ID_COLUMNS = ("prompt_token_ids", "completion_token_ids")
# EAGLE3_REGENERATE=all-turns rows: [start, end) offsets of every model-written turn in the token ids
SPANS_COLUMN = "model_spans"


@dataclass(frozen=True)
class Row:
    row: int
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


def hs_file(data_dir: Path, row: int) -> Path:
    return data_dir / HS_SUBDIR / f"hs_{row}.safetensors"


def estimate_bytes(tokens: int, samples: int, n_states: int, hidden_size: int, dtype: str) -> int:
    """Bytes a partition needs: the floor (tokens x states x H x dtype, + FP8's scales) plus token ids, headers and
    the dataset."""
    per_token = storage_format.bytes_per_token(dtype, n_states, hidden_size) + 8 + _DATASET_BYTES_PER_TOKEN
    return tokens * per_token + samples * _FILE_OVERHEAD


def read_ok_responses(layout: DataLayout, partition_key: str) -> tuple[pl.DataFrame, int]:
    ok, failed, _digest = read_ok_responses_with_digest(layout, partition_key)
    return ok, failed


def read_ok_responses_with_digest(layout: DataLayout, partition_key: str) -> tuple[pl.DataFrame, int, str]:
    """(ok responses sorted by sample_id, failed count, digest of exactly the bytes parsed).

    The file is read once into memory and both parsed and hashed from those bytes, so the digest a build's lineage
    records is that of what it read, even when the partition is regenerated (renamed over) meanwhile.
    """

    # lazy: loads polars (heavy), which only this path needs
    import polars as pl

    path = layout.responses_path(partition_key)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"no synthetic_responses partition {partition_key!r} at {path}") from None
    digest = hashlib.sha256(data).hexdigest()[:32]  # hashing.file_digest's form: comparable with data versions
    columns = ["sample_id", "messages", "reasoning", "content", "status"]
    # partitions generated before the token-id columns existed (or by a server without them) render instead
    served = [c for c in TOKEN_ID_COLUMNS if c in pl.read_parquet_schema(io.BytesIO(data))]
    spans = [SPANS_COLUMN] if SPANS_COLUMN in pl.read_parquet_schema(io.BytesIO(data)) else []
    frame = pl.read_parquet(io.BytesIO(data), columns=columns + served + spans)
    for column in set(TOKEN_ID_COLUMNS) - set(served):
        frame = frame.with_columns(pl.lit(None, dtype=pl.List(pl.Int64)).alias(column))
    if not spans:
        frame = frame.with_columns(pl.lit(None, dtype=pl.List(pl.List(pl.Int64))).alias(SPANS_COLUMN))
    ok = frame.filter(pl.col("status") == "ok").sort("sample_id")
    if ok["sample_id"].n_unique() != ok.height:
        raise ValueError(f"{path} repeats a sample_id among its ok responses")
    return ok, frame.height - ok.height, digest


def render_rows(
    ok: pl.DataFrame, verifier_path: Path, max_seq_len: int, vocab_size: int, partition_key: str
) -> tuple[list[Row], int]:
    """The training sequence of every ok response, and how many of them are the server's own token ids.

    The server's ids (``prompt_token_ids`` + ``completion_token_ids``, loss on the completion) are exactly what
    vLLM will feed the draft; re-tokenizing the rendered text is the fallback for responses without them.
    """
    # lazy: loads transformers (heavy), which only this path needs
    from transformers import AutoTokenizer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(str(verifier_path)), max_seq_len)
    rows = []
    served = 0
    for row, record in enumerate(ok.iter_rows(named=True)):
        prompt_ids, completion_ids = record["prompt_token_ids"], record["completion_token_ids"]
        if prompt_ids is not None and completion_ids is not None:
            ids = [*prompt_ids, *completion_ids]
            if ids and max(ids) >= vocab_size:
                raise ValueError(
                    f"synthetic_responses partition {partition_key}, sample {record['sample_id']}: token id "
                    f"{max(ids)} is outside the verifier's vocabulary ({vocab_size} at {verifier_path}); the "
                    "responses were generated by another model than EAGLE3_VERIFIER_PATH"
                )
            mask = loss_mask(len(prompt_ids), len(completion_ids), record.get(SPANS_COLUMN))
            rows.append(Row(row, record["sample_id"], ids[:max_seq_len], mask[:max_seq_len], len(ids) > max_seq_len))
            served += 1
            continue
        sample = renderer.render(record["messages"] or [], record["reasoning"], record["content"])
        rows.append(Row(row, record["sample_id"], sample.input_ids, sample.loss_mask, sample.truncated))
    return rows, served


def loss_mask(n_prompt: int, n_completion: int, spans: list[list[int]] | None) -> list[int]:
    """1 on the tokens the model wrote: the completion, or with ``spans`` (all-turns rows) exactly those offsets,
    which include the model's earlier turns inside the prompt ids and never a dataset-written turn."""
    if spans is None:
        return [0] * n_prompt + [1] * n_completion
    mask = [0] * (n_prompt + n_completion)
    for start, end in spans:
        mask[start:end] = [1] * (min(end, len(mask)) - start)
    return mask


def validate_sample_file(path: Path, input_ids: list[int], n_states: int, hidden_size: int, dtype: str) -> str | None:
    """Why the stored file cannot be reused (None when it can): opens, shapes, dtype, token_ids == input_ids.

    Reads the header and the token ids only; the hidden states themselves are checked by
    :func:`check_finite` (reading every value of a partition is the check's job, not every resume's).
    """
    # lazy: loads safetensors (heavy), which only this path needs
    from safetensors import safe_open

    try:
        # Opened here first: safetensors reports EACCES as FileNotFoundError and I/O errors as its own error, so
        # only Python's open tells a read error (which must stop the run) from a bad file (which is redone).
        with open(path, "rb") as probe:
            probe.read(8)
        with safe_open(str(path), framework="pt") as handle:
            keys = set(handle.keys())
            if keys != storage_format.file_keys(dtype):
                return f"keys {sorted(keys)}"
            hs = handle.get_slice("hidden_states")
            shape = tuple(hs.get_shape())
            if shape != (len(input_ids), n_states, hidden_size):
                return f"shape {shape} != {(len(input_ids), n_states, hidden_size)}"
            stored_dtype = hs.get_dtype()
            if stored_dtype != storage_format.safetensors_dtype(dtype):
                return f"dtype {stored_dtype}"
            if storage_format.SCALES_KEY in keys:
                scales = tuple(handle.get_slice(storage_format.SCALES_KEY).get_shape())
                if scales != (len(input_ids), n_states, 1):
                    return f"scales shape {scales} != {(len(input_ids), n_states, 1)}"
            if handle.get_tensor("token_ids").tolist() != input_ids:
                return "token_ids differ from the rendered sample"
    except FileNotFoundError:
        return "missing"
    except OSError as error:
        # A read error is not corruption (EIO, EACCES, a stale NFS handle): fail naming the file and keep it, so a
        # disk or mount problem never turns into deleting and recomputing the partition's samples.
        remedy = "it is kept as it is: fix the disk, mount or permissions and run again"
        raise read_error_keeping(error, path, "the stored sample file", remedy) from error
    except MemoryError as error:
        raise MemoryError(f"out of memory reading the stored sample file {path}; it is kept as it is") from error
    except Exception as error:  # safetensors' own error: the bytes are not a valid sample file (bad header, size)
        return f"unreadable ({type(error).__name__}: {error})"
    return None


def write_sample(
    path: Path, hidden_states: torch.Tensor, input_ids: list[int], sample_id: str, storage: str = "bfloat16"
) -> int:
    """Write one sample file in the ``storage`` dtype (``storage_format``); returns its size in bytes."""
    # lazy: loads torch (heavy), which only this path needs
    import torch
    from safetensors.torch import save_file

    # Catch a broken verifier at the source instead of training on NaNs (the same test speculators applies).
    lo, hi = torch.aminmax(hidden_states)
    if not bool(torch.isfinite(torch.stack((lo, hi))).all()):
        raise ValueError(f"hidden states of {sample_id} contain non-finite values (min={lo}, max={hi})")
    tensors = {**storage_format.encode(hidden_states, storage), "token_ids": torch.tensor(input_ids, dtype=torch.long)}
    try:
        with atomic_path(path, needed_bytes=sum(t.numel() * t.element_size() for t in tensors.values())) as tmp:
            save_file(tensors, str(tmp))
    except DiskSpaceError:
        raise  # names the path and the bytes already
    except Exception as error:
        named = _write_error(error, path)
        if named is error:
            raise
        raise named from error
    return path.stat().st_size


def _write_error(error: Exception, path: Path) -> Exception:
    """A write failure of ``path`` as an OSError naming it (safetensors reports EROFS or EIO as a SafetensorError
    naming only its own temporary file), or ``error`` itself when it is no I/O failure."""
    code = error.errno if isinstance(error, OSError) else None
    if code is None and (match := _OS_ERROR.search(str(error))) is not None:
        code = int(match.group(1))
    if code is None:
        return error
    return OSError(
        code,
        f"cannot write the sample file {path} ({os.strerror(code)}); the samples stored so far are kept and resumed: "
        "fix the disk or mount and run again",
        str(path),
    )
