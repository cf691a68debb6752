"""The plan as text, and beside a measured run's figures."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from eagle3_assets.hidden_states.storage_format import FP8
from eagle3_assets.planning.measured import MeasuredRun
from eagle3_assets.planning.plan import DISK_HEADROOM, Plan

# ------------------------------------------------------------------------------------------ comparison and text


@dataclass(frozen=True)
class Comparison:
    what: str
    planned: float
    measured: float
    source: str

    @property
    def ratio(self) -> float:
        return self.planned / self.measured if self.measured else math.inf


def compare(plan: Plan, run: MeasuredRun) -> list[Comparison]:
    """The plan's figures beside a measured run's (stage seconds and token counts it records)."""
    rows = []
    parts = run.partitions.values()

    def add(what: str, planned: float | None, measured: float | None) -> None:
        if planned is not None and measured is not None:
            rows.append(Comparison(what, planned, measured, run.name))

    known = [p for p in parts if p.prompt_tokens is not None]
    if known:
        add("samples", plan.total("samples"), sum(p.rows or 0 for p in known))
        add("failed (prompt over the server's context)", plan.total("failed"), sum(p.failed or 0 for p in known))
        add("prompt tokens (ok samples)", plan.total("prompt_tokens"), sum(p.prompt_tokens or 0 for p in known))
        add("completion tokens", plan.total("completion_tokens"), sum(p.completion_tokens or 0 for p in known))
        stored = sum((p.prompt_tokens or 0) + (p.completion_tokens or 0) for p in known)
        add("hidden-state tokens", plan.total("sequence_tokens"), stored)
    add("tokens trained", plan.stage("draft_model").tokens, run.tokens_trained)
    stored = plan.total("sequence_tokens")
    for dtype, measured_per_token in run.bytes_per_token.items():
        if stored and dtype in plan.partitions[0].sample_bytes:
            add(f"{dtype} bytes per stored token", plan.bytes(dtype) / stored, measured_per_token)
    for stage, measured_name in (
        ("generation", "synthetic_responses"),
        ("hidden_states", "hidden_states"),
        ("draft_model", "draft_model"),
    ):
        add(f"{stage} seconds", plan.stage(stage).seconds, run.stage_seconds.get(measured_name))
    return rows


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 86400:
        return f"{seconds:,.0f} s ({seconds / 86400:.1f} d)"
    if seconds >= 3600:
        return f"{seconds:,.0f} s ({seconds / 3600:.1f} h)"
    return f"{seconds:,.0f} s ({seconds / 60:.1f} min)" if seconds >= 60 else f"{seconds:,.1f} s"


def render(plan: Plan, comparisons: Sequence[Comparison] = (), max_partitions: int = 12) -> str:
    """The plan as the command prints it: inputs and their sources, partitions, stages, bytes and the advice."""
    m = plan.model
    lines = [
        f"model: hidden {m.hidden_size:,}, {m.num_layers} layers, vocab {m.vocab_size:,}; states stored per token: "
        f"{m.n_states} (layers {list(m.layer_ids)} + the last) [{m.source}]",
        f"samples: {plan.prompts.samples:,} in {len(plan.partitions):,} partition(s) of {plan.partition_size:,}"
        + (f", {plan.held_out} held out for validation" if plan.held_out else "")
        + (
            f" [{plan.prompts.dataset}: {plan.prompts.rows_read:,} rows read, {plan.prompts.rejected:,} rejected, "
            f"{plan.prompts.duplicates:,} duplicates]"
            if plan.prompts.dataset
            else " [stated]"
        ),
        f"prompt tokens: {plan.prompts.source}",
        f"completion tokens: {plan.completion.mean_tokens:,.1f} per ok sample (max_tokens {plan.max_tokens:,}) "
        f"[{plan.completion.source}]",
        f"hidden states: max_seq_len {plan.max_seq_len:,}, dtype {plan.dtype}"
        + (f"; server context {plan.max_model_len:,} tokens" if plan.max_model_len else ""),
        "",
    ]
    head = ("partition", "samples", "failed", "prompt tok", "completion tok", "stored tok", "bf16 bytes", "FP8 bytes")
    rows = [
        (p.key, f"{p.samples:,}", f"{p.failed:,}", f"{p.prompt_tokens:,}", f"{p.completion_tokens:,}",
         f"{p.sequence_tokens:,}", f"{p.sample_bytes['bfloat16']:,}", f"{p.sample_bytes[FP8]:,}")
        for p in plan.partitions
    ]  # fmt: skip
    if len(rows) > max_partitions:
        rows = [*rows[: max_partitions - 2], ("...",) + ("",) * 7, rows[-1]]
    rows.append(
        ("total", f"{plan.total('samples'):,}", f"{plan.total('failed'):,}", f"{plan.total('prompt_tokens'):,}",
         f"{plan.total('completion_tokens'):,}", f"{plan.total('sequence_tokens'):,}",
         f"{plan.bytes('bfloat16'):,}", f"{plan.bytes(FP8):,}")
    )  # fmt: skip
    lines += _table(head, rows)
    lines.append("")
    stage_rows = [
        (s.stage, f"{s.tokens:,}", f"{s.rate.tokens_per_s:,.1f}" if s.rate.tokens_per_s else "-",
         _duration(s.seconds), s.rate.source)
        for s in plan.stages
    ]  # fmt: skip
    total = sum(s.seconds or 0.0 for s in plan.stages)
    stage_rows.append(("total", "", "", _duration(total), "planned stages only (no evaluation, start-ups)"))
    lines += _table(("stage", "tokens", "tokens/s", "time", "rate from"), stage_rows)
    lines.append(f"  (draft_model: {plan.epochs} epoch(s) over every partition but the held-out one)")
    lines.append("")
    bf16, fp8 = plan.bytes("bfloat16"), plan.bytes(FP8)
    lines.append(
        f"hidden states on disk: bf16 {_size(bf16)} ({bf16 / max(1, plan.total('sequence_tokens')):,.1f} B/token), "
        f"FP8 {_size(fp8)} ({fp8 / max(1, plan.total('sequence_tokens')):,.1f} B/token); the extraction's own estimate "
        f"with its x{DISK_HEADROOM:g} headroom: {plan.dtype} {_size(plan.disk(plan.dtype) * DISK_HEADROOM)}"
    )
    free = f"{_size(plan.free_bytes)} free [{plan.free_source}]" if plan.free_bytes is not None else "free disk unknown"
    lines.append(f"disk: {free} -> {plan.advice}")
    lines += [f"note: {n}" for n in plan.notes]
    if comparisons:
        lines += ["", "planned vs measured (the plan predicts; each measured figure is the named file's):"]
        lines += _table(
            ("figure", "planned", "measured", "planned/measured", "measured in"),
            [(c.what, f"{c.planned:,.1f}" if c.planned % 1 else f"{c.planned:,.0f}",
              f"{c.measured:,.1f}" if c.measured % 1 else f"{c.measured:,.0f}", f"{c.ratio:.3f}", c.source)
             for c in comparisons],
        )  # fmt: skip
    return "\n".join(lines)


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    out = []
    for row in [head, *rows]:
        cells = [
            str(c).ljust(w) if i in (0, len(head) - 1) else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
    return out
