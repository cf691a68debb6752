"""One partition of responses -> the verifier's hidden states in speculators' offline training layout.

Layout written under ``layout.hidden_states_dir(key)`` (what ``speculators.train.data.ArrowDataset`` reads,
checked against speculators 0.9.0's loader and ``hs_connectors.FileTransfer``)::

    data-*.arrow, dataset_info.json, state.json   HF datasets ``save_to_disk``, torch format, one row per
                                                  ok response: input_ids int64[T], loss_mask int64[T], seq_len
    hidden_states/hs_{row}.safetensors            hidden_states [T, n_aux + 1, H] (aux layers in order, then
                                                  the last layer's output before the final norm), token_ids int64[T]
    token_freq.pt                                 {token id: count} over loss-masked tokens (speculators' format)
    eagle3_meta.json                              layer_ids, hidden_size, dtype, verifier path (for training)

plus ``index.parquet`` (sample_id, row, seq_len, n_loss_tokens, file, bytes) and ``lineage.json``, written LAST.
The partition is built in ``_staging/{key}`` and published whole by one atomic pointer switch
(:mod:`eagle3_assets.hidden_states.publish`):
``layout.hidden_states_dir(key)`` and ``layout.hidden_states_index_path(key)``
are links that follow it.

Which responses become rows and how a sample file is written: :mod:`eagle3_assets.hidden_states.samples`; the
asset checks: :mod:`eagle3_assets.hidden_states.state_checks`. Resuming: a sample file at its final name is kept when it
opens, has the right shape and its ``token_ids`` equal the sample's ids, otherwise it is redone; the temporary
files a killed run left are deleted first.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_assets.core.precision import AUTO
from eagle3_assets.core.settings import ConfigError
from eagle3_assets.core.storage import (
    DataLayout,
    atomic_path,
    ensure_free_space,
    exclusive_lock,
    remove_dead_writers_temps,
    write_json_atomic,
    write_parquet_atomic,
)
from eagle3_assets.core.verifier import resolve_layer_ids, verifier_shape
from eagle3_assets.hidden_states import versions
from eagle3_assets.hidden_states.backends import (
    BACKEND_NAMES,
    make_backend,
    plan_batches,
    torch_threads,
)
from eagle3_assets.hidden_states.hf_backend import BATCH_TOKENS
from eagle3_assets.hidden_states.publish import INDEX_FILE
from eagle3_assets.hidden_states.samples import (
    HS_FILE,
    HS_SUBDIR,
    TMP_FILE,
    Row,
    estimate_bytes,
    hs_file,
    read_ok_responses_with_digest,
    render_rows,
    validate_sample_file,
    write_sample,
)
from eagle3_assets.hidden_states.state_checks import (  # noqa: F401 (re-exported: callers import them from here)
    META_FILE,
    CheckOutcome,
    check_finite,
    check_one_per_ok_response,
    check_token_ids,
    read_meta,
)
from eagle3_assets.hidden_states.storage_format import STORAGE_DTYPES, backend_dtype
from eagle3_assets.hidden_states.vllm_backend import VLLMBackendOptions
from eagle3_assets.local.extraction_server import context_for

if TYPE_CHECKING:
    import polars as pl

logger = logging.getLogger(__name__)

TOKEN_FREQ_FILE = "token_freq.pt"
# the embedded vLLM extraction server's connector files (read and deleted one by one; swept after a kill)
TRANSFER_DIR = ".vllm-transfer"
_WRITERS = 4


@dataclass(frozen=True)
class HiddenStatesConfig:
    layer_ids: list[int] | None = None  # None: EAGLE-3's default [2, N//2, N-3], validated against the verifier
    max_seq_len: int = 2048
    dtype: str = "bfloat16"  # storage dtype: "bfloat16", "float32" or "float8_e4m3fn" (storage_format.py)
    backend: str = "hf"
    device: str = AUTO  # hf backend: "auto" (cuda if present), "cpu", "cuda", "cuda:1", ...
    precision: str = AUTO  # hf backend compute: "auto" (bf16 on GPUs, float32 on CPUs), "float32", "bfloat16"
    batch_tokens: int = BATCH_TOKENS
    num_threads: int | None = None  # torch intra-op threads; None: all cores but one (see backends.default_threads)
    vllm: VLLMBackendOptions = field(default_factory=VLLMBackendOptions)  # the vllm backend's servers
    # Bytes of state files to keep (training/online_states.py): None stores every sample; 0 stores none (an online
    # partition: token ids, masks, frequencies and lineage only, the states computed while training); N stores the
    # first rows up to ~N bytes (hybrid training reads those and fetches the rest).
    store_budget_bytes: int | None = None

    def validate(self) -> None:
        if self.dtype not in STORAGE_DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}: must be one of {sorted(STORAGE_DTYPES)}")
        if self.max_seq_len <= 1:
            raise ConfigError(f"max_seq_len={self.max_seq_len!r}: must be an integer above 1")
        if self.batch_tokens <= 0:
            raise ConfigError(f"batch_tokens={self.batch_tokens!r}: must be a positive integer")
        if self.backend not in BACKEND_NAMES:
            raise ConfigError(f"backend={self.backend!r}: must be one of {', '.join(BACKEND_NAMES)}")
        if self.store_budget_bytes is not None and self.store_budget_bytes < 0:
            raise ConfigError(f"store_budget_bytes={self.store_budget_bytes!r}: must be >= 0 or None (store all)")


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
    samples_with_states: int = 0  # samples with a stored state file (fewer under a store budget: online training)


def _save_dataset(data_dir: Path, rows: list[Row]) -> None:
    """speculators' dataset (torch format) via save_to_disk into a temp folder, then renamed into place."""
    # lazy: loads datasets (heavy), which only this path needs
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


