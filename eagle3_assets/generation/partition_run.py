"""Generate one ``synthetic_responses`` partition: resume, run the pool, journal, write Parquet atomically."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import polars as pl

from eagle3_assets.core import hashing, storage
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.generation.engine import Engine, EngineStats, preflight
from eagle3_assets.generation.fingerprint import (
    FINGERPRINT_COLUMN,
    FingerprintInputs,
    fingerprints_for,
    prompt_set_digest,
    stale_reason,
)
from eagle3_assets.generation.generation_config import GenerationConfig
from eagle3_assets.generation.journal import Journal, JournalContents, merge_records, read_journal
from eagle3_assets.generation.records import STATUS_OK, PromptToGenerate, rows_to_frame
from eagle3_assets.generation.run_common import (
    GenerationResult,
    corrupt_dir,
    failed_alike_kept,
    generation_result,
    keep_superseded,
    previous_rows,
    request_model,
    retire_journal,
    run_async,
    run_journaled,
    space_floor,
)
from eagle3_assets.generation.transport import close_all, make_transports
from eagle3_assets.generation.turns import generate_all_turns

Log = Callable[[str], None]


def partition_prompts(layout: DataLayout, partition_key: str) -> list[PromptToGenerate]:
    """The prompts of one partition from ``raw_prompts``' Parquet, in dataset (position) order."""
    path = layout.prompts_path
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; materialize raw_prompts first")
    frame = (
        pl.scan_parquet(path)
        .filter(pl.col("partition_key") == partition_key)
        .select("sample_id", "position", "messages")
        .sort("position")
        .collect()
    )
    return [PromptToGenerate(row["sample_id"], row["messages"]) for row in frame.iter_rows(named=True)]


def _filtered(records: Mapping[str, dict[str, Any]], wanted: set[str]) -> dict[str, dict[str, Any]]:
    return {sid: record for sid, record in records.items() if sid in wanted}


def _stamped(append: Callable[[dict[str, Any]], None], fingerprints: Mapping[str, str]) -> Callable[..., None]:
    """``append`` that first stamps each record with its request's fingerprint (the engine does not know it)."""

    def on_finished(record: dict[str, Any]) -> None:
        record[FINGERPRINT_COLUMN] = fingerprints[record["sample_id"]]
        append(record)

    return on_finished


async def _generate(
    todo: Sequence[PromptToGenerate],
    partition_key: str,
    config: GenerationConfig,
    journal: Journal,
    log: Log,
    already_done: int,
    fingerprints: Mapping[str, str],
    line_dir: Path | None = None,
) -> tuple[EngineStats, str]:
    transports = make_transports(config)
    try:
        model, unhealthy = await preflight(transports, config, log)
        engine = Engine(
            config,
            model,
            transports,
            _stamped(journal.append, fingerprints),
            partition_key=partition_key,
            log=log,
            progress_prefix=f"synthetic_responses {partition_key} ",
            already_done=already_done,
            unhealthy=unhealthy,
            line_dir=line_dir,
        )
        stats = await run_journaled(engine, todo, journal, config.fsync_interval_s)
    finally:
        await close_all(transports)
    return stats, model


