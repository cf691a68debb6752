"""The plan: partitions, stages, bytes and the disk advice (``eagle3_assets.planning`` has the formulas)."""

from __future__ import annotations

import inspect
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3_assets.core.partition_keys import partition_key
from eagle3_assets.core.storage import ensure_free_space, free_bytes
from eagle3_assets.hidden_states.samples import estimate_bytes
from eagle3_assets.hidden_states.storage_format import (
    FP8,
    STORAGE_DTYPES,
)
from eagle3_assets.planning import inputs

# storage.ensure_free_space's margin: the plan advises against a store the extraction itself would refuse
DISK_HEADROOM: float = inspect.signature(ensure_free_space).parameters["headroom"].default


# ------------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class PartitionPlan:
    key: str
    samples: int
    failed: int  # prompts of max_model_len tokens or more: the server refuses them
    cut: int  # ok samples longer than max_seq_len (their hidden states stop there)
    prompt_tokens: int  # of the ok samples
    completion_tokens: int  # of the ok samples
    sequence_tokens: int  # stored per token: prompt + completion cut at max_seq_len
    sample_bytes: dict[str, int]  # sample files per dtype
    disk_bytes: dict[str, int]  # the extraction's free-space estimate per dtype

    @property
    def ok(self) -> int:
        return self.samples - self.failed


@dataclass(frozen=True)
class StagePlan:
    stage: str
    tokens: int
    rate: inputs.Rate
    seconds: float | None


@dataclass
class Plan:
    model: inputs.ModelShape
    prompts: inputs.Prompts
    completion: inputs.Completion
    partition_size: int
    max_tokens: int
    max_seq_len: int
    max_model_len: int | None
    dtype: str
    epochs: int
    partitions: list[PartitionPlan]
    stages: list[StagePlan]
    free_bytes: int | None
    free_source: str
    advice: str
    notes: list[str]

    @property
    def held_out(self) -> str | None:
        return self.partitions[-1].key if len(self.partitions) > 1 else None

    def total(self, name: str) -> int:
        return sum(getattr(p, name) for p in self.partitions)

    def bytes(self, dtype: str) -> int:
        return sum(p.sample_bytes[dtype] for p in self.partitions)

    def disk(self, dtype: str) -> int:
        return sum(p.disk_bytes[dtype] for p in self.partitions)

    def stage(self, name: str) -> StagePlan:
        return next(s for s in self.stages if s.stage == name)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["prompts"] = {"samples": self.prompts.samples, "source": self.prompts.source,
                          "dataset": self.prompts.dataset, "rows_read": self.prompts.rows_read,
                          "rejected": self.prompts.rejected, "duplicates": self.prompts.duplicates}  # fmt: skip
        out["totals"] = {
            "samples": self.total("samples"),
            "failed": self.total("failed"),
            "prompt_tokens": self.total("prompt_tokens"),
            "completion_tokens": self.total("completion_tokens"),
            "sequence_tokens": self.total("sequence_tokens"),
            "sample_bytes": {d: self.bytes(d) for d in inputs.PLANNED_DTYPES},
            "disk_bytes": {d: self.disk(d) for d in inputs.PLANNED_DTYPES},
            "seconds": sum(s.seconds or 0.0 for s in self.stages),
        }
        out["held_out"] = self.held_out
        return out


