"""Turn-by-turn regeneration (``EAGLE3_REGENERATE=all-turns``): the model writes every assistant turn.

For each conversation the model answers the first user turn; its answer replaces the dataset's, the next user
turn is asked on top of that regenerated history, and so on. Each turn is one request and one journal line
(``sample_id`` ``<conversation>#turn<k>``), so a kill loses at most the turns in flight and a re-run continues every
conversation from its last journaled turn. A turn's request fingerprint covers the settings and the conversation's
user turns up to it: an edited user turn makes that turn and every later one stale, the earlier ones are kept.

Scheduling: a conversation's next turn is queued the moment its previous turn is journaled (``Engine.enqueue``),
not in rounds, so a long conversation never waits for the slowest answer of every other conversation.

Rules (docs/operating.md): a leading system turn is kept as the system prompt of every request; the dataset's
assistant turns are all dropped (leading ones had nothing to answer, later ones are rewritten); empty user turns are
skipped; a turn the server refuses because it no longer fits the context ends the conversation at the last turn that
fit (``ok``, ``stop_reason`` says why; nothing already answered is lost). A conversation is ``ok`` only when every
turn it asked is. Finished turns are kept in ``_turns/<partition>.parquet`` beside the partition for resume.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from eagle3_assets.core import hashing, storage
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.generation.engine import Engine, EngineStats, preflight
from eagle3_assets.generation.fingerprint import (
    FINGERPRINT_COLUMN,
    FingerprintInputs,
    digest,
    prompt_set_digest,
    request_fingerprint,
)
from eagle3_assets.generation.generation_config import GenerationConfig
from eagle3_assets.generation.journal import Journal, merge_records, read_journal
from eagle3_assets.generation.records import (
    STATUS_FAILED,
    STATUS_OK,
    TURN_MARK,
    PromptToGenerate,
    normalize_messages,
)
from eagle3_assets.generation.records import rows_to_frame as _frame
from eagle3_assets.generation.run_common import (
    corrupt_dir,
    failed_alike_kept,
    generation_result,
    previous_rows,
    read_finished_parquet,
    request_model,
    retire_journal,
    run_async,
    run_journaled,
    set_aside,
    space_floor,
)
from eagle3_assets.generation.transport import close_all, make_transports

Log = Callable[[str], None]
Record = dict[str, Any]

# vLLM's refusals of a prompt longer than the model's context (wording differs between versions)
_CONTEXT_ERROR = re.compile(r"context length|maximum model length|max_model_len", re.IGNORECASE)


@dataclass(frozen=True)
class Conversation:
    """The parts of a prompt the model is asked, turn by turn."""

    sample_id: str
    system: tuple[dict[str, str], ...]  # () or the leading system turn
    users: tuple[str, ...]  # the non-empty user turns, in order


def split_conversation(prompt: PromptToGenerate) -> Conversation:
    """Apply the rules: keep a leading system turn, drop every assistant turn, skip empty user turns."""
    messages = normalize_messages(prompt.messages)
    system = tuple(messages[:1]) if messages and messages[0]["role"] == "system" else ()
    users = tuple(m["content"] for m in messages if m["role"] == "user" and m["content"].strip())
    return Conversation(prompt.sample_id, system, users)


def turn_id(sample_id: str, k: int) -> str:
    """The journal's id of turn ``k`` (0-based) of a conversation (1-based in the id, as people count turns)."""
    return f"{sample_id}{TURN_MARK}{k + 1}"


def parse_turn_id(value: str) -> tuple[str, int]:
    sample_id, _, number = value.rpartition(TURN_MARK)
    return sample_id, int(number) - 1


def turn_fingerprints(settings_digest: str, conversations: Sequence[Conversation]) -> dict[str, str]:
    """turn id -> fingerprint of the settings and the user turns up to that turn (the answers before it are the
    model's own, so they follow from these)."""
    fingerprints: dict[str, str] = {}
    for conv in conversations:
        asked = list(conv.system)
        for k, text in enumerate(conv.users):
            asked.append({"role": "user", "content": text})
            fingerprints[turn_id(conv.sample_id, k)] = request_fingerprint(settings_digest, asked)
    return fingerprints


