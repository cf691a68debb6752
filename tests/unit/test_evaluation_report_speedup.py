"""The evaluation report's speed-up: the median per-prompt ratio and its 95% interval in the table
(``1.18 [1.05, 1.31]``), the verdict (pays only where the lower bound is above 1.0) in the table, the notes and the
JSON, and the stricter rule for failed speed requests (withheld, never a number over the surviving pairs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from eagle3_assets.evaluation.evaluation_report import (
    DOES_NOT_PAY,
    INCONCLUSIVE,
    PAYS,
    WITHHELD,
    AcceptanceStats,
    EvaluationReport,
    OnlineRun,
    pair_record,
    speedup_interval,
    write_report,
)
from support.report_table import table_row

K = 3
SET = "humaneval"


def _pairs(ratios: list[float | None], plain_failed: frozenset[int] | set[int] = frozenset()) -> list[dict[str, Any]]:
    """Pairs of 100 tokens each side: the plain verifier 2 s, the draft 2 s / ratio (None: its request failed)."""
    out = []
    for i, r in enumerate(ratios):
        plain = None if i in plain_failed else (100, 2.0)
        draft = None if r is None else (100, 2.0 / r)
        out.append(pair_record(f"s{i}", "plain" if i % 2 == 0 else "draft", plain, draft))
    return out


def _stats(label: str, pairs: list[dict[str, Any]], speed_failed: int = 0) -> AcceptanceStats:
    answered = [p for p in pairs if p["draft_seconds"] is not None]
    return AcceptanceStats(
        label, "online", K, drafts=10, draft_tokens=30, accepted_tokens=10, accepted_per_position=[5, 3, 2],
        output_tokens=sum(p["draft_tokens"] for p in answered),
        seconds=None if speed_failed else sum(p["draft_seconds"] for p in answered),
        prompt_set=SET, failed=speed_failed, speed_failed=speed_failed, speed_pairs=pairs,
    )  # fmt: skip


def _report(*stats: AcceptanceStats, plain_failed: int = 0) -> EvaluationReport:
    pairs = stats[0].speed_pairs
    run = OnlineRun(
        prompts=164, max_tokens=128, baseline_output_tokens=100 * len(pairs), baseline_seconds=2.0 * len(pairs),
        prompt_set=SET, concurrency=64, speed_prompts=len(pairs), failed=plain_failed, speed_failed=plain_failed,
    )  # fmt: skip
    return EvaluationReport("d", "v", K, "00001", list(stats), online=[run])


def _row(markdown: str, label: str) -> list[str]:
    return table_row(markdown, SET, label)


def test_the_table_notes_and_json_give_the_interval_and_the_verdict(tmp_path: Path) -> None:
    fast = [1.2, 1.3, 1.25, 1.15, 1.35, 1.22, 1.28, 1.31] * 4
    slow = [0.8, 0.85, 0.9, 0.82] * 8
    mixed = [0.7, 1.4, 0.8, 1.3, 0.9, 1.2, 1.0, 1.1] * 4
    report = _report(_stats("trained", _pairs(fast)), _stats("untrained", _pairs(slow)), _stats("other", _pairs(mixed)))
    median, low, high = speedup_interval(fast)
    assert report.speedup_interval("trained", SET) == (median, low, high)
    assert report.speedup("trained", SET) == pytest.approx(1.265)
    assert [report.verdict(label, SET) for label in ("trained", "untrained", "other")] == [
        PAYS,
        DOES_NOT_PAY,
        INCONCLUSIVE,
    ]
    md = report.markdown()
    head = table_row(md, "prompt set", "draft")
    speedup, verdict = head.index("speed-up"), head.index("verdict")
    assert verdict == speedup + 1
    assert _row(md, "trained")[speedup] == f"{median:.2f} [{low:.2f}, {high:.2f}]"
    assert [_row(md, label)[verdict] for label in ("trained", "untrained", "other")] == [
        "pays",
        "does not pay",
        "inconclusive",
    ]
    assert _row(md, "none (plain verifier)")[speedup : verdict + 1] == ["1.00", "-"]
    assert "batch-1 speed paired on its first 32 prompts" in md and "95% bootstrap interval" in md, md
    assert f"- {SET}: the trained draft's batch-1 speed-up {median:.2f} [{low:.2f}, {high:.2f}] over 32 prompt " in md
    assert "over 32 prompt pairs: pays (the 95% interval's lower bound is above 1.0)" in md
    assert "over 32 prompt pairs: does not pay" in md and "over 32 prompt pairs: inconclusive" in md

    json_path, _md = write_report(report, tmp_path)
    data = json.loads(json_path.read_text())
    assert data["speedup"][SET]["trained"] == pytest.approx(median)
    assert data["speedup_interval"][SET]["trained"] == pytest.approx([low, high])
    assert data["speedup_verdict"][SET] == {"trained": PAYS, "untrained": DOES_NOT_PAY, "other": INCONCLUSIVE}
    summary = data["summary"][SET]["trained (online)"]
    assert summary["speedup_verdict"] == PAYS and summary["speedup_interval"] == pytest.approx([low, high])
    assert data["stats"][0]["speed_pairs"][1] == {
        "sample_id": "s1",
        "first": "draft",
        "plain_tokens": 100,
        "plain_seconds": 2.0,
        "draft_tokens": 100,
        "draft_seconds": pytest.approx(2.0 / 1.3),
    }
    assert AcceptanceStats.from_dict(data["stats"][0]).speed_ratios == pytest.approx(fast)  # round trip


def test_the_dagster_table_and_metadata_carry_the_interval_and_the_verdict(tmp_path: Path) -> None:
    """The UI's sortable table and the materialization's metadata, not only report_markdown, say whether it pays."""
    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.defs.evaluation import evaluation_metadata

    fast = [1.2, 1.3, 1.25, 1.15, 1.35, 1.22, 1.28, 1.31] * 4
    mixed = [0.7, 1.4, 0.8, 1.3, 0.9, 1.2, 1.0, 1.1] * 4
    report = _report(_stats("trained", _pairs(fast)), _stats("other", _pairs(mixed)))
    metadata = evaluation_metadata(report, DataLayout.at(tmp_path))
    rows = {r.data["draft"]: r.data for r in metadata["table"].records}
    median, low, high = speedup_interval(fast)
    trained = rows["trained"]
    assert (trained["speedup"], trained["speedup_low"], trained["speedup_high"]) == tuple(
        round(v, 3) for v in (median, low, high)
    )
    assert (trained["speedup_verdict"], rows["other"]["speedup_verdict"]) == (PAYS, INCONCLUSIVE)
    assert metadata["speedup_verdict_trained_humaneval"].value == PAYS
    assert metadata["speedup_verdict_other_humaneval"].value == INCONCLUSIVE


def test_a_failed_speed_request_on_either_side_withholds_the_speed_up() -> None:
    ratios: list[float | None] = [1.3] * 32
    plain_side = _stats("trained", _pairs(ratios, plain_failed={3}))
    assert (plain_side.plain_speed_failed, len(plain_side.speed_ratios)) == (1, 31)  # left out, and counted
    ratios[5] = None
    draft_side = _stats("untrained", _pairs(ratios), speed_failed=1)
    report = _report(plain_side, draft_side, plain_failed=1)
    for label in ("trained", "untrained"):
        assert report.speed_failed(label, SET) == 1
        assert report.speedup(label, SET) is None and report.speedup_interval(label, SET) is None
        assert report.verdict(label, SET) == WITHHELD  # 31 surviving pairs all at 1.3: still no number
    md = report.markdown()
    assert _row(md, "trained")[-3:] == ["- (1 speed request failed)", "withheld", "0"]
    assert _row(md, "none (plain verifier)")[-4:-1] == ["- (1 speed request failed)"] * 2 + ["-"]
    assert "prompt pairs:" not in md  # no verdict line over a withheld speed-up
    data = report.to_dict()
    assert data["speedup"][SET] == {"trained": None, "untrained": None}
    assert data["speedup_verdict"][SET] == {"trained": WITHHELD, "untrained": WITHHELD}
    assert data["speedup_interval"][SET] == {"trained": None, "untrained": None}


def test_a_failed_plain_request_of_another_drafts_pairs_leaves_this_one_standing() -> None:
    """Each draft's speed-up is over its own pairs: a plain failure in the untrained draft's pairs withholds that
    one, and the plain row's tok/s, not the trained draft's."""
    trained = _stats("trained", _pairs([1.3] * 8))
    untrained = _stats("untrained", _pairs([0.9] * 8, plain_failed={0}))
    report = _report(trained, untrained, plain_failed=1)
    assert report.speed_failed("trained", SET) == 0 and report.verdict("trained", SET) == PAYS
    assert report.verdict("untrained", SET) == WITHHELD


def test_one_pair_gives_a_median_and_no_interval() -> None:
    report = _report(_stats("trained", _pairs([1.5])))
    assert report.speedup_interval("trained", SET) == (pytest.approx(1.5), None, None)
    assert report.verdict("trained", SET) == INCONCLUSIVE
    md = report.markdown()
    assert _row(md, "trained")[-3:] == ["1.50", "inconclusive", "0"]
    assert "1.50 over 1 prompt pair: inconclusive (no interval: fewer than 2 prompt pairs)" in md
    assert report.to_dict()["speedup_interval"][SET]["trained"] is None


def test_figures_not_measured_paired_keep_the_tok_s_ratio_without_an_interval() -> None:
    """Stats without pairs (built from batch figures): the speed-up is the tok/s ratio, inconclusive, as before."""
    stats = AcceptanceStats(
        "trained", "online", K, 10, 30, 10, [5, 3, 2], output_tokens=250, seconds=5.0, prompt_set=SET
    )
    run = OnlineRun(prompts=4, max_tokens=64, baseline_output_tokens=250, baseline_seconds=10.0, prompt_set=SET,
                    speed_prompts=2)  # fmt: skip
    report = EvaluationReport("d", "v", K, None, [stats], online=[run])
    assert report.speedup("trained", SET) == pytest.approx(2.0) and report.verdict("trained", SET) == INCONCLUSIVE
    md = report.markdown()
    assert _row(md, "trained")[-3:] == ["2.00", "inconclusive", "0"]
    assert "tok/s at batch 1 on its first 2" in md and "no interval: not measured paired" in md
