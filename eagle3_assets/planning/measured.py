"""Measured runs: an ``eagle3 demo`` output or a learning-curve JSONL, and the rates and lengths they give."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_assets.planning.inputs import Completion, PlanError, Rate

# ------------------------------------------------------------------------------------------ measured runs


@dataclass
class MeasuredPartition:
    generation_s: float | None = None
    hidden_states_s: float | None = None
    rows: int | None = None
    ok: int | None = None
    failed: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


@dataclass
class MeasuredRun:
    """What an ``eagle3 demo`` output (e.g. ``docs/measurements/demo_real_*.txt``) or a ``learning_curve.py``
    JSONL (``tokens_trained``, ``train_s``) says about a run."""

    name: str
    partitions: dict[str, MeasuredPartition] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    tokens_trained: int | None = None
    # hidden_states_at_scale.py's lines: dtype -> bytes of sample files per stored token, measured on disk
    bytes_per_token: dict[str, float] = field(default_factory=dict)
    train_seconds: float | None = None
    train_samples: int | None = None
    epochs: int | None = None

    def selected(self, keys: Sequence[str] | None) -> dict[str, MeasuredPartition]:
        if not keys:
            return self.partitions
        missing = [k for k in keys if k not in self.partitions]
        if missing:
            raise PlanError(f"{self.name} has no partition {', '.join(missing)} (it has {', '.join(self.partitions)})")
        return {k: self.partitions[k] for k in keys}


_STEP = re.compile(r"^(synthetic_responses|hidden_states) partition (\d+) \(\d+/\d+\): ok in ([\d.]+) s")
_STAGE = re.compile(r"^(\w[\w -]*?):? ok in ([\d.]+) s")
_TRAINED = re.compile(r"draft trained on (\d+) samples x (\d+) epochs: [\d,]+ steps, ([\d,]+) tokens")
_BYTES = re.compile(r"^(bfloat16|float32|float8_e4m3fn): (\{.*\})$")
_TIMING_ROW = re.compile(r"^([a-zA-Z_][\w -]*?)\s+(\d+|-)\s+([\d.]+)$")


def read_measured(path: str | Path) -> MeasuredRun:
    """Parse a measurement file: an ``eagle3 demo`` output or a learning-curve JSONL."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise PlanError(f"cannot read the measurement file {path}: {error}") from None
    run = MeasuredRun(path.name)
    if path.suffix == ".jsonl":
        for line in text.splitlines():
            record = json.loads(line) if line.strip().startswith("{") else {}
            if "tokens_trained" in record and "train_s" in record:
                run.tokens_trained, run.train_seconds = int(record["tokens_trained"]), float(record["train_s"])
                run.train_samples, run.epochs = record.get("samples"), record.get("epochs")
                return run
        raise PlanError(f"{path}: no line with tokens_trained and train_s")
    header: list[str] | None = None
    timing = False
    for line in text.splitlines():
        stripped = line.strip()
        if match := _STEP.match(stripped):
            part = run.partitions.setdefault(match[2], MeasuredPartition())
            setattr(part, "generation_s" if match[1] == "synthetic_responses" else "hidden_states_s", float(match[3]))
        elif stripped.startswith("partition ") and "completion_tokens" in stripped:
            header = stripped.split()
        elif header and (cells := stripped.split()) and len(cells) == len(header) and cells[0].isdigit():
            row = dict(zip(header, cells, strict=True))
            part = run.partitions.setdefault(cells[0], MeasuredPartition())
            part.rows = int(row.get("synthetic_responses", 0))
            part.ok, part.failed = int(row["ok"]), int(row["failed"])
            part.prompt_tokens, part.completion_tokens = int(row["prompt_tokens"]), int(row["completion_tokens"])
        elif (match := _BYTES.match(stripped)) and "bytes_per_token" in match[2]:
            run.bytes_per_token[match[1]] = float(json.loads(match[2])["bytes_per_token"])
        elif match := _TRAINED.search(stripped):
            run.train_samples, run.epochs = int(match[1]), int(match[2])
            run.tokens_trained = int(match[3].replace(",", ""))
        elif stripped.startswith("stage") and stripped.endswith("seconds"):
            timing = True
        elif timing and (match := _TIMING_ROW.match(stripped)):
            run.stage_seconds[match[1].strip()] = float(match[3])
        elif not timing and (match := _STAGE.match(stripped)) and match[1] == "draft_model":
            run.stage_seconds.setdefault("draft_model", float(match[2]))
    if "draft_model" in run.stage_seconds and run.tokens_trained:
        run.train_seconds = run.stage_seconds["draft_model"]
    if not run.partitions and run.tokens_trained is None and not run.bytes_per_token:
        raise PlanError(f"{path}: neither an `eagle3 demo` output nor a learning-curve JSONL")
    return run