def turn_prompt(conv: Conversation, k: int, previous: Mapping[str, Any] | None) -> PromptToGenerate:
    """The request of turn ``k``: the regenerated history (turn ``k - 1``'s request and answer) + user turn ``k``.

    Only the answer's ``content`` travels back as history (the row schema holds role and content); the server's
    chat template then renders earlier turns as it renders any assistant message without reasoning."""
    if k == 0 or previous is None:
        history = list(conv.system)
    else:
        answer = {"role": "assistant", "content": previous.get("content") or ""}
        history = [*normalize_messages(previous["messages"]), answer]
    return PromptToGenerate(turn_id(conv.sample_id, k), [*history, {"role": "user", "content": conv.users[k]}])


def is_context_error(record: Mapping[str, Any] | None) -> bool:
    return bool(record and record.get("status") != STATUS_OK and _CONTEXT_ERROR.search(record.get("error") or ""))


def answered(conv: Conversation, known: Mapping[str, Mapping[str, Any]]) -> int:
    """How many turns of ``conv``, from the first, have an ok record."""
    k = 0
    while k < len(conv.users) and (known.get(turn_id(conv.sample_id, k)) or {}).get("status") == STATUS_OK:
        k += 1
    return k


def next_turn(conv: Conversation, known: Mapping[str, Mapping[str, Any]]) -> PromptToGenerate | None:
    """The turn to request next, or None when the conversation is finished (all answered, or out of context)."""
    k = answered(conv, known)
    if k == len(conv.users) or (k > 0 and is_context_error(known.get(turn_id(conv.sample_id, k)))):
        return None
    return turn_prompt(conv, k, known.get(turn_id(conv.sample_id, k - 1)) if k else None)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _history_span(turn: Mapping[str, Any], next_prompt: Sequence[int], final: Sequence[int]) -> list[int] | None:
    """Where ``turn``'s answer sits among the final request's prompt ids, or None when it cannot be placed exactly.

    It starts where the next request's prompt ids leave this request's (the generation prompt ends there) and
    ends at the first later occurrence of the token the answer ended with (the template's end-of-turn token). A
    template that renders earlier turns differently from a prefix, or an answer cut by max_tokens (no end token
    to find), is left out of the loss rather than guessed."""
    own_prompt, own = turn.get("prompt_token_ids"), turn.get("completion_token_ids")
    if (
        not own_prompt
        or not own
        or turn.get("finish_reason") != "stop"
        or list(final[: len(next_prompt)]) != list(next_prompt)
    ):
        return None
    start = _first_difference(own_prompt, next_prompt)
    try:
        end = list(next_prompt).index(own[-1], start) + 1
    except ValueError:
        return None
    return [start, end]


def model_spans(turns: Sequence[Mapping[str, Any]]) -> list[list[int]] | None:
    """[start, end) offsets, in the last request's ``prompt_token_ids + completion_token_ids``, of every turn the
    model wrote (the loss mask); None when the server sent no token ids."""
    last = turns[-1]
    prompt, completion = last.get("prompt_token_ids"), last.get("completion_token_ids")
    if prompt is None or completion is None:
        return None
    spans = []
    for before, after in itertools.pairwise(turns):
        span = _history_span(before, after.get("prompt_token_ids") or [], prompt)
        if span is not None:
            spans.append(span)
    spans.append([len(prompt), len(prompt) + len(completion)])
    return spans


