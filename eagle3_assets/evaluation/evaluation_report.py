"""Evaluation results: dataclasses, the report files (report.json + report.md) and the Markdown table.

Definitions follow vLLM's spec-decode metrics, so online and offline numbers mean the same thing:

* a *draft* is one proposal of k tokens made at one verification step;
* ``accepted`` of a draft is the length of the prefix of its k tokens that the verifier accepted (greedy: equal
  to the verifier's own next tokens);
* mean acceptance length = 1 + accepted / drafts (the verifier's bonus token plus the accepted ones), in [1, k+1];
* acceptance rate at position j = drafts whose first j+1 tokens were all accepted / drafts.

The batch-1 speed-up is measured paired (``online.py``): per prompt, one request to the plain verifier and one to
the draft's server, one at a time, alternating which goes first; a prompt's ratio is the draft's tokens/s over the
plain verifier's on it. The report gives the median ratio and its 95% percentile bootstrap interval
(:func:`speedup_interval`: prompts resampled with replacement, 2,000 times, a fixed seed, so the same pairs give the
same report), e.g. ``1.18 [1.05, 1.31]``, and a verdict (:func:`speedup_verdict`): the draft *pays* only where the
interval's lower bound is above 1.0, *does not pay* where its upper bound is below 1.0, and is *inconclusive*
otherwise (the interval holds 1.0, or fewer than 2 pairs give no interval).

Online, a request that got no reply (a timeout, a trickled or oversized body, an error) is *failed*: it counts in
no acceptance figure, and each row says how many of its requests failed. A prompt whose plain or draft speed request
failed is left out of the ratios, and the stricter rule holds: a speed-up with any failed speed request on either
side is withheld ("-" with the count, verdict ``withheld``), never shown as a number over the surviving pairs; a
side's tokens/s likewise (a batch's tokens/s over its wall time would hold a failed request's time, up to the
request timeout, and none of its tokens).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.core.storage import DataLayout, write_bytes_atomic, write_json_atomic
from eagle3_assets.evaluation.acceptance_counts import breakdown_line

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
# the verdict on a draft's batch-1 speed-up, from its 95% interval
PAYS, DOES_NOT_PAY, INCONCLUSIVE, WITHHELD = "pays", "does not pay", "inconclusive", "withheld"
BOOTSTRAP_RESAMPLES = 2000


def speedup_interval(
    ratios: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> tuple[float, float | None, float | None]:
    """(median, low, high): the median of the per-prompt speed-up ratios and the 95% percentile bootstrap interval
    of that median (the prompts resampled with replacement ``resamples`` times, a generator seeded with ``seed``: the
    same ratios give the same interval). Fewer than 2 ratios give no interval (low and high None); none is an error."""
    if not ratios:
        raise ValueError("no speed-up ratios: nothing to take a median of")
    return _interval(tuple(float(r) for r in ratios), resamples, seed)


@functools.lru_cache(maxsize=256)
def _interval(ratios: tuple[float, ...], resamples: int, seed: int) -> tuple[float, float | None, float | None]:
    # lazy: loads numpy (heavy), which only this path needs
    import numpy as np

    values = np.asarray(ratios, dtype=np.float64)
    median = float(np.median(values))
    if len(values) < 2:
        return median, None, None
    picks = np.random.default_rng(seed).integers(0, len(values), size=(resamples, len(values)))
    low, high = np.percentile(np.median(values[picks], axis=1), [2.5, 97.5])
    return median, float(low), float(high)


def speedup_verdict(interval: tuple[float, float | None, float | None]) -> str:
    """``pays`` only where the interval's lower bound is above 1.0; ``does not pay`` where its upper bound is below
    1.0; ``inconclusive`` where it holds 1.0 or there is no interval."""
    _median, low, high = interval
    if low is None or high is None:
        return INCONCLUSIVE
    return PAYS if low > 1.0 else DOES_NOT_PAY if high < 1.0 else INCONCLUSIVE


def pair_record(
    sample_id: str, first: str, plain: tuple[int, float] | None, draft: tuple[int, float] | None
) -> dict[str, Any]:
    """One prompt of a paired speed batch: which side went first, each side's (tokens, seconds), None where its
    request failed."""
    return {
        "sample_id": sample_id,
        "first": first,
        "plain_tokens": plain[0] if plain else None,
        "plain_seconds": plain[1] if plain else None,
        "draft_tokens": draft[0] if draft else None,
        "draft_seconds": draft[1] if draft else None,
    }


def pair_ratio(pair: dict[str, Any]) -> float | None:
    """The draft's tokens/s over the plain verifier's on one prompt; None where either request failed (or the plain
    reply had no token or no time: no rate to divide by)."""
    plain_s, draft_s, plain_tokens = pair.get("plain_seconds"), pair.get("draft_seconds"), pair.get("plain_tokens")
    if plain_s is None or draft_s is None or not plain_tokens or plain_s <= 0 or draft_s <= 0:
        return None
    return (pair["draft_tokens"] / draft_s) / (plain_tokens / plain_s)


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
    # the named prompt set (prompt_sets.py); offline figures are simulated on the held-out partition's samples
    prompt_set: str = "held-out"
    extra: dict[str, Any] = field(default_factory=dict)
    # online only: requests with no reply, in no figure above (both batches); of those, the speed batch's: any
    # there and this row has no tokens/s (``seconds`` None) and no speed-up
    failed: int = 0
    speed_failed: int = 0
    # online, the paired speed batch: per prompt, :func:`pair_record` (each side's tokens and seconds)
    speed_pairs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def speed_ratios(self) -> list[float]:
        """Per-prompt speed-ups of the pairs whose both requests were answered."""
        return [r for r in map(pair_ratio, self.speed_pairs) if r is not None]

    @property
    def plain_speed_failed(self) -> int:
        """The plain verifier's failed requests in this draft's pairs."""
        return sum(1 for p in self.speed_pairs if p.get("plain_seconds") is None)

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
        if self.speed_failed or self.output_tokens is None or not self.seconds:
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
    """What one online comparison on one prompt set measured beside the acceptance figures."""

    prompts: int  # the acceptance batch: every prompt of the set
    max_tokens: int
    baseline_output_tokens: int  # plain verifier, the speed batch
    baseline_seconds: float
    mismatches: dict[str, list[str]] = field(default_factory=dict)  # label -> sample ids whose greedy output differed
    server_startup_s: dict[str, float] = field(default_factory=dict)
    prompt_set: str = "held-out"
    concurrency: int = 1  # of the acceptance batch
    speed_prompts: int = 0  # the speed batch: the set's first prompts, one at a time
    # the plain verifier's requests with no reply (both batches); of those, the speed batch's: any there and the
    # baseline has no tokens/s, so no draft on this set has a speed-up
    failed: int = 0
    speed_failed: int = 0

    @property
    def baseline_tokens_per_second(self) -> float:
        if self.speed_failed or not self.baseline_seconds:
            return float("nan")
        return self.baseline_output_tokens / self.baseline_seconds


@dataclass
class EvaluationReport:
    draft_dir: str
    verifier: str
    k: int
    held_out_partition: str | None
    stats: list[AcceptanceStats]
    online: OnlineRun | list[OnlineRun] | None = None  # one run per prompt set (a single run: held-out)
    tolerance: float = 0.25  # |online - offline| mean acceptance length the report calls "agree"
    notes: list[str] = field(default_factory=list)

    @property
    def online_runs(self) -> list[OnlineRun]:
        if self.online is None:
            return []
        return [self.online] if isinstance(self.online, OnlineRun) else list(self.online)

    def run(self, prompt_set: str) -> OnlineRun | None:
        return next((r for r in self.online_runs if r.prompt_set == prompt_set), None)

    def prompt_sets(self) -> list[str]:
        """Every prompt set measured, in the order they were measured."""
        seen = [r.prompt_set for r in self.online_runs]
        for s in self.stats:
            if s.prompt_set not in seen:
                seen.append(s.prompt_set)
        return seen

    def get(self, label: str, method: str, prompt_set: str | None = None) -> AcceptanceStats | None:
        """The stats of this draft and method on ``prompt_set`` (None: the first measured, held-out first)."""
        for s in self.stats:
            if s.label == label and s.method == method and prompt_set in (None, s.prompt_set):
                return s
        return None

    def speedup_interval(
        self, label: str, prompt_set: str | None = None
    ) -> tuple[float, float | None, float | None] | None:
        """(median, low, high) of this draft's per-prompt batch-1 speed-ups (:func:`speedup_interval`); stats without
        pairs (figures not measured paired): the tok/s ratio, no interval. None where not measured, or withheld
        (:meth:`speed_failed`)."""
        s = self.get(label, "online", prompt_set)
        run = self.run(s.prompt_set) if s is not None else None
        if s is None or self.speed_failed(label, prompt_set):
            return None
        if s.speed_pairs:
            ratios = s.speed_ratios
            return speedup_interval(ratios) if ratios else None
        if run is None or s.tokens_per_second is None:
            return None
        base = run.baseline_tokens_per_second
        return (s.tokens_per_second / base, None, None) if base and base == base else None

    def speedup(self, label: str, prompt_set: str | None = None) -> float | None:
        """The median batch-1 speed-up of :meth:`speedup_interval`; None where not measured or withheld."""
        interval = self.speedup_interval(label, prompt_set)
        return interval[0] if interval is not None else None

    def verdict(self, label: str, prompt_set: str | None = None) -> str | None:
        """``pays`` / ``does not pay`` / ``inconclusive`` (:func:`speedup_verdict`), ``withheld`` where a speed request
        failed; None where no speed-up was measured."""
        if self.speed_failed(label, prompt_set):
            return WITHHELD
        interval = self.speedup_interval(label, prompt_set)
        return speedup_verdict(interval) if interval is not None else None

    def speed_failed(self, label: str, prompt_set: str | None = None) -> int:
        """Failed speed requests behind this draft's speed-up, its own and the plain verifier's (in this draft's pairs
        where it was measured paired): above 0, the speed-up is withheld."""
        s = self.get(label, "online", prompt_set)
        if s is None:
            return 0
        if s.speed_pairs:
            return s.speed_failed + s.plain_speed_failed
        run = self.run(s.prompt_set)
        return s.speed_failed + (run.speed_failed if run is not None else 0)

    def agreement(self, label: str) -> float | None:
        """online - offline mean acceptance length for this draft on the held-out set (None unless both measured)."""
        off = self.get(label, "offline")
        on = self.get(label, "online", off.prompt_set) if off is not None else None
        if on is None or off is None:
            return None
        return on.mean_acceptance_length - off.mean_acceptance_length

    def summary(self) -> dict[str, dict[str, dict[str, Any]]]:
        """prompt set -> "draft (method)" -> mean acceptance length, acceptance per position, speed-up."""
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for s in self.stats:
            out.setdefault(s.prompt_set, {})[f"{s.label} ({s.method})"] = {
                "mean_acceptance_length": _finite(s.mean_acceptance_length),
                "acceptance_rate_per_position": [_finite(x) for x in s.acceptance_rate_per_position],
                "drafts": s.drafts,
                "failed": s.failed,
                "speedup": self.speedup(s.label, s.prompt_set) if s.method == "online" else None,
                "speedup_interval": self._bounds(s) if s.method == "online" else None,
                "speedup_verdict": self.verdict(s.label, s.prompt_set) if s.method == "online" else None,
            }
        return out

    def to_dict(self) -> dict[str, Any]:
        online = None
        if self.online_runs:
            online = {}
            for run in self.online_runs:
                online[run.prompt_set] = asdict(run)
                online[run.prompt_set]["baseline_tokens_per_second"] = _finite(run.baseline_tokens_per_second)
        return {
            "draft_dir": self.draft_dir,
            "verifier": self.verifier,
            "k": self.k,
            "held_out_partition": self.held_out_partition,
            "summary": self.summary(),
            "stats": [s.to_dict() for s in self.stats],
            "online": online,
            "speedup": {
                run.prompt_set: {label: self.speedup(label, run.prompt_set) for label in self.labels()}
                for run in self.online_runs
            },
            # the 95% bootstrap interval of each median speed-up ([low, high]; None: none) and its verdict
            "speedup_interval": {
                run.prompt_set: {
                    label: self._bounds(self.get(label, "online", run.prompt_set)) for label in self.labels()
                }
                for run in self.online_runs
            },
            "speedup_verdict": {
                run.prompt_set: {label: self.verdict(label, run.prompt_set) for label in self.labels()}
                for run in self.online_runs
            },
            "online_minus_offline": {label: self.agreement(label) for label in self.labels()},
            "tolerance": self.tolerance,
            "notes": self.notes,
        }

    def _bounds(self, s: AcceptanceStats | None) -> list[float] | None:
        """[low, high] of this draft's speed-up interval; None without one."""
        interval = self.speedup_interval(s.label, s.prompt_set) if s is not None else None
        if interval is None or interval[1] is None or interval[2] is None:
            return None
        return [interval[1], interval[2]]

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


