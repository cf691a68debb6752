"""The GPU check's report: its rows and results, the 2-core CPU figures of the same recipe it is set against, and
the table it prints (``gpu_check_real.py`` runs the stages)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from eagle3_assets.core.verifier import SPECULATIVE_TOKENS

K = SPECULATIVE_TOKENS  # the k the CPU figures were measured at
# The 2-core CPU figures of the same recipe (bfloat16 on the CPU, 2 torch threads, vLLM CPU), from
# docs/real_model.md "The recipe, measured" (the benchmark's lines: training and evaluation in
# docs/measurements/learning_curve_2000x4_b91113d.jsonl; generation and hidden states from the run of
# docs/measurements/learning_curve_2000x3_36a257c.jsonl, which the 4-epoch run reused)
CPU_SOURCE = "docs/real_model.md 'The recipe, measured' (docs/measurements/learning_curve_2000x4_b91113d.jsonl)"
CPU_RECIPE: dict[str, tuple[float | None, float | None]] = {  # stage -> (seconds, tokens/s)
    "generate": (2544.0, 195.0),  # 2,364 answers, ~180-210 output tokens/s at concurrency 64
    "hidden states hf": (374.0, 2100.0),  # 788,389 tokens, bfloat16, two threads
    "vocab + train": (3145.1, 830.0),  # 1,456 steps, 2.62M tokens
    "offline acceptance": (77.0, None),
    "online": (1220.0, None),  # two measurements, two vLLM servers each
}
CPU_RESULTS = {"offline_humaneval": 1.837, "online_humaneval": 1.720, "speed_up": (1.18, 0.98, 1.37)}


@dataclass
class Row:
    stage: str
    seconds: float
    tokens: int | None = None
    peak_gpu_mib: float | None = None
    note: str = ""

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.tokens and self.seconds > 0 else None


@dataclass
class Report:
    mode: str
    device: str
    rows: list[Row] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _fmt(value: float | None, spec: str) -> str:
    if value is not None and math.isnan(value):
        return "n/a"  # offline acceptance without one greedy-consistent position (the dry path's fake answers)
    return "-" if value is None else format(value, spec)


def table(report: Report) -> str:
    lines = [
        f"GPU check on the real model ({report.mode}): {report.device}",
        "",
        "| stage | seconds | tokens | tokens/s | peak GPU MiB | 2-core CPU recipe: seconds | tokens/s | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report.rows:
        cpu_s, cpu_rate = CPU_RECIPE.get(row.stage, (None, None))
        lines.append(
            f"| {row.stage} | {row.seconds:.1f} | {_fmt(row.tokens, ',')} | {_fmt(row.tokens_per_s, ',.0f')} "
            f"| {_fmt(row.peak_gpu_mib, ',.0f')} | {_fmt(cpu_s, ',.0f')} | {_fmt(cpu_rate, ',.0f')} | {row.note} |"
        )
    total = sum(row.seconds for row in report.rows)
    lines.append(f"| total | {total:.1f} | | | | {sum(s for s, _ in CPU_RECIPE.values() if s):,.0f} | | |")
    results = report.results
    lines += ["", "| result | this run | 2-core CPU recipe |", "|---|---|---|"]
    lines.append(
        f"| HumanEval mean acceptance length, offline (k={K}) | {_fmt(results.get('offline_humaneval'), '.3f')} "
        f"| {CPU_RESULTS['offline_humaneval']:.3f} |"
    )
    if "online_humaneval" in results:
        mean, low, high = results["speed_up"]
        cpu_mean, cpu_low, cpu_high = CPU_RESULTS["speed_up"]
        lines.append(
            f"| HumanEval mean acceptance length, online in vLLM | {results['online_humaneval']:.3f} "
            f"| {CPU_RESULTS['online_humaneval']:.3f} |"
        )
        lines.append(
            f"| batch-1 speed-up (mean; lowest..highest of the repeats) | {mean:.2f} ({low:.2f}..{high:.2f}), "
            f"{results['greedy_mismatches']} greedy mismatches | {cpu_mean:.2f} ({cpu_low:.2f}..{cpu_high:.2f}) |"
        )
    for i, (median, low, high) in enumerate(results.get("speed_up_paired", [])):
        interval = f"[{low:.2f}, {high:.2f}]" if low is not None and high is not None else "(no interval)"
        lines.append(
            f"| batch-1 speed-up paired per prompt, repeat {i + 1} (median [95% interval], verdict) "
            f"| {median:.2f} {interval}, {results['speed_up_verdicts'][i]} | - |"
        )
    lines += ["", f"CPU figures: {CPU_SOURCE}; measured on 2 cores, not on this machine.", *report.notes]
    return "\n".join(lines)