def conversation_row(conv: Conversation, known: Mapping[str, Mapping[str, Any]], partition_key: str) -> Record:
    """The partition's row of ``conv`` from its turn records: ok when every asked turn is, else failed."""
    n = len(conv.users)
    if n == 0:
        return _bare_failed(conv, partition_key, "no non-empty user turn to answer (empty user turns are skipped)")
    k = answered(conv, known)
    pending = known.get(turn_id(conv.sample_id, k)) if k < n else None
    if k == 0 or (k < n and not is_context_error(pending)):
        if pending is None:
            raise RuntimeError(f"partition {partition_key}: turn {k + 1} of {conv.sample_id} has no record")
        row = dict(pending)
        row.update(status=STATUS_FAILED, content=None, reasoning=None)
        row["error"] = f"turn {k + 1} of {n} failed ({k} earlier turns kept and resumed): {pending.get('error')}"
    else:
        turns = [known[turn_id(conv.sample_id, i)] for i in range(k)]
        row = dict(turns[-1])
        spans = model_spans(turns)
        row["model_spans"] = spans
        row["model_tokens"] = sum(end - start for start, end in spans) if spans is not None else None
        row["latency_s"] = float(sum(t.get("latency_s") or 0.0 for t in turns))
        row["attempts"] = sum(t.get("attempts") or 0 for t in turns)
        if k < n:
            why = (pending or {}).get("error")
            row["stop_reason"] = f"stopped after turn {k} of {n}: turn {k + 1} no longer fits the context ({why})"
    row.update(sample_id=conv.sample_id, partition_key=partition_key, turns_regenerated=k, turns_total=n)
    return row


def _bare_failed(conv: Conversation, partition_key: str, error: str) -> Record:
    return {
        "sample_id": conv.sample_id,
        "partition_key": partition_key,
        "messages": list(conv.system),
        "status": STATUS_FAILED,
        "error": error,
        # no request was made: a time here would be new on every run, and with it the partition's data version
        "finished_at": None,
        "turns_regenerated": 0,
        "turns_total": 0,
    }


def turns_store_path(layout: DataLayout, partition_key: str) -> Path:
    return layout.responses_turns_path(partition_key)


def _read_store(
    path: Path, current: Callable[[Mapping[str, Any]], bool], log: Log, archive_dir: Path
) -> tuple[dict[str, Record], dict[str, Record]]:
    """(the stored turn records that answer the current requests, the others: kept aside, never dropped).

    A store that cannot be read fails the run naming it; one proven corrupt is archived (``run_parts``)."""
    frame = read_finished_parquet(path, archive_dir, log)
    if frame is None:
        return {}, {}
    stored: dict[str, Record] = {}
    other: dict[str, Record] = {}
    for row in frame.iter_rows(named=True):
        (stored if current(row) else other)[row["sample_id"]] = row
    return stored, other


async def _pool(
    todo: Sequence[PromptToGenerate],
    conversations: Mapping[str, Conversation],
    fingerprints: Mapping[str, str],
    config: GenerationConfig,
    journal: Journal,
    partition_key: str,
    log: Log,
    line_dir: Path,
) -> EngineStats:
    """Run the first pending turn of every conversation; each ok turn queues the conversation's next one."""
    transports = make_transports(config)
    engine: Engine | None = None

    def on_finished(record: Record) -> None:
        record[FINGERPRINT_COLUMN] = fingerprints[record["sample_id"]]
        journal.append(record)  # journaled before the next turn is asked: resume continues from here
        sample_id, k = parse_turn_id(record["sample_id"])
        conv = conversations[sample_id]
        if record.get("status") == STATUS_OK and k + 1 < len(conv.users) and engine is not None:
            engine.enqueue(turn_prompt(conv, k + 1, record))

    try:
        model, unhealthy = await preflight(transports, config, log)
        prefix = f"synthetic_responses {partition_key} (turns) "
        engine = Engine(
            config, model, transports, on_finished, partition_key=partition_key, log=log, progress_prefix=prefix,
            unhealthy=unhealthy, line_dir=line_dir,
        )  # fmt: skip
        return await run_journaled(engine, todo, journal, config.fsync_interval_s)  # type: ignore[no-any-return]
    finally:
        await close_all(transports)