def _where(run: MeasuredRun, keys: Sequence[str] | None) -> str:
    return f"measured: {run.name}" + (f" (partition{'s' if len(keys) > 1 else ''} {', '.join(keys)})" if keys else "")


def measured_rate(run: MeasuredRun, stage: str, keys: Sequence[str] | None = None) -> Rate:
    """Tokens/s of ``stage`` (``generation``: output tokens; ``extraction``: prompt + completion tokens of the ok
    rows; ``training``: tokens trained) in a measured run, over the partitions ``keys`` (default: all)."""
    if stage == "training":
        if not (run.tokens_trained and run.train_seconds):
            raise PlanError(f"{run.name} measures no training (tokens trained and seconds)")
        return Rate(run.tokens_trained / run.train_seconds, f"measured: {run.name}")
    attribute = {"generation": "generation_s", "extraction": "hidden_states_s"}[stage]
    tokens = seconds = 0.0
    for part in run.selected(keys).values():
        spent = getattr(part, attribute)
        if spent is None or part.completion_tokens is None or part.prompt_tokens is None:
            continue
        tokens += part.completion_tokens + (part.prompt_tokens if stage == "extraction" else 0)
        seconds += spent
    if not seconds:
        raise PlanError(f"{run.name} measures no {stage} (seconds and tokens per partition)")
    stage_name = {"generation": "synthetic_responses", "extraction": "hidden_states"}[stage]
    if not keys and stage_name in run.stage_seconds:
        # the whole stage's wall time: partitions that ran overlapped (generation, since commit f7d102c) each count
        # the time they shared the server, and their seconds summed would count it twice
        return Rate(tokens / run.stage_seconds[stage_name], f"{_where(run, keys)} (the whole stage)")
    return Rate(tokens / seconds, _where(run, keys))


def measured_completion(run: MeasuredRun, keys: Sequence[str] | None = None) -> Completion:
    """Mean completion tokens per ok sample of a measured run's partitions."""
    parts = [p for p in run.selected(keys).values() if p.completion_tokens is not None and p.ok]
    if not parts:
        raise PlanError(f"{run.name} has no completion token counts")
    mean = sum(p.completion_tokens or 0 for p in parts) / sum(p.ok or 0 for p in parts)
    return Completion(mean, _where(run, keys))


def responses_completion(folder: str | Path) -> Completion:
    """Mean ``completion_tokens`` of the ok rows of a previous run's ``synthetic_responses`` Parquet files (a data
    directory or the asset's folder); read lazily, two columns."""
    # lazy: loads polars (heavy), which only this path needs
    import polars as pl

    folder = Path(folder)
    if (folder / "synthetic_responses").is_dir():
        folder = folder / "synthetic_responses"
    files = sorted(folder.glob("*.parquet"))
    if not files:
        raise PlanError(f"no synthetic_responses Parquet files in {folder}")
    stats = (
        pl.scan_parquet(files)
        .filter(pl.col("status") == "ok")
        .select(pl.col("completion_tokens").mean().alias("mean"), pl.len().alias("n"))
        .collect()
    )
    mean, n = stats["mean"][0], stats["n"][0]
    if not n or mean is None:
        raise PlanError(f"{folder}: no ok response with completion_tokens")
    return Completion(float(mean), f"measured: {n:,} ok responses in {folder}")
