"""One partition of responses -> the verifier's hidden states in speculators' offline training layout.

Layout written under ``layout.hidden_states_dir(key)`` (what ``speculators.train.data.ArrowDataset`` reads,
checked against speculators 0.9.0's loader and ``hs_connectors.FileTransfer``)::

    data-*.arrow, dataset_info.json, state.json   HF datasets ``save_to_disk``, torch format, one row per
                                                  ok response: input_ids int64[T], loss_mask int64[T], seq_len
    hidden_states/hs_{row}.safetensors            hidden_states [T, n_aux + 1, H] (aux layers in order, then
                                                  the last layer's output before the final norm), token_ids int64[T]
    token_freq.pt                                 {token id: count} over loss-masked tokens (speculators' format)
    eagle3_meta.json                              layer_ids, hidden_size, dtype, verifier path (for training)

plus ``layout.hidden_states_index_path(key)`` (sample_id, row, seq_len, n_loss_tokens, file, bytes), written
atomically LAST: its presence means the partition is complete.

Rows are the partition's ``ok`` responses sorted by ``sample_id``, so a re-run assigns every sample the same
row. A sample's tokens are the server's own ``prompt_token_ids + completion_token_ids`` (loss on the completion)
when the response has them, else the conversation re-rendered with the verifier's chat template. Resuming: every
sample file is written to a temporary name and renamed, so after a kill a file either is
whole or is a ``.hs_*.tmp-*`` leftover (deleted); a file at its final name is kept when it opens, has the
right shape and its ``token_ids`` equal the sample's freshly rendered ids, otherwise it is redone.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_assets import lineage
from eagle3_assets.hidden_states.backends import (
    DTYPES,
    make_backend,
    plan_batches,
    resolve_layer_ids,
    torch_threads,
    verifier_shape,
)
from eagle3_assets.settings import ConfigError
from eagle3_assets.storage import (
    DataLayout,
    atomic_path,
    ensure_free_space,
    exclusive_lock,
    read_json,
    remove_dead_writers_temps,
    write_json_atomic,
    write_parquet_atomic,
)

if TYPE_CHECKING:
    import polars as pl
    import torch

logger = logging.getLogger(__name__)

HS_SUBDIR = "hidden_states"
TOKEN_FREQ_FILE = "token_freq.pt"
# what the trainer must agree with (aux layer ids, widths, dtype); ours, not speculators'
META_FILE = "eagle3_meta.json"
_TMP_FILE = re.compile(r"^\.hs_\d+\.safetensors\.tmp-\d+$")
_HS_FILE = re.compile(r"^hs_(\d+)\.safetensors$")
# safetensors header + JSON metadata per file, and the two small per-row dataset columns (8 B each per token)
_FILE_OVERHEAD = 512
_DATASET_BYTES_PER_TOKEN = 16
_WRITERS = 4
TOKEN_ID_COLUMNS = ("prompt_token_ids", "completion_token_ids")


@dataclass(frozen=True)
class HiddenStatesConfig:
    layer_ids: list[int] | None = None  # None: EAGLE-3's default [2, N//2, N-3], validated against the verifier
    max_seq_len: int = 2048
    dtype: str = "bfloat16"  # storage dtype: "bfloat16" or "float32"
    backend: str = "hf"
    device: str = "auto"  # hf backend: "auto" (cuda if present), "cpu", "cuda", "cuda:1", ...
    batch_tokens: int = 8192  # padded tokens per forward pass
    num_threads: int | None = None  # torch intra-op threads; None: all cores but one (see backends.default_threads)

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}: must be one of {sorted(DTYPES)}")
        if self.max_seq_len <= 1:
            raise ConfigError(f"max_seq_len={self.max_seq_len!r}: must be an integer above 1")
        if self.batch_tokens <= 0:
            raise ConfigError(f"batch_tokens={self.batch_tokens!r}: must be a positive integer")


@dataclass
class HiddenStatesResult:
    partition_key: str
    samples: int  # rows of the partition (= ok responses)
    stored: int  # sample files computed and written by this run
    skipped_existing: int  # valid sample files kept from an earlier run
    failed_responses_excluded: int  # responses with status != "ok"
    truncated: int  # samples cut at max_seq_len
    zero_loss_samples: int  # samples with no assistant token inside max_seq_len (kept, contribute no loss)
    tokens: int  # tokens in the partition
    loss_tokens: int
    tokens_computed: int  # tokens run through the verifier by this run
    bytes: int  # bytes of the sample files on disk
    seconds: float  # wall time of this call
    extract_seconds: float  # verifier forward + writing (the part that scales with tokens_computed)
    tokens_per_s: float  # tokens_computed / extract_seconds
    layer_ids: list[int]
    hidden_size: int
    dtype: str
    data_dir: Path
    index_path: Path
    notes: list[str] = field(default_factory=list)
    served_token_ids: int = 0  # samples trained on the server's own token ids (the rest were re-rendered)


@dataclass(frozen=True)
class _Row:
    row: int
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


def hs_file(data_dir: Path, row: int) -> Path:
    return data_dir / HS_SUBDIR / f"hs_{row}.safetensors"


def estimate_bytes(tokens: int, samples: int, n_states: int, hidden_size: int, dtype: str) -> int:
    """Bytes a partition needs: the floor (tokens x states x H x dtype) plus token ids, headers and the dataset."""
    per_token = n_states * hidden_size * DTYPES[dtype] + 8 + _DATASET_BYTES_PER_TOKEN
    return tokens * per_token + samples * _FILE_OVERHEAD


def _read_ok_responses(layout: DataLayout, partition_key: str) -> tuple[pl.DataFrame, int]:
    import polars as pl

    path = layout.responses_path(partition_key)
    if not path.exists():
        raise FileNotFoundError(f"no synthetic_responses partition {partition_key!r} at {path}")
    columns = ["sample_id", "messages", "reasoning", "content", "status"]
    # partitions generated before the token-id columns existed (or by a server without them) render instead
    served = [c for c in TOKEN_ID_COLUMNS if c in pl.read_parquet_schema(path)]
    frame = pl.read_parquet(path, columns=columns + served)
    for column in set(TOKEN_ID_COLUMNS) - set(served):
        frame = frame.with_columns(pl.lit(None, dtype=pl.List(pl.Int64)).alias(column))
    ok = frame.filter(pl.col("status") == "ok").sort("sample_id")
    if ok["sample_id"].n_unique() != ok.height:
        raise ValueError(f"{path} repeats a sample_id among its ok responses")
    return ok, frame.height - ok.height


def _render_rows(
    ok: pl.DataFrame, verifier_path: Path, max_seq_len: int, vocab_size: int, partition_key: str
) -> tuple[list[_Row], int]:
    """The training sequence of every ok response, and how many of them are the server's own token ids.

    The server's ids (``prompt_token_ids`` + ``completion_token_ids``, loss on the completion) are exactly what
    vLLM will feed the draft; re-tokenizing the rendered text is the fallback for responses without them.
    """
    from transformers import AutoTokenizer

    from eagle3_assets.hidden_states.render import ChatRenderer

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
            mask = [0] * len(prompt_ids) + [1] * len(completion_ids)
            rows.append(_Row(row, record["sample_id"], ids[:max_seq_len], mask[:max_seq_len], len(ids) > max_seq_len))
            served += 1
            continue
        sample = renderer.render(record["messages"] or [], record["reasoning"], record["content"])
        rows.append(_Row(row, record["sample_id"], sample.input_ids, sample.loss_mask, sample.truncated))
    return rows, served


def validate_sample_file(path: Path, input_ids: list[int], n_states: int, hidden_size: int, dtype: str) -> str | None:
    """Why the stored file cannot be reused (None when it can): opens, shapes, dtype, token_ids == input_ids.

    Reads the header and the token ids only; the hidden states themselves are checked by
    :func:`check_finite` (reading every value of a partition is the check's job, not every resume's).
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = set(handle.keys())
            if keys != {"hidden_states", "token_ids"}:
                return f"keys {sorted(keys)}"
            hs = handle.get_slice("hidden_states")
            shape = tuple(hs.get_shape())
            if shape != (len(input_ids), n_states, hidden_size):
                return f"shape {shape} != {(len(input_ids), n_states, hidden_size)}"
            stored_dtype = hs.get_dtype()
            if stored_dtype != {"bfloat16": "BF16", "float32": "F32"}[dtype]:
                return f"dtype {stored_dtype}"
            if handle.get_tensor("token_ids").tolist() != input_ids:
                return "token_ids differ from the rendered sample"
    except Exception as error:
        return f"unreadable ({type(error).__name__}: {error})"
    return None