def generate_all_turns(
    prompts: Sequence[PromptToGenerate], partition_key: str, layout: DataLayout, config: GenerationConfig, log: Log
) -> Any:
    """``generate_partition`` for ``regenerate == "all-turns"``: one row per conversation, written atomically."""
    started = time.monotonic()
    final_path, journal_path = layout.responses_path(partition_key), layout.responses_in_progress_path(partition_key)
    store_path = turns_store_path(layout, partition_key)
    with storage.exclusive_lock(layout.lock_path("synthetic_responses", partition_key), f"partition {partition_key}"):
        model, unreachable = request_model(config, layout.responses_manifest_path(partition_key), log)
        config = dataclasses.replace(config, model=model)
        inputs = FingerprintInputs(model, config.sampling_params(), config.model_revision)
        settings = digest([inputs.settings_digest, "all-turns"], 64)
        conversations = {p.sample_id: split_conversation(p) for p in prompts}
        fingerprints = turn_fingerprints(settings, list(conversations.values()))

        def current(record: Mapping[str, Any]) -> bool:
            return record.get(FINGERPRINT_COLUMN) == fingerprints.get(record.get("sample_id"))  # type: ignore[arg-type]

        wanted = {p.sample_id for p in prompts}
        # turns kept aside by a last-turn run (journaled before a switch of EAGLE3_REGENERATE) or an earlier
        # setting: reused where they answer the current requests
        archive_path = layout.responses_superseded_path(partition_key)
        archived, _other = previous_rows(archive_path, wanted, current, log, corrupt_dir(layout))
        stored, stored_other = _read_store(store_path, current, log, corrupt_dir(layout))
        contents = read_journal(journal_path, current)
        known = merge_records(archived, stored, contents.records)
        todo = [t for c in conversations.values() if (t := next_turn(c, known)) is not None]
        kept = sum(1 for r in known.values() if r.get("status") == STATUS_OK)
        log(f"synthetic_responses {partition_key}: {len(prompts)} conversations, {kept} turns already answered "
            f"(kept), {len(todo)} conversations to continue")  # fmt: skip
        stats = EngineStats()
        if todo and unreachable is not None:
            raise unreachable
        if todo:
            storage.ensure_free_space(journal_path.parent, space_floor(todo), f"partition {partition_key}")
            journal = Journal.open(journal_path, valid_size=contents.valid_size)
            line_dir = layout.asset_dir("synthetic_responses") / "_capacity_line"
            try:
                run = _pool(todo, conversations, fingerprints, config, journal, partition_key, log, line_dir)
                stats = run_async(run)
            finally:
                journal.close()
            contents = dataclasses.replace(read_journal(journal_path, current), torn_bytes=contents.torn_bytes)
            known = failed_alike_kept(known, merge_records(archived, stored, contents.records))
        frame = _frame([conversation_row(c, known, partition_key) for c in conversations.values()])
        turns = _frame([known[t] for t in fingerprints if t in known])
        storage.write_parquet_atomic(turns, store_path)
        # Before the journal goes: its lines of the other mode (an interrupted last-turn run) or of other settings,
        # and the store's turns of other settings, are kept in the superseded archive, not dropped.
        set_aside(layout, partition_key, wanted, pl.concat([frame, turns]), log, stored_other, contents.stale)
        storage.write_parquet_atomic(frame, final_path)
        data_version = hashing.file_digest(final_path)
        manifest = {
            "partition_key": partition_key, "request": inputs.as_dict(), "regenerate": "all-turns",
            "settings_digest": settings, "rows": frame.height, "data_version": data_version,
            "prompt_set_digest": prompt_set_digest((p.sample_id, p.messages) for p in prompts),
        }  # fmt: skip
        storage.write_json_atomic(manifest, layout.responses_manifest_path(partition_key))
        retire_journal(journal_path, contents, corrupt_dir(layout), log)
        wall = time.monotonic() - started
        result = generation_result(
            partition_key, final_path, frame, stats, kept, stats.total, model, wall, contents.torn_bytes
        )
        return dataclasses.replace(result, settings_digest=settings, data_version=data_version)
