"""Acceptance beyond one greedy figure (issue 32): by prompt length from the same responses' per-request metrics,
and the trained draft's batch again at a temperature, each in the report's line for that draft."""

from __future__ import annotations

from eagle3_assets.evaluation.acceptance_counts import (
    Generation,
    breakdown_line,
    by_prompt_length,
    request_seed,
    summary,
)
from eagle3_assets.evaluation.evaluation_report import AcceptanceStats, EvaluationReport, OnlineRun

K = 3


def _response(prompt_tokens: int | None, histogram: list[int] | None) -> Generation:
    speculative = (
        None if histogram is None else {"acceptance_histogram": histogram, "num_draft_tokens": 3 * sum(histogram)}
    )
    return Generation("s", [1], "x", 10, "stop", speculative=speculative, prompt_tokens=prompt_tokens)


def test_buckets_sum_the_same_responses_as_the_batch() -> None:
    responses = [
        _response(100, [2, 0, 0, 2]),  # short: 4 drafts, 6 accepted
        _response(255, [0, 4, 0, 0]),  # short: 4 drafts, 4 accepted
        _response(256, [4, 0, 0, 0]),  # medium: nothing accepted
        _response(5000, [0, 0, 0, 1]),  # long
        _response(None, None),  # a failed request: in no bucket
    ]
    buckets = by_prompt_length(responses, K)
    assert list(buckets) == ["short", "medium", "long"]
    assert buckets["short"] == {"low": 0, "high": 256, "prompts": 2, "drafts": 8, "accepted": 10,
                                "mean_acceptance_length": 1 + 10 / 8}  # fmt: skip
    assert buckets["medium"]["mean_acceptance_length"] == 1.0 and buckets["long"]["mean_acceptance_length"] == 4.0
    whole = summary(responses, K)
    assert whole["drafts"] == sum(b["drafts"] for b in buckets.values())
    assert whole["accepted"] == sum(b["accepted"] for b in buckets.values())
    assert by_prompt_length([_response(10, None)], K)["short"]["mean_acceptance_length"] is None


def test_a_sampled_request_draws_the_same_way_in_every_run() -> None:
    assert request_seed("abc") == request_seed("abc") != request_seed("abd")
    assert 0 <= request_seed("abc") < 2**32


def test_the_report_says_greedy_beside_sampled_and_by_length() -> None:
    extra = {
        "sampled": {"temperature": 0.7, "prompts": 16, "drafts": 1200, "accepted": 600, "mean_acceptance_length": 1.5},
        "by_prompt_length": by_prompt_length([_response(100, [0, 0, 0, 2]), _response(2000, [2, 0, 0, 0])], K),
    }
    stats = AcceptanceStats("trained", "online", K, 4, 12, 6, [2, 2, 2], prompt_set="humaneval", extra=extra)
    line = breakdown_line("humaneval", "trained", stats.mean_acceptance_length, stats.extra)
    assert line == (
        "- humaneval, trained draft: mean acceptance length 2.500 greedy, 1.500 at temperature 0.7 (vLLM's rejection "
        "sampling, 1,200 drafts over 16 prompts); greedy by prompt length: short (0-255 tokens, 1 prompts) 4.000, "
        "long (1024+ tokens, 1 prompts) 1.000"
    )
    assert breakdown_line("humaneval", "trained", 2.5, {}) is None
    run = OnlineRun(prompts=16, max_tokens=128, baseline_output_tokens=0, baseline_seconds=0.0, prompt_set="humaneval")
    report = EvaluationReport(draft_dir="d", verifier="v", k=K, held_out_partition="00003", stats=[stats], online=[run])
    assert line in report.markdown().splitlines()
    assert report.to_dict()["stats"][0]["extra"]["sampled"]["mean_acceptance_length"] == 1.5