def _save_token_freq(data_dir: Path, rows: list[Row]) -> dict[int, int]:
    # lazy: loads torch (heavy), which only this path needs
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
    for leftover in [*data_dir.glob("._dataset.tmp-*"), data_dir / TRANSFER_DIR]:
        shutil.rmtree(leftover, ignore_errors=True)
    hs_dir = data_dir / HS_SUBDIR
    if not hs_dir.is_dir():
        return
    for entry in hs_dir.iterdir():
        match = HS_FILE.match(entry.name)
        # half-written temp files from a killed run, and rows beyond the partition (responses shrank)
        if TMP_FILE.match(entry.name) or (match and int(match.group(1)) >= n_rows):
            entry.unlink(missing_ok=True)


def _pending_rows(
    rows: list[Row], data_dir: Path, n_states: int, hidden_size: int, dtype: str
) -> tuple[list[Row], Counter[str]]:
    """The rows whose sample file must be computed; a stored file that fails validation is deleted and counted."""
    pending: list[Row] = []
    reasons: Counter[str] = Counter()
    for r in rows:
        path = hs_file(data_dir, r.row)
        if path.exists():
            why = validate_sample_file(path, r.input_ids, n_states, hidden_size, dtype)
            if why is None:
                continue
            reasons[why.split(" (")[0]] += 1
            path.unlink(missing_ok=True)
        pending.append(r)
    return pending, reasons