def generate_partition(
    prompts: Sequence[PromptToGenerate],
    partition_key: str,
    layout: DataLayout,
    config: GenerationConfig,
    log: Log = print,
) -> GenerationResult:
    """Generate every prompt of one partition and write ``layout.responses_path(partition_key)``.

    Resumable and idempotent: ok samples already on disk (final Parquet or in-progress journal) are kept
    and not requested again; failed and missing ones are requested. Every finished sample is appended to
    the journal at once. The Parquet holds exactly one row per prompt (ok + failed == len(prompts)).
    Raises :class:`eagle3_assets.core.storage.PartitionBusyError` if another process writes this partition.
    """
    started = time.monotonic()
    ids = [p.sample_id for p in prompts]
    wanted = _unique_ids(ids, partition_key)
    if config.regenerate == "all-turns":
        return generate_all_turns(prompts, partition_key, layout, config, log)  # type: ignore[no-any-return]
    final_path = layout.responses_path(partition_key)
    journal_path = layout.responses_in_progress_path(partition_key)
    lock = layout.lock_path("synthetic_responses", partition_key)
    with storage.exclusive_lock(lock, f"synthetic_responses partition {partition_key}"):
        # Which request each prompt is sent as decides which stored rows are still answers to it.
        model, unreachable = request_model(config, layout.responses_manifest_path(partition_key), log)
        config = dataclasses.replace(config, model=model)
        inputs = FingerprintInputs(model, config.sampling_params(), config.model_revision)
        fingerprints = fingerprints_for(inputs, prompts)

        def current(record: Mapping[str, Any]) -> bool:
            return record.get(FINGERPRINT_COLUMN) == fingerprints.get(record.get("sample_id"))  # type: ignore[arg-type]

        # a finished file that cannot be read fails the run here; one proven corrupt is archived (run_parts.py)
        previous, stale_previous = previous_rows(final_path, wanted, current, log, corrupt_dir(layout), failed=True)
        # answers to a request that was current once, kept aside when settings changed (or by the other
        # EAGLE3_REGENERATE mode): current again, reused
        archive_path = layout.responses_superseded_path(partition_key)
        archived, old_archived = previous_rows(archive_path, wanted, current, log, corrupt_dir(layout))
        previous = merge_records(archived, previous)
        contents = _read_journal_saying_what_was_dropped(journal_path, current, log)
        torn = contents.torn_bytes
        known = merge_records(previous, _filtered(contents.records, wanted))
        kept = {sid for sid, record in known.items() if record.get("status") == STATUS_OK}
        stale_reasons = _stale_reasons(prompts, set(known), fingerprints, stale_previous, contents.stale)
        todo = [p for p in prompts if p.sample_id not in kept]
        failed_before = sum(1 for p in todo if p.sample_id in known)
        _log_plan(log, partition_key, len(prompts), len(kept), failed_before, stale_reasons, len(todo))
        stats = EngineStats()
        if todo and unreachable is not None:
            raise unreachable  # rows to generate and no server to ask: the preflight's own error
        if todo:
            run = (todo, partition_key, config, journal_path, contents.valid_size)
            # the partitions' line at the servers (key order among this pipeline's runs; generation/capacity.py)
            line_dir = layout.asset_dir("synthetic_responses") / "_capacity_line"
            stats, model = _run_pool(*run, log, len(kept), fingerprints, line_dir)
            contents = read_journal(journal_path, current)
            known = failed_alike_kept(known, merge_records(previous, _filtered(contents.records, wanted)))
        missing = [sid for sid in ids if sid not in known]
        if missing:  # the engine finishes every sample it is given; this would be a bug, never a silent gap
            raise RuntimeError(f"partition {partition_key}: {len(missing)} samples have no record, e.g. {missing[:3]}")
        frame = rows_to_frame([known[sid] for sid in ids])
        storage.write_parquet_atomic(frame, final_path)
        keep_superseded(archive_path, frame, old_archived, stale_previous, contents.stale)
        data_version = hashing.file_digest(final_path)
        _write_manifest(layout, partition_key, inputs, prompts, frame.height, data_version, stale_reasons)
        retire_journal(journal_path, contents, corrupt_dir(layout), log)
        result = generation_result(
            partition_key, final_path, frame, stats, len(kept), len(todo), model, time.monotonic() - started, torn
        )
        return dataclasses.replace(
            result,
            stale=sum(stale_reasons.values()),
            stale_reasons=dict(stale_reasons),
            settings_digest=inputs.settings_digest,
            data_version=data_version,
        )


def _read_journal_saying_what_was_dropped(
    journal_path: Path, current: Callable[[Mapping[str, Any]], bool], log: Log
) -> JournalContents:
    contents = read_journal(journal_path, current)
    if contents.torn_bytes:
        torn = contents.torn_bytes
        log(f"dropped a torn last line ({torn} bytes) from {journal_path.name}, left by an interrupted run")
    if contents.corrupt_lines:
        log(f"skipped {contents.corrupt_lines} unparseable line(s) in {journal_path.name}")
    return contents


def _unique_ids(ids: Sequence[str], partition_key: str) -> set[str]:
    wanted = set(ids)
    if len(wanted) != len(ids):
        dupes = sorted({sid for sid in ids if ids.count(sid) > 1})[:5]
        raise ValueError(f"partition {partition_key}: duplicate sample_id(s) in the prompts, e.g. {dupes}")
    return wanted