def _withheld(speed_failed: int) -> str:
    """A tok/s or speed-up cell not computed because speed requests failed: never a bare number, never a bare -."""
    return f"- ({speed_failed} speed request{'s' if speed_failed != 1 else ''} failed)"


def _speed_text(interval: tuple[float, float | None, float | None]) -> str:
    """``1.18 [1.05, 1.31]``: the median speed-up and its 95% interval (the median alone without one)."""
    median, low, high = interval
    return f"{median:.2f}" if low is None or high is None else f"{median:.2f} [{low:.2f}, {high:.2f}]"


def _plain_row(run: OnlineRun, k: int) -> list[str]:
    tps = run.baseline_tokens_per_second
    if run.speed_failed:
        tps_cell = speed = _withheld(run.speed_failed)
    else:
        tps_cell, speed = _fmt(tps, 1), "1.00" if tps == tps else "-"  # NaN: no speed batch
    cells = [run.prompt_set, "none (plain verifier)", "online", "-", "1.000", *["-"] * k]
    return [*cells, tps_cell, speed, "-", str(run.failed)]


def _stats_row(report: EvaluationReport, s: AcceptanceStats) -> list[str]:
    k = report.k
    rates = s.acceptance_rate_per_position + [float("nan")] * (k - len(s.accepted_per_position))
    online = s.method == "online"
    interval = report.speedup_interval(s.label, s.prompt_set) if online else None
    tps_cell = (_withheld(s.speed_failed) if s.speed_failed else _fmt(s.tokens_per_second, 1)) if online else "-"
    speed_failed = report.speed_failed(s.label, s.prompt_set) if online else 0
    speed_cell = _withheld(speed_failed) if speed_failed else _speed_text(interval) if interval is not None else "-"
    verdict = (report.verdict(s.label, s.prompt_set) if online else None) or "-"
    return [
        s.prompt_set,
        s.label,
        s.method,
        str(s.drafts),
        _fmt(s.mean_acceptance_length),
        *[_fmt(r) for r in rates[:k]],
        tps_cell,
        speed_cell,
        verdict,
        str(s.failed) if online else "-",
    ]