def _compute(
    config: HiddenStatesConfig,
    verifier_path: Path,
    layer_ids: list[int],
    pending: list[Row],
    data_dir: Path,
    say: Callable[[str], None],
) -> float:
    """Run the backend over the pending rows and write their files; returns the extraction seconds (start-up of the
    backend, a model load or a server start, excluded)."""
    (data_dir / HS_SUBDIR).mkdir(parents=True, exist_ok=True)
    vllm_options = dataclasses.replace(config.vllm, max_model_len=context_for(config.max_seq_len))
    if not vllm_options.urls and not vllm_options.storage_path:
        # the embedded server's connector files live in the partition folder, so the next run's sweep removes
        # what a killed run left in flight
        vllm_options = dataclasses.replace(vllm_options, storage_path=str(data_dir / TRANSFER_DIR))
    backend = make_backend(
        config.backend, verifier_path, layer_ids, backend_dtype(config.dtype), config.device, config.batch_tokens,
        vllm_options=vllm_options, log=say, precision=config.precision,
    )  # fmt: skip
    started = time.perf_counter()
    try:
        with torch_threads(config.num_threads):
            _run_backend(backend, pending, data_dir, config.dtype, say)
    finally:
        backend.close()
        shutil.rmtree(data_dir / TRANSFER_DIR, ignore_errors=True)
    return time.perf_counter() - started