def _log_plan(
    log: Log, partition_key: str, prompts: int, kept: int, failed_before: int, stale: Counter[str], todo: int
) -> None:
    count = sum(stale.values())
    why = f": {', '.join(f'{n} {reason}' for reason, n in stale.items())}" if count else ""
    log(
        f"synthetic_responses {partition_key}: {prompts} prompts; {kept} already ok on disk "
        f"(kept, not requested again); {failed_before} failed before (retried); "
        f"{count} stale (answered another request, generated again{why}); {todo - failed_before - count} to generate"
    )


def _run_pool(
    todo: Sequence[PromptToGenerate],
    partition_key: str,
    config: GenerationConfig,
    journal_path: Path,
    valid_size: int,
    log: Log,
    already_done: int,
    fingerprints: Mapping[str, str],
    line_dir: Path,
) -> tuple[EngineStats, str]:
    """Generate ``todo`` into the partition's journal (cut to ``valid_size``: a torn last line goes)."""
    # Before the preflight and the pool: a full disk would otherwise cost a run of requests that die on the
    # first journal write.
    storage.ensure_free_space(journal_path.parent, space_floor(todo), f"synthetic_responses partition {partition_key}")
    journal = Journal.open(journal_path, valid_size=valid_size)
    try:
        return run_async(_generate(todo, partition_key, config, journal, log, already_done, fingerprints, line_dir))
    finally:
        journal.close()
        if journal.appended == 0 and journal_path.stat().st_size == 0:
            journal_path.unlink()  # a run that failed before any sample leaves no empty file


def _write_manifest(
    layout: DataLayout,
    partition_key: str,
    inputs: FingerprintInputs,
    prompts: Sequence[PromptToGenerate],
    rows: int,
    data_version: str,
    stale: Counter[str],
) -> None:
    """The partition's lineage: what every row answers (the fingerprint inputs), for which prompt set."""
    storage.write_json_atomic(
        {
            "partition_key": partition_key,
            "request": inputs.as_dict(),
            "settings_digest": inputs.settings_digest,
            "prompt_set_digest": prompt_set_digest((p.sample_id, p.messages) for p in prompts),
            "rows": rows,
            "data_version": data_version,
            "stale_regenerated": dict(stale),
        },
        layout.responses_manifest_path(partition_key),
    )


def _stale_reasons(
    prompts: Sequence[PromptToGenerate],
    known: set[str],
    fingerprints: Mapping[str, str],
    *stale_sources: Mapping[str, Mapping[str, Any]],
) -> Counter[str]:
    """Why each prompt without a current row had an ok row for another request (file or journal)."""
    reasons: Counter[str] = Counter()
    for prompt in prompts:
        sid = prompt.sample_id
        if sid in known:  # a current row (ok: kept; failed: retried) exists
            continue
        for source in reversed(stale_sources):  # the journal is newer than the file
            record = source.get(sid)
            if record is not None and record.get("status") == STATUS_OK:
                why = stale_reason(record, fingerprints[sid], prompt.messages)
                if why is not None:
                    reasons[why] += 1
                    break
    return reasons


# Partitions a command generates at once: the next one queues its requests while the one before drains (the
# capacity line gives the lower key the room), so the server is never left to drain a tail between partitions.
OVERLAPPED_PARTITIONS = 2


def generate_partitions(
    prompts_by_key: Mapping[str, Sequence[PromptToGenerate]],
    layout: DataLayout,
    config: GenerationConfig,
    log: Log = print,
    at_once: int = OVERLAPPED_PARTITIONS,
) -> dict[str, GenerationResult]:
    """:func:`generate_partition` for every key of ``prompts_by_key``, ``at_once`` of them at a time, started in
    key order: what the daemon's backfill does with one run per partition, for commands that generate several
    partitions in one process (the learning curve, the engine benchmark). Returns each key's result; the first
    failure is raised once the partitions already going have ended (no new one starts after it)."""
    keys = sorted(prompts_by_key)
    results: dict[str, GenerationResult] = {}
    with ThreadPoolExecutor(max_workers=max(1, at_once), thread_name_prefix="generate") as pool:
        futures = {key: pool.submit(generate_partition, prompts_by_key[key], key, layout, config, log) for key in keys}
        try:
            for key in keys:
                results[key] = futures[key].result()
        except BaseException:
            for future in futures.values():
                future.cancel()
            raise
    return results