def _verdict_line(report: EvaluationReport, s: AcceptanceStats) -> str:
    """The verdict on one draft's speed-up on one prompt set, and why."""
    interval = report.speedup_interval(s.label, s.prompt_set)
    assert interval is not None
    verdict = speedup_verdict(interval)
    pairs = len(s.speed_ratios)
    why = {
        PAYS: "the 95% interval's lower bound is above 1.0",
        DOES_NOT_PAY: "the 95% interval's upper bound is below 1.0",
        INCONCLUSIVE: "the 95% interval holds 1.0",
    }[verdict]
    if interval[1] is None:
        why = "no interval: fewer than 2 prompt pairs" if s.speed_pairs else "no interval: not measured paired"
    over = f" over {pairs} prompt pair{'' if pairs == 1 else 's'}" if s.speed_pairs else ""
    return f"- {s.prompt_set}: the {s.label} draft's batch-1 speed-up {_speed_text(interval)}{over}: {verdict} ({why})"


def render_markdown(report: EvaluationReport) -> str:
    """One table, grouped by prompt set (the plain verifier's row first), then the notes."""
    k = report.k
    head = ["prompt set", "draft", "method", "drafts", "mean acc. len", *[f"acc@{j + 1}" for j in range(k)]]
    head += ["tok/s", "speed-up", "verdict", "failed requests"]
    lines = [
        f"### Draft evaluation (k={k})",
        "",
        f"draft `{report.draft_dir}`, verifier `{report.verifier}`, held-out partition "
        f"`{report.held_out_partition or '-'}`",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    for prompt_set in report.prompt_sets():
        run = report.run(prompt_set)
        if run is not None:
            lines.append("| " + " | ".join(_plain_row(run, k)) + " |")
        for s in report.stats:
            if s.prompt_set == prompt_set:
                lines.append("| " + " | ".join(_stats_row(report, s)) + " |")
    lines.append("")
    for label in report.labels():
        diff = report.agreement(label)
        if diff is not None:
            verdict = "agree" if abs(diff) <= report.tolerance else "DISAGREE"
            lines.append(
                f"- {label}: online - offline mean acceptance length = {diff:+.3f} "
                f"({verdict} within the stated tolerance {report.tolerance})"
            )
    for o in report.online_runs:
        online = [s for s in report.stats if s.method == "online" and s.prompt_set == o.prompt_set]
        speed = f"tok/s at batch 1 on its first {o.speed_prompts}" if o.speed_prompts else "no tok/s measured"
        if o.speed_prompts and any(s.speed_pairs for s in online):
            speed = (
                f"batch-1 speed paired on its first {o.speed_prompts} prompts (each to the plain verifier and to the "
                "draft, one request at a time, alternating which goes first), speed-up the median per-prompt tok/s "
                f"ratio with its 95% bootstrap interval ({BOOTSTRAP_RESAMPLES:,} resamples)"
            )
        lines.append(
            f"- online {o.prompt_set}: acceptance over {o.prompts} prompts ({o.concurrency} at a time), {speed}; "
            f"temperature 0, max_tokens {o.max_tokens}"
        )
        lines += [
            _verdict_line(report, s) for s in online if report.verdict(s.label, s.prompt_set) not in (None, WITHHELD)
        ]
        beyond = (breakdown_line(o.prompt_set, s.label, s.mean_acceptance_length, s.extra) for s in online)
        lines += [line for line in beyond if line]
        for label, bad in o.mismatches.items():
            what = "identical" if not bad else f"{len(bad)} DIFFERENT ({', '.join(bad[:5])})"
            lines.append(f"- {o.prompt_set}: greedy outputs with the {label} draft vs without: {what}")
        sides = [(o.failed, o.speed_failed, "the plain verifier")]
        sides += [
            (s.failed, s.speed_failed, f"the {s.label} draft")
            for s in report.stats
            if s.method == "online" and s.prompt_set == o.prompt_set
        ]
        for failed, speed_failed, side in sides:
            if not failed:
                continue
            withheld = ""
            if speed_failed:
                withheld = f"; {speed_failed} in its speed batch: its tok/s and the speed-ups over it withheld"
            lines.append(
                f"- {o.prompt_set}: {failed} requests to {side} FAILED (no reply: a timeout, a trickled or "
                f"oversized body, an error), counted in no acceptance figure or mismatch{withheld}"
            )
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