def _finish(
    layout: DataLayout,
    partition_key: str,
    staging: Path,
    rows: list[Row],
    meta: dict[str, Any],
    extraction: Any,
    responses_digest: str,
    kept: set[int],
) -> tuple[int, Path]:
    """The training dataset, token frequencies, metadata, index and lineage record in the staging folder, then
    the partition published whole with one atomic switch; returns the sample files' bytes and the folder."""
    _save_dataset(staging, rows)
    _save_token_freq(staging, rows)
    write_json_atomic({**meta, "samples": len(rows)}, staging / META_FILE)
    total = int(_write_index(staging / INDEX_FILE, staging, rows, kept)["bytes"].sum())
    versions.record_hidden_states(staging, partition_key, extraction, responses_digest)
    # the sample files were each fsynced as written (samples.write_sample), or are hard links of synced ones
    data_dir = versions.publish_hidden_states(layout, partition_key, staging, files_synced_in=(HS_SUBDIR,))
    return total, data_dir


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
        ok, failed, responses_digest = read_ok_responses_with_digest(layout, partition_key)
        if ok.height == 0:
            raise ValueError(
                f"synthetic_responses partition {partition_key} has no ok responses ({failed} failed): "
                "nothing to extract; regenerate the partition first"
            )
        # Built aside and published whole: the old partition (index included) stays usable until then.
        extraction = versions.hidden_states_extraction_inputs(
            layout, verifier_path, layer_ids, config.max_seq_len, config.dtype
        )
        data_dir = versions.begin_hidden_states(layout, partition_key, extraction)
        rows, served = render_rows(ok, verifier_path, config.max_seq_len, shape.vocab_size, partition_key)
        _cleanup(data_dir, len(rows))
        kept, pending, notes = _plan_rows(rows, data_dir, config, n_states, shape.hidden_size)
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
        extract_seconds = _compute(config, verifier_path, layer_ids, pending, data_dir, say) if pending else 0.0
        meta = {
            "layer_ids": layer_ids, "hidden_size": shape.hidden_size, "num_layers": shape.num_layers,
            "vocab_size": shape.vocab_size, "dtype": config.dtype, "max_seq_len": config.max_seq_len,
            "verifier_path": str(verifier_path), "stored_samples": len(kept),
        }  # fmt: skip
        total_bytes, data_dir = _finish(layout, partition_key, data_dir, rows, meta, extraction, responses_digest, kept)

    return HiddenStatesResult(
        partition_key=partition_key,
        samples=len(rows),
        stored=len(pending),
        skipped_existing=len(kept) - len(pending),
        samples_with_states=len(kept),
        failed_responses_excluded=failed,
        truncated=sum(r.truncated for r in rows),
        zero_loss_samples=sum(1 for r in rows if not any(r.loss_mask)),
        tokens=sum(len(r.input_ids) for r in rows),
        loss_tokens=sum(sum(r.loss_mask) for r in rows),
        tokens_computed=pending_tokens,
        bytes=total_bytes,
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


def _run_backend(backend: Any, pending: list[Row], data_dir: Path, storage: str, say: Callable[[str], None]) -> int:
    """Forward passes on this thread, file writes on a few writer threads so disk I/O overlaps compute.

    Each file is fsynced (atomic_path); an fsync mostly waits on the disk with the GIL released, so a few
    writers in parallel cut the per-file cost ~3x (measured: 11.6 ms/file with 1 writer, 3.7 ms with 4).
    """
    batches = plan_batches([len(r.input_ids) for r in pending], backend.batch_tokens)
    written = 0
    futures: list[Future[int]] = []
    done_batches = 0
    writer = ThreadPoolExecutor(max_workers=_WRITERS, thread_name_prefix="hs-writer")
    try:
        for batch in batches:
            samples = [pending[i] for i in batch]
            try:
                states = backend.extract([s.input_ids for s in samples])
            except Exception as error:  # a backend that knows which sample failed says so: name it for the operator
                index = getattr(error, "sample_index", None)
                if index is None:
                    raise
                sample = samples[index]
                raise type(error)(f"sample {sample.sample_id} (row {sample.row}): {error}") from error
            for sample, hs in zip(samples, states, strict=True):
                path = hs_file(data_dir, sample.row)
                futures.append(writer.submit(write_sample, path, hs, sample.input_ids, sample.sample_id, storage))
            # bound memory held by queued writes, and surface a write error early
            while len(futures) > 256:
                written += futures.pop(0).result()
            done_batches += 1
            if done_batches % 50 == 0:
                say(f"  {done_batches}/{len(batches)} batches")
        for future in futures:
            written += future.result()
    except BaseException:
        # a stop request or an error: finish the files being written, drop the queued ones (the next run computes
        # them) instead of fsyncing up to 256 more files before stopping
        writer.shutdown(wait=True, cancel_futures=True)
        raise
    writer.shutdown()
    return written


def _plan_rows(
    rows: list[Row], data_dir: Path, config: HiddenStatesConfig, n_states: int, hidden_size: int
) -> tuple[set[int], list[Row], list[str]]:
    """(rows that keep a state file, those of them to compute, notes on files redone)."""
    kept = _rows_within_budget(rows, data_dir, config.store_budget_bytes, n_states, hidden_size, config.dtype)
    pending, reasons = _pending_rows([r for r in rows if r.row in kept], data_dir, n_states, hidden_size, config.dtype)
    return kept, pending, [f"redone {n} stored sample file(s): {why}" for why, n in reasons.items()]


def _rows_within_budget(
    rows: list[Row], data_dir: Path, budget: int | None, n_states: int, hidden_size: int, dtype: str
) -> set[int]:
    """The rows whose state files the partition keeps: all, or the first ones within ``budget`` bytes. Files of
    the other rows (left by a build with a larger budget) are removed, so the folder holds what its index says."""
    if budget is None:
        return {r.row for r in rows}
    kept, used = set(), 0
    for r in rows:
        used += estimate_bytes(len(r.input_ids), 1, n_states, hidden_size, dtype)
        if used > budget:
            break
        kept.add(r.row)
    for r in rows:
        if r.row not in kept:
            hs_file(data_dir, r.row).unlink(missing_ok=True)
    return kept


def _write_index(index_path: Path, data_dir: Path, rows: list[Row], kept: set[int]) -> pl.DataFrame:
    # lazy: loads polars (heavy), which only this path needs
    import polars as pl

    frame = pl.DataFrame(
        {
            "sample_id": [r.sample_id for r in rows],
            "row": [r.row for r in rows],
            "seq_len": [len(r.input_ids) for r in rows],
            "n_loss_tokens": [sum(r.loss_mask) for r in rows],
            # a row without a stored file (online or hybrid partition): no file, 0 bytes
            "file": [f"{HS_SUBDIR}/hs_{r.row}.safetensors" if r.row in kept else None for r in rows],
            "bytes": [hs_file(data_dir, r.row).stat().st_size if r.row in kept else 0 for r in rows],
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
