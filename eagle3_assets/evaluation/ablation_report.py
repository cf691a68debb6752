"""The regeneration ablation's report: one row per trained draft (variant and seed), as Markdown and JSON."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.core import storage

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
# the acceptance columns: (method, prompt set)
ACCEPTANCE = (("offline", "held-out"), ("offline", "humaneval"), ("online", "held-out"), ("online", "humaneval"))


@dataclass
class DraftRow:
    """One trained draft: the variant's data, its cost, and its mean acceptance lengths."""

    variant: str
    seed: int
    conversations: int  # conversations with an ok row (the others failed to generate and are not trained on)
    train_tokens_available: int  # tokens of the variant's training partitions
    loss_tokens_available: int  # of which assistant (loss-masked) tokens
    model_tokens: int  # loss tokens the served model wrote (0 for the dataset variant)
    token_budget: int
    tokens_trained: int  # packed tokens the optimizer saw
    steps: int
    epochs: int
    generation_tokens: int  # completion tokens the server generated for this variant (0: the dataset's answers)
    generation_seconds: float
    extraction_seconds: float
    training_seconds: float
    acceptance: dict[str, float | None] = field(default_factory=dict)  # "offline/held-out" -> mean acceptance length
    draft_dir: str = ""

    def key(self) -> str:
        return f"{self.variant}/seed{self.seed}"


@dataclass
class AblationReport:
    conversations: int
    held_out_prompts: int
    humaneval_prompts: int
    token_budget: int
    tokens_per_batch: int
    k: int
    verifier: str
    rows: list[DraftRow]
    notes: list[str] = field(default_factory=list)

    def spread(self) -> dict[str, float]:
        """Per acceptance column, the max - min over the seeds of the variant trained with several (else absent)."""
        by_variant: dict[str, list[DraftRow]] = {}
        for row in self.rows:
            by_variant.setdefault(row.variant, []).append(row)
        out: dict[str, float] = {}
        for variant, rows in by_variant.items():
            if len(rows) < 2:
                continue
            for column in _columns():
                values = [r.acceptance.get(column) for r in rows]
                finite = [v for v in values if v is not None and math.isfinite(v)]
                if len(finite) >= 2:
                    out[f"{variant} {column}"] = round(max(finite) - min(finite), 4)
        return out

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["seed_spread"] = self.spread()
        return data

    def markdown(self) -> str:
        head = ["variant", "seed", "conversations", "training tokens (budget)", "loss tokens avail.", "model's own",
                "generated tokens", "generation s", "extraction s", "training s",
                *(f"{m} {s}" for m, s in ACCEPTANCE)]  # fmt: skip
        lines = [
            f"Regeneration ablation: {self.conversations} conversations, the same training token budget "
            f"({self.token_budget:,} tokens, {self.tokens_per_batch:,} per step), k={self.k}; mean acceptance length "
            f"on {self.held_out_prompts} held-out prompts and {self.humaneval_prompts} HumanEval problems.",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        for r in self.rows:
            cells = [r.variant, str(r.seed), str(r.conversations), f"{r.tokens_trained:,} ({r.token_budget:,})",
                     f"{r.loss_tokens_available:,}", f"{r.model_tokens:,}", f"{r.generation_tokens:,}",
                     f"{r.generation_seconds:.0f}", f"{r.extraction_seconds:.0f}", f"{r.training_seconds:.0f}",
                     *(_fmt(r.acceptance.get(c)) for c in _columns())]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        spread = self.spread()
        if spread:
            lines += ["", "Seed-to-seed spread (max - min): " + ", ".join(f"{k} {v:.3f}" for k, v in spread.items())]
        lines += [f"- {note}" for note in self.notes]
        return "\n".join(lines) + "\n"


def _columns() -> list[str]:
    return [f"{method}/{prompt_set}" for method, prompt_set in ACCEPTANCE]


def _fmt(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.3f}"


def write_ablation_report(report: AblationReport, folder: Path) -> tuple[Path, Path]:
    json_path, md_path = folder / REPORT_JSON, folder / REPORT_MD
    storage.write_json_atomic(report.to_dict(), json_path)
    storage.write_bytes_atomic(report.markdown().encode(), md_path)
    return json_path, md_path