def build_plan(
    model: inputs.ModelShape,
    prompts: inputs.Prompts,
    completion: inputs.Completion,
    *,
    partition_size: int,
    max_tokens: int,
    max_seq_len: int,
    epochs: int,
    dtype: str = "bfloat16",
    max_model_len: int | None = None,
    generation: inputs.Rate = inputs.NO_RATE,
    extraction: inputs.Rate = inputs.NO_RATE,
    training: inputs.Rate = inputs.NO_RATE,
    free: int | None = None,
    free_source: str = "",
) -> Plan:
    """The plan of a run (see the module's docstring for every formula)."""
    if partition_size <= 0 or max_tokens <= 0 or max_seq_len <= 1 or epochs <= 0:
        raise inputs.PlanError("partition size, max tokens, epochs must be positive and max_seq_len above 1")
    if dtype not in STORAGE_DTYPES:
        raise inputs.PlanError(f"dtype={dtype!r}: must be one of {sorted(STORAGE_DTYPES)}")
    if not prompts.samples:
        raise inputs.PlanError("the dataset has no prompt to plan")
    dtypes = tuple(dict.fromkeys((dtype, *inputs.PLANNED_DTYPES)))
    mean_completion = min(completion.mean_tokens, float(max_tokens))
    partitions = []
    for index, start in enumerate(range(0, prompts.samples, partition_size)):
        lengths = prompts.tokens[start : start + partition_size]
        failed = cut = prompt_sum = completion_sum = sequence_sum = 0
        sample_bytes = dict.fromkeys(dtypes, 0)
        sequences = array("q")
        for prompt in lengths:
            if max_model_len is not None and prompt >= max_model_len:
                failed += 1
                continue
            room = max_tokens if max_model_len is None else min(max_tokens, max_model_len - prompt)
            answer = min(mean_completion, float(room))
            sequence = round(prompt + answer)
            if sequence > max_seq_len:
                sequence, cut = max_seq_len, cut + 1
            prompt_sum += prompt
            completion_sum += answer
            sequence_sum += sequence
            sequences.append(sequence)
        for sequence in sequences:
            for d in dtypes:
                sample_bytes[d] += inputs.sample_file_bytes(sequence, model.n_states, model.hidden_size, d)
        ok = len(sequences)
        disk = {d: estimate_bytes(sequence_sum, ok, model.n_states, model.hidden_size, d) for d in dtypes}
        partitions.append(
            PartitionPlan(
                partition_key(index),
                len(lengths),
                failed,
                cut,
                prompt_sum,
                round(completion_sum),
                sequence_sum,
                sample_bytes,
                disk,
            )
        )
    train = partitions[:-1] if len(partitions) > 1 else partitions
    train_tokens = sum(p.sequence_tokens for p in train) * epochs
    output_tokens = sum(p.completion_tokens for p in partitions)
    stored_tokens = sum(p.sequence_tokens for p in partitions)
    stages = [
        StagePlan("generation", output_tokens, generation, generation.seconds(output_tokens)),
        StagePlan("hidden_states", stored_tokens, extraction, extraction.seconds(stored_tokens)),
        StagePlan("draft_model", train_tokens, training, training.seconds(train_tokens)),
    ]
    plan = Plan(
        model, prompts, completion, partition_size, max_tokens, max_seq_len, max_model_len, dtype, epochs,
        partitions, stages, free, free_source, "", [],
    )  # fmt: skip
    plan.advice = _advice(plan)
    plan.notes = _notes(plan)
    return plan


def _advice(plan: Plan) -> str:
    if plan.free_bytes is None:
        return "free disk unknown: give the data directory or state the free bytes"
    fits = {d: plan.disk(d) * DISK_HEADROOM <= plan.free_bytes for d in (plan.dtype, *inputs.PLANNED_DTYPES)}
    if fits[plan.dtype]:
        return f"store {plan.dtype}: the states fit the free disk"
    if fits[FP8]:
        return (
            f"store FP8 (hidden_states run config dtype: {FP8}): {plan.dtype} does not fit the free disk, FP8 does "
            "(no measured acceptance cost, docs/scaling.md)"
        )
    extraction = plan.stage("hidden_states")
    cost = (
        f"; every epoch extracts again: {plan.epochs} x {extraction.seconds:,.0f} s of extraction"
        if extraction.seconds
        else "; every epoch extracts again"
    )
    return (
        "train online (hidden_states store_budget_gib: 0, draft_model hidden_states_source: online): not even FP8 "
        f"fits the free disk{cost}"
    )


def _notes(plan: Plan) -> list[str]:
    notes = []
    if plan.completion.upper_bound:
        notes.append(
            f"completion tokens are max_tokens ({plan.max_tokens:,}), an upper bound: give a previous run's responses "
            "or a measurement for a mean"
        )
    failed = plan.total("failed")
    if failed:
        notes.append(
            f"{failed} prompt(s) of {plan.max_model_len:,} tokens or more: the server refuses them (HTTP 400), they "
            "get no hidden states"
        )
    cut = plan.total("cut")
    if cut:
        notes.append(f"~{cut:,} sample(s) longer than max_seq_len {plan.max_seq_len:,}: cut there for hidden states")
    return notes


def free_at(data_dir: str | Path) -> tuple[int, str]:
    """Free bytes of the filesystem that holds (or will hold) ``data_dir``."""
    return free_bytes(Path(data_dir)), f"measured at {data_dir}"