def _write_sample(path: Path, hidden_states: torch.Tensor, input_ids: list[int], sample_id: str) -> int:
    import torch
    from safetensors.torch import save_file

    # Catch a broken verifier at the source instead of training on NaNs (the same test speculators applies).
    lo, hi = torch.aminmax(hidden_states)
    if not bool(torch.isfinite(torch.stack((lo, hi))).all()):
        raise ValueError(f"hidden states of {sample_id} contain non-finite values (min={lo}, max={hi})")
    tensors = {"hidden_states": hidden_states.contiguous(), "token_ids": torch.tensor(input_ids, dtype=torch.long)}
    with atomic_path(path, needed_bytes=hidden_states.numel() * hidden_states.element_size()) as tmp:
        save_file(tensors, str(tmp))
    return path.stat().st_size


def _save_dataset(data_dir: Path, rows: list[_Row]) -> None:
    """speculators' dataset (torch format) via save_to_disk into a temp folder, then renamed into place."""
    from datasets import Dataset

    dataset = Dataset.from_dict(
        {
            "input_ids": [r.input_ids for r in rows],
            "loss_mask": [r.loss_mask for r in rows],
            "seq_len": [len(r.input_ids) for r in rows],
        }
    )
    dataset.set_format(type="torch")
    tmp = data_dir / f"._dataset.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    dataset.save_to_disk(str(tmp))
    # state.json names the arrow files, so it goes last; same-named files are replaced atomically
    names = sorted(p.name for p in tmp.iterdir())
    for name in [n for n in names if n != "state.json"] + ["state.json"]:
        os.replace(tmp / name, data_dir / name)
    for old in data_dir.glob("data-*.arrow"):
        if old.name not in names:
            old.unlink()
    tmp.rmdir()


