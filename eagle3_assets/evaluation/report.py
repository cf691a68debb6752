"""Evaluation results: dataclasses, the report files (report.json + report.md) and the Markdown table.

Definitions follow vLLM's spec-decode metrics, so online and offline numbers mean the same thing:

* a *draft* is one proposal of k tokens made at one verification step;
* ``accepted`` of a draft is the length of the prefix of its k tokens that the verifier accepted (greedy: equal
  to the verifier's own next tokens);
* mean acceptance length = 1 + accepted / drafts (the verifier's bonus token plus the accepted ones), in [1, k+1];
* acceptance rate at position j = drafts whose first j+1 tokens were all accepted / drafts.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.storage import DataLayout, write_bytes_atomic, write_json_atomic

REPORT_JSON = "report.json"
REPORT_MD = "report.md"


@dataclass
class AcceptanceStats:
    """Acceptance of one draft measured one way (online in vLLM, or offline from hidden states)."""

    label: str  # "trained" / "untrained"
    method: str  # "online" / "offline"
    k: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]
    # online only: throughput of the same prompts with this draft, and the plain server's in the same run
    output_tokens: int | None = None
    seconds: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else float("nan")

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [n / self.drafts if self.drafts else float("nan") for n in self.accepted_per_position]

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else float("nan")

    @property
    def tokens_per_second(self) -> float | None:
        if self.output_tokens is None or not self.seconds:
            return None
        return self.output_tokens / self.seconds

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["mean_acceptance_length"] = _finite(self.mean_acceptance_length)
        out["acceptance_rate_per_position"] = [_finite(x) for x in self.acceptance_rate_per_position]
        out["draft_acceptance_rate"] = _finite(self.draft_acceptance_rate)
        out["tokens_per_second"] = self.tokens_per_second
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AcceptanceStats:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class OnlineRun:
    """What one online comparison measured beside the acceptance figures."""

    prompts: int
    max_tokens: int
    baseline_output_tokens: int  # plain verifier, same prompts
    baseline_seconds: float
    mismatches: dict[str, list[str]] = field(default_factory=dict)  # label -> sample ids whose greedy output differed
    server_startup_s: dict[str, float] = field(default_factory=dict)

    @property
    def baseline_tokens_per_second(self) -> float:
        return self.baseline_output_tokens / self.baseline_seconds if self.baseline_seconds else float("nan")


@dataclass
class EvaluationReport:
    draft_dir: str
    verifier: str
    k: int
    held_out_partition: str | None
    stats: list[AcceptanceStats]
    online: OnlineRun | None = None
    tolerance: float = 0.25  # |online - offline| mean acceptance length the report calls "agree"
    notes: list[str] = field(default_factory=list)

    def get(self, label: str, method: str) -> AcceptanceStats | None:
        for s in self.stats:
            if s.label == label and s.method == method:
                return s
        return None

    def speedup(self, label: str) -> float | None:
        """Output tokens/s with this draft over the plain verifier's, same prompts, same run."""
        s = self.get(label, "online")
        if s is None or self.online is None or s.tokens_per_second is None:
            return None
        base = self.online.baseline_tokens_per_second
        return s.tokens_per_second / base if base else None

    def agreement(self, label: str) -> float | None:
        """online - offline mean acceptance length for this draft (None unless both were measured)."""
        on, off = self.get(label, "online"), self.get(label, "offline")
        if on is None or off is None:
            return None
        return on.mean_acceptance_length - off.mean_acceptance_length

    def to_dict(self) -> dict[str, Any]:
        online = None
        if self.online is not None:
            online = asdict(self.online)
            online["baseline_tokens_per_second"] = _finite(self.online.baseline_tokens_per_second)
        return {
            "draft_dir": self.draft_dir,
            "verifier": self.verifier,
            "k": self.k,
            "held_out_partition": self.held_out_partition,
            "stats": [s.to_dict() for s in self.stats],
            "online": online,
            "speedup": {label: self.speedup(label) for label in self.labels()},
            "online_minus_offline": {label: self.agreement(label) for label in self.labels()},
            "tolerance": self.tolerance,
            "notes": self.notes,
        }

    def labels(self) -> list[str]:
        seen: list[str] = []
        for s in self.stats:
            if s.label not in seen:
                seen.append(s.label)
        return seen

    def markdown(self) -> str:
        return render_markdown(self)


def _finite(x: float) -> float | None:
    return x if x == x and x not in (float("inf"), float("-inf")) else None  # JSON has no NaN


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


def render_markdown(report: EvaluationReport) -> str:
    k = report.k
    head = ["draft", "method", "drafts", "mean acc. len", *[f"acc@{j + 1}" for j in range(k)], "tok/s", "speed-up"]
    lines = [
        f"### Draft evaluation (k={k})",
        "",
        f"draft `{report.draft_dir}`, verifier `{report.verifier}`, held-out partition "
        f"`{report.held_out_partition or '-'}`",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    if report.online is not None:
        base = [
            "none (plain verifier)",
            "online",
            "-",
            "1.000",
            *["-"] * k,
            _fmt(report.online.baseline_tokens_per_second, 1),
            "1.00",
        ]
        lines.append("| " + " | ".join(base) + " |")
    for s in report.stats:
        rates = s.acceptance_rate_per_position + [float("nan")] * (k - len(s.accepted_per_position))
        speed = report.speedup(s.label) if s.method == "online" else None
        row = [
            s.label,
            s.method,
            str(s.drafts),
            _fmt(s.mean_acceptance_length),
            *[_fmt(r) for r in rates[:k]],
            _fmt(s.tokens_per_second, 1) if s.method == "online" else "-",
            _fmt(speed, 2) if speed is not None else "-",
        ]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for label in report.labels():
        diff = report.agreement(label)
        if diff is not None:
            verdict = "agree" if abs(diff) <= report.tolerance else "DISAGREE"
            lines.append(
                f"- {label}: online - offline mean acceptance length = {diff:+.3f} "
                f"({verdict} within the stated tolerance {report.tolerance})"
            )
    if report.online is not None:
        o = report.online
        lines.append(f"- online: {o.prompts} held-out prompts, temperature 0, max_tokens {o.max_tokens}")
        for label, bad in o.mismatches.items():
            what = "identical" if not bad else f"{len(bad)} DIFFERENT ({', '.join(bad[:5])})"
            lines.append(f"- greedy outputs with the {label} draft vs without: {what}")
    for note in report.notes:
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


def write_report(report: EvaluationReport, layout_or_dir: DataLayout | Path) -> tuple[Path, Path]:
    """report.json and report.md under ``layout.evaluation_dir`` (or a given folder), each written atomically."""
    out = layout_or_dir.evaluation_dir if isinstance(layout_or_dir, DataLayout) else Path(layout_or_dir)
    json_path, md_path = out / REPORT_JSON, out / REPORT_MD
    write_json_atomic(report.to_dict(), json_path)
    write_bytes_atomic(report.markdown().encode("utf-8"), md_path)
    return json_path, md_path


def read_report(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))