def _save_token_freq(data_dir: Path, rows: list[_Row]) -> dict[int, int]:
    import torch

    counts: Counter[int] = Counter()
    for r in rows:
        counts.update(t for t, m in zip(r.input_ids, r.loss_mask, strict=True) if m)
    freq = dict(counts)
    with atomic_path(data_dir / TOKEN_FREQ_FILE) as tmp:
        torch.save(freq, tmp)
    return freq


def _cleanup(data_dir: Path, n_rows: int) -> None:
    """Remove what a killed run left (called under the partition lock): every atomic-write temporary of a dead
    writer in the partition folder (``.token_freq.pt.tmp-PID``, ``.eagle3_meta.json.tmp-PID``, ...), any
    ``._dataset.tmp-*`` / ``.hs_*.tmp-*`` leftover, and sample files of rows beyond the partition."""
    remove_dead_writers_temps(data_dir)
    # The lock makes this process the partition's only writer, so these go whatever their pid (a reused pid too).
    for leftover in data_dir.glob("._dataset.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    hs_dir = data_dir / HS_SUBDIR
    if not hs_dir.is_dir():
        return
    for entry in hs_dir.iterdir():
        match = _HS_FILE.match(entry.name)
        # half-written temp files from a killed run, and rows beyond the partition (responses shrank)
        if _TMP_FILE.match(entry.name) or (match and int(match.group(1)) >= n_rows):
            entry.unlink(missing_ok=True)


def extract_partition(
    layout: DataLayout,
    partition_key: str,
    verifier_path: str | Path,
    config: HiddenStatesConfig | None = None,
    log: Callable[[str], None] | None = None,
) -> HiddenStatesResult:
    """Compute (or resume) the hidden states of one responses partition; see the module docstring."""
    config = config or HiddenStatesConfig()
    config.validate()
    say = log or logger.info
    started = time.perf_counter()
    verifier_path = Path(verifier_path).expanduser().resolve()
    shape = verifier_shape(verifier_path)
    layer_ids = resolve_layer_ids(config.layer_ids, shape.num_layers)
    n_states = len(layer_ids) + 1
    data_dir = layout.hidden_states_dir(partition_key)
    index_path = layout.hidden_states_index_path(partition_key)

    with exclusive_lock(layout.lock_path("hidden_states", partition_key), f"hidden_states partition {partition_key}"):
        ok, failed = _read_ok_responses(layout, partition_key)
        if ok.height == 0:
            raise ValueError(
                f"synthetic_responses partition {partition_key} has no ok responses ({failed} failed): "
                "nothing to extract; regenerate the partition first"
            )
        # Built aside and published whole: the old partition (index included) stays usable until then.
        extraction = lineage.hidden_states_extraction_inputs(
            layout, verifier_path, layer_ids, config.max_seq_len, config.dtype
        )
        data_dir = lineage.begin_hidden_states(layout, partition_key, extraction)
        rows, served = _render_rows(ok, verifier_path, config.max_seq_len, shape.vocab_size, partition_key)
        _cleanup(data_dir, len(rows))

        pending: list[_Row] = []
        reasons: Counter[str] = Counter()
        existing_bytes = 0
        for r in rows:
            path = hs_file(data_dir, r.row)
            if path.exists():
                why = validate_sample_file(path, r.input_ids, n_states, shape.hidden_size, config.dtype)
                if why is None:
                    existing_bytes += path.stat().st_size
                    continue
                reasons[why.split(" (")[0]] += 1
                path.unlink()
            pending.append(r)
        notes = [f"redone {n} stored sample file(s): {why}" for why, n in reasons.items()]
        if served < len(rows):
            notes.append(
                f"{len(rows) - served} of {len(rows)} responses carry no token ids (generated without "
                "return_token_ids): re-rendered with the chat template, which may differ from the served tokens"
            )
        pending_tokens = sum(len(r.input_ids) for r in pending)
        needed = estimate_bytes(pending_tokens, len(pending), n_states, shape.hidden_size, config.dtype)
        ensure_free_space(data_dir.parent, needed, f"hidden_states partition {partition_key}")
        say(
            f"hidden_states {partition_key}: {len(rows)} samples, {len(rows) - len(pending)} already stored, "
            f"{len(pending)} to compute ({pending_tokens:,} tokens, ~{needed / 2**20:,.1f} MiB)"
        )

        new_bytes = 0
        extract_started = time.perf_counter()
        if pending:
            (data_dir / HS_SUBDIR).mkdir(parents=True, exist_ok=True)
            backend = make_backend(
                config.backend, verifier_path, layer_ids, config.dtype, config.device, config.batch_tokens
            )
            extract_started = time.perf_counter()  # tokens/s: forward + capture + writes, not the model load
            try:
                with torch_threads(config.num_threads):
                    new_bytes = _run_backend(backend, pending, data_dir, say)
            finally:
                backend.close()
        extract_seconds = time.perf_counter() - extract_started

        _save_dataset(data_dir, rows)
        _save_token_freq(data_dir, rows)
        write_json_atomic(
            {
                "layer_ids": layer_ids,
                "hidden_size": shape.hidden_size,
                "num_layers": shape.num_layers,
                "vocab_size": shape.vocab_size,
                "dtype": config.dtype,
                "max_seq_len": config.max_seq_len,
                "verifier_path": str(verifier_path),
                "samples": len(rows),
            },
            data_dir / META_FILE,
        )
        data_dir = lineage.publish_hidden_states(layout, partition_key, data_dir)
        index = _write_index(index_path, data_dir, rows)
        lineage.record_hidden_states(layout, partition_key, extraction)
        total_bytes = int(index["bytes"].sum())

    tokens = sum(len(r.input_ids) for r in rows)
    return HiddenStatesResult(
        partition_key=partition_key,
        samples=len(rows),
        stored=len(pending),
        skipped_existing=len(rows) - len(pending),
        failed_responses_excluded=failed,
        truncated=sum(r.truncated for r in rows),
        zero_loss_samples=sum(1 for r in rows if not any(r.loss_mask)),
        tokens=tokens,
        loss_tokens=sum(sum(r.loss_mask) for r in rows),
        tokens_computed=pending_tokens,
        bytes=total_bytes if total_bytes else existing_bytes + new_bytes,
        seconds=time.perf_counter() - started,
        extract_seconds=extract_seconds,
        tokens_per_s=pending_tokens / extract_seconds if pending and extract_seconds > 0 else 0.0,
        layer_ids=layer_ids,
        hidden_size=shape.hidden_size,
        dtype=config.dtype,
        data_dir=data_dir,
        index_path=index_path,
        notes=notes,
        served_token_ids=served,
    )


def _run_backend(backend: Any, pending: list[_Row], data_dir: Path, say: Callable[[str], None]) -> int:
    """Forward passes on this thread, file writes on a few writer threads so disk I/O overlaps compute.

    Each file is fsynced (atomic_path); an fsync mostly waits on the disk with the GIL released, so a few
    writers in parallel cut the per-file cost ~3x (measured: 11.6 ms/file with 1 writer, 3.7 ms with 4).
    """
    batches = plan_batches([len(r.input_ids) for r in pending], backend.batch_tokens)
    written = 0
    futures: list[Future[int]] = []
    done_batches = 0
    with ThreadPoolExecutor(max_workers=_WRITERS, thread_name_prefix="hs-writer") as writer:
        for batch in batches:
            samples = [pending[i] for i in batch]
            states = backend.extract([s.input_ids for s in samples])
            for sample, hs in zip(samples, states, strict=True):
                futures.append(
                    writer.submit(_write_sample, hs_file(data_dir, sample.row), hs, sample.input_ids, sample.sample_id)
                )
            # bound memory held by queued writes, and surface a write error early
            while len(futures) > 256:
                written += futures.pop(0).result()
            done_batches += 1
            if done_batches % 50 == 0:
                say(f"  {done_batches}/{len(batches)} batches")
        for future in futures:
            written += future.result()
    return written


def _write_index(index_path: Path, data_dir: Path, rows: list[_Row]) -> pl.DataFrame:
    import polars as pl

    frame = pl.DataFrame(
        {
            "sample_id": [r.sample_id for r in rows],
            "row": [r.row for r in rows],
            "seq_len": [len(r.input_ids) for r in rows],
            "n_loss_tokens": [sum(r.loss_mask) for r in rows],
            "file": [f"{HS_SUBDIR}/hs_{r.row}.safetensors" for r in rows],
            "bytes": [hs_file(data_dir, r.row).stat().st_size for r in rows],
        },
        schema={
            "sample_id": pl.String,
            "row": pl.Int64,
            "seq_len": pl.Int64,
            "n_loss_tokens": pl.Int64,
            "file": pl.String,
            "bytes": pl.Int64,
        },
    )
    write_parquet_atomic(frame, index_path)
    return frame


# ------------------------------------------------------------------------------------------------ checks


@dataclass(frozen=True)
class CheckOutcome:
    passed: bool
    description: str
    metadata: dict[str, Any] = field(default_factory=dict)


def read_meta(layout: DataLayout, partition_key: str) -> dict[str, Any]:
    """The partition's layer ids, widths and dtype as extracted (``eagle3_meta.json``)."""
    return read_json(layout.hidden_states_dir(partition_key) / META_FILE)


def _load_index(layout: DataLayout, partition_key: str) -> pl.DataFrame:
    import polars as pl

    return pl.read_parquet(layout.hidden_states_index_path(partition_key))


def check_token_ids(layout: DataLayout, partition_key: str) -> CheckOutcome:
    """Every stored sample's ``token_ids`` equal its dataset row's ``input_ids`` (what speculators' loader needs)."""
    from datasets import load_from_disk
    from safetensors import safe_open

    data_dir = layout.hidden_states_dir(partition_key)
    dataset = load_from_disk(str(data_dir)).with_format(None)
    bad = []
    for row, ids in enumerate(dataset["input_ids"]):
        with safe_open(str(hs_file(data_dir, row)), framework="pt") as handle:
            if handle.get_tensor("token_ids").tolist() != list(ids):
                bad.append(row)
    description = f"{len(bad)} of {len(dataset)} samples have token_ids != input_ids"
    return CheckOutcome(not bad, description, {"bad_rows": bad[:20]})


def check_finite(layout: DataLayout, partition_key: str) -> CheckOutcome:
    """No NaN/Inf in any stored hidden state (reads every value)."""
    import torch
    from safetensors.torch import load_file

    data_dir = layout.hidden_states_dir(partition_key)
    index = _load_index(layout, partition_key)
    bad = []
    for row in index["row"].to_list():
        hs = load_file(str(hs_file(data_dir, row)))["hidden_states"]
        if not bool(torch.isfinite(hs).all()):
            bad.append(row)
    return CheckOutcome(not bad, f"{len(bad)} of {index.height} samples hold NaN/Inf", {"bad_rows": bad[:20]})


def check_one_per_ok_response(layout: DataLayout, partition_key: str) -> CheckOutcome:
    """Exactly one stored sample per ``ok`` response, each sample file present."""
    ok, _failed = _read_ok_responses(layout, partition_key)
    index = _load_index(layout, partition_key)
    expected = set(ok["sample_id"].to_list())
    stored = index["sample_id"].to_list()
    missing = sorted(expected - set(stored))
    extra = sorted(set(stored) - expected)
    dupes = len(stored) - len(set(stored))
    data_dir = layout.hidden_states_dir(partition_key)
    absent = [r for r in index["row"].to_list() if not hs_file(data_dir, r).exists()]
    passed = not (missing or extra or dupes or absent)
    return CheckOutcome(
        passed,
        f"{len(stored)} stored for {len(expected)} ok responses: {len(missing)} missing, {len(extra)} extra, "
        f"{dupes} duplicated, {len(absent)} files absent",
        {"missing": missing[:20], "extra": extra[:20], "absent_rows": absent[:20]},
    )
