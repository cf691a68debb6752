"""The batch-1 speed-up measured paired (issue 32 item 3): the median per-prompt ratio with its 95% bootstrap
interval, the verdict on it, and the speed batch's order: per prompt one request to the plain verifier and one to
the draft, one at a time, alternating which goes first, never one server after the other.

The servers are stubs on threads (``support.common.stub_http_server``) recording every request, in the order they
arrive, in one list shared by both."""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest

from eagle3_assets.evaluation.acceptance_counts import breakdown_line, request_seed
from eagle3_assets.evaluation.evaluation_report import (
    DOES_NOT_PAY,
    INCONCLUSIVE,
    PAYS,
    pair_ratio,
    pair_record,
    speedup_interval,
    speedup_verdict,
)
from eagle3_assets.evaluation.online_metrics import (
    OnlineConfig,
    Prompt,
    evaluate_online,
    generate_paired,
    paired_order,
)
from support.chat_stub import ChatHandler, chat_completion
from support.common import stub_http_server

K = 3
SPECULATIVE = {"acceptance_histogram": [1, 0, 0, 1], "num_draft_tokens": 2 * K, "num_spec_steps": 2}

# ------------------------------------------------------------------------------------ the statistics


def test_the_median_and_a_known_interval() -> None:
    ratios = [0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]
    median, low, high = speedup_interval(ratios)
    assert median == pytest.approx(1.25)
    assert low is not None and high is not None and 0.9 <= low < median < high <= 1.6
    assert (low, high) == pytest.approx((1.05, 1.45), abs=0.051)  # a median of 8 moves by about one rank either way
    assert speedup_interval(ratios) == (median, low, high)  # a fixed seed: the same report every time
    assert speedup_interval(list(reversed(ratios)))[0] == median


def test_every_prompt_faster_pays_and_one_interval_per_case() -> None:
    assert speedup_verdict(speedup_interval([1.2, 1.3, 1.25, 1.4, 1.22, 1.31] * 6)) == PAYS
    assert speedup_verdict(speedup_interval([0.8, 0.85, 0.9, 0.82] * 8)) == DOES_NOT_PAY
    assert speedup_verdict(speedup_interval([0.7, 1.4, 0.8, 1.3, 0.9, 1.2, 1.0, 1.1] * 4)) == INCONCLUSIVE
    assert speedup_verdict((1.5, 1.0, 2.0)) == INCONCLUSIVE  # a lower bound of exactly 1.0 is not "above"
    assert speedup_verdict((1.5, 1.01, 2.0)) == PAYS


def test_degenerate_inputs() -> None:
    assert speedup_interval([1.4]) == (1.4, None, None)  # one prompt: a median, no interval
    assert speedup_verdict(speedup_interval([3.0])) == INCONCLUSIVE  # however fast, one prompt is no evidence
    assert speedup_interval([1.1, 1.1, 1.1]) == pytest.approx((1.1, 1.1, 1.1))  # no spread, a point interval
    with pytest.raises(ValueError, match="no speed-up ratios"):
        speedup_interval([])
    median, low, high = speedup_interval([1.0, 2.0])
    assert (median, low, high) == pytest.approx((1.5, 1.0, 2.0))  # two prompts: the resampled medians span both


def test_a_pair_with_a_failed_side_has_no_ratio() -> None:
    assert pair_ratio(pair_record("a", "plain", (100, 2.0), (100, 1.0))) == pytest.approx(2.0)
    assert pair_ratio(pair_record("a", "draft", (100, 2.0), (50, 1.0))) == pytest.approx(1.0)
    assert pair_ratio(pair_record("a", "plain", None, (100, 1.0))) is None
    assert pair_ratio(pair_record("a", "plain", (100, 1.0), None)) is None
    assert pair_ratio(pair_record("a", "plain", (0, 1.0), (100, 1.0))) is None  # no plain rate to divide by


# ------------------------------------------------------------------------------------ the paired order


def test_plain_first_on_an_even_index_the_draft_first_on_an_odd() -> None:
    assert [paired_order(i) for i in range(4)] == [
        ("plain", "draft"),
        ("draft", "plain"),
        ("plain", "draft"),
        ("draft", "plain"),
    ]


@contextmanager
def _stub(side: str, seen: list[tuple[str, str]], delay_s: float = 0.0, fail: set[tuple[str, int]] | None = None,
          speculative: bool = False, bodies: list[dict[str, Any]] | None = None) -> Iterator[str]:  # fmt: skip
    """A chat-completions server appending (``side``, prompt content) to ``seen`` as each request arrives; ``delay_s``
    before a reply of 8 tokens; a 500 for (content, n) in ``fail``: the n-th request (from 0) with that content."""
    lock = threading.Lock()
    counts: dict[str, int] = {}

    class Handler(ChatHandler):
        def answer(self, request: dict[str, Any]) -> dict[str, Any] | None:
            content = request["messages"][-1]["content"]
            with lock:
                seen.append((side, content))
                if bodies is not None:
                    bodies.append(request)
                n = counts[content] = counts.get(content, -1) + 1
            if (content, n) in (fail or set()):
                body = json.dumps({"error": {"message": "boom"}}).encode()
                self.send_response(500)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return None
            time.sleep(delay_s)
            return chat_completion(
                request["model"], content, list(range(8)), "length", SPECULATIVE if speculative else None
            )

    with stub_http_server(Handler) as url:
        yield url


@contextlib.contextmanager
def _serving(url: str) -> Iterator[Any]:
    yield SimpleNamespace(base_url=url, startup_s=0.0)


def _running_at(url: str) -> Any:
    """A stand-in for ``local_server``: every server it "starts" is the one at ``url``."""
    return lambda *args, **kwargs: _serving(url)


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(f"p{i}", [{"role": "user", "content": f"q{i}"}]) for i in range(n)]


def test_the_speed_batch_alternates_between_the_two_servers() -> None:
    seen: list[tuple[str, str]] = []
    config = OnlineConfig(k=K, max_tokens=8, request_timeout_s=10)
    with _stub("plain", seen) as plain, _stub("draft", seen, speculative=True) as draft:
        plain_run, draft_run = generate_paired(plain, draft, "m", _prompts(4), config)
    assert seen == [
        ("plain", "q0"), ("draft", "q0"),
        ("draft", "q1"), ("plain", "q1"),
        ("plain", "q2"), ("draft", "q2"),
        ("draft", "q3"), ("plain", "q3"),
    ]  # fmt: skip
    assert [g.sample_id for g in plain_run.generations] == [g.sample_id for g in draft_run.generations]
    assert all(g.seconds is not None and g.seconds > 0 for g in plain_run.generations + draft_run.generations)
    assert plain_run.seconds == pytest.approx(sum(g.seconds or 0 for g in plain_run.generations))


def _evaluate(
    seen: list[tuple[str, str]],
    tmp_path: Path,
    prompts: int,
    speed: int | None = None,
    sampled: float = 0.0,
    **stubs: Any,
) -> Any:
    """evaluate_online against two stubs; greedy only unless ``sampled`` (the tests of the speed batch count every
    request, so the temperature batch is their own test's)."""
    speed_prompts = prompts if speed is None else speed
    config = OnlineConfig(k=K, max_tokens=8, concurrency=prompts, speed_prompts=speed_prompts, request_timeout_s=10,
                          served_model_name="m", sampled_temperature=sampled)  # fmt: skip
    with (
        _stub("plain", seen, **stubs.get("plain", {})) as plain,
        _stub("draft", seen, speculative=True, **stubs.get("draft", {})) as draft,
    ):
        config.plain_url, config.draft_url = plain, draft
        return evaluate_online(tmp_path, {"trained": tmp_path}, {"held-out": _prompts(prompts)}, config, lambda _: None)


def test_evaluate_online_interleaves_the_speed_batch_and_keeps_the_pairs(tmp_path: Path) -> None:
    """Acceptance batches as before (the plain verifier's, then the draft's), then the speed batch interleaved: a
    speed batch run one server after the other fails here."""
    from eagle3_assets.evaluation.evaluation_report import EvaluationReport, OnlineRun

    seen: list[tuple[str, str]] = []
    n = 6
    # the plain verifier answers in ~60 ms, the draft's server in ~20 ms: every prompt's ratio well above 1
    result = _evaluate(seen, tmp_path, n, plain={"delay_s": 0.06}, draft={"delay_s": 0.02})
    assert sorted(seen[:n]) == [("plain", f"q{i}") for i in range(n)]
    assert sorted(seen[n : 2 * n]) == [("draft", f"q{i}") for i in range(n)]
    speed = seen[2 * n :]
    expected = [(side, f"q{i}") for i in range(n) for side in paired_order(i)]
    assert speed == expected, f"the speed batch was not interleaved plain/draft per prompt: {speed}"
    switches = sum(1 for a, b in itertools.pairwise(speed) if a[0] != b[0])
    assert switches >= n, speed  # one server after the other would switch once

    (stats,) = result.stats
    assert [p["first"] for p in stats.speed_pairs] == ["plain", "draft"] * (n // 2)
    assert [p["sample_id"] for p in stats.speed_pairs] == [f"p{i}" for i in range(n)]
    assert all(p["plain_tokens"] == p["draft_tokens"] == 8 for p in stats.speed_pairs)
    assert len(stats.speed_ratios) == n and min(stats.speed_ratios) > 1.0
    assert result.mismatches["held-out"]["trained"] == []
    baseline = result.baseline["held-out"].speed
    assert baseline is not None and len(baseline.generations) == n and not baseline.failures

    run = OnlineRun(prompts=n, max_tokens=8, baseline_output_tokens=baseline.output_tokens,
                    baseline_seconds=baseline.seconds, concurrency=n, speed_prompts=n)  # fmt: skip
    report = EvaluationReport("d", "v", K, None, [stats], online=[run])
    median, low, high = report.speedup_interval("trained", "held-out") or (0, None, None)
    assert low is not None and low > 1.0 and report.verdict("trained", "held-out") == PAYS
    assert report.to_dict()["speedup_verdict"]["held-out"]["trained"] == PAYS
    md = report.markdown()
    assert f"{median:.2f} [{low:.2f}, {high:.2f}] | pays |" in md, md
    assert f"batch-1 speed paired on its first {n} prompts" in md and f"over {n} prompt pairs: pays" in md, md


def test_a_failed_draft_speed_request_leaves_its_prompt_out_and_withholds_the_speed_up(tmp_path: Path) -> None:
    from eagle3_assets.evaluation.evaluation_report import EvaluationReport, OnlineRun

    seen: list[tuple[str, str]] = []
    n = 4
    result = _evaluate(seen, tmp_path, n, draft={"fail": {("q1", 1)}})  # q1's second request: its speed request
    (stats,) = result.stats
    assert (stats.failed, stats.speed_failed, stats.plain_speed_failed) == (1, 1, 0)
    assert stats.speed_pairs[1]["draft_seconds"] is None and stats.speed_pairs[1]["plain_seconds"] is not None
    assert len(stats.speed_ratios) == n - 1  # left out of the ratios, and counted
    assert stats.tokens_per_second is None
    baseline = result.baseline["held-out"].speed
    run = OnlineRun(prompts=n, max_tokens=8, baseline_output_tokens=baseline.output_tokens,
                    baseline_seconds=baseline.seconds, concurrency=n, speed_prompts=n)  # fmt: skip
    report = EvaluationReport("d", "v", K, None, [stats], online=[run])
    assert report.speed_failed("trained", "held-out") == 1
    assert report.speedup("trained", "held-out") is None and report.verdict("trained", "held-out") == "withheld"
    assert "| - (1 speed request failed) | withheld |" in report.markdown()


def test_the_trained_draft_is_measured_again_at_the_sampled_temperature(tmp_path: Path) -> None:
    """After its greedy batches, the trained draft's server gets the acceptance batch again at the temperature, each
    request seeded by its sample id; the row carries both figures and the by-length buckets."""
    seen: list[tuple[str, str]] = []
    bodies: list[dict[str, Any]] = []
    result = _evaluate(seen, tmp_path, 3, speed=0, sampled=0.7, draft={"bodies": bodies})
    assert [side for side, _ in seen] == ["plain"] * 3 + ["draft"] * 6
    sampled = [b for b in bodies if b.get("temperature")]
    assert len(sampled) == 3 and all(b["temperature"] == 0.7 for b in sampled)
    assert sorted(b["seed"] for b in sampled) == sorted(request_seed(f"p{i}") for i in range(3))
    assert all("seed" not in b and not b.get("temperature") for b in bodies if b not in sampled)
    (stats,) = result.stats
    assert stats.extra["sampled"]["temperature"] == 0.7 and stats.extra["sampled"]["prompts"] == 3
    assert stats.extra["sampled"]["seeded"] is True  # a server given by URL is a GPU's
    assert stats.extra["sampled"]["drafts"] == stats.drafts  # the stub accepts the same at any temperature
    assert set(stats.extra["by_prompt_length"]) == {"short"}


@pytest.mark.parametrize(("build", "seeded"), [("cpu", False), ("cuda", True)])
def test_a_local_cpu_vllm_gets_the_sampled_batch_unseeded(tmp_path: Path, build: str, seeded: bool) -> None:
    """A trained draft served here on the CPU build of vLLM: no request carries a seed (the CPU engine dies on a
    seeded request prefilled in chunks); on the CUDA build each does. The report says which."""
    seen: list[tuple[str, str]] = []
    bodies: list[dict[str, Any]] = []
    config = OnlineConfig(k=K, max_tokens=8, concurrency=3, speed_prompts=0, request_timeout_s=10,
                          served_model_name="m", sampled_temperature=0.7)  # fmt: skip
    with _stub("plain", seen) as plain, _stub("draft", seen, speculative=True, bodies=bodies) as draft:
        config.plain_url = plain
        with (
            mock.patch("eagle3_assets.evaluation.online_metrics.local_server", _running_at(draft)),
            mock.patch("eagle3_assets.local.accelerator.vllm_build", lambda python=None: build),
        ):
            result = evaluate_online(tmp_path, {"trained": tmp_path}, {"held-out": _prompts(3)}, config, print)
    sampled = [b for b in bodies if b.get("temperature")]
    assert len(sampled) == 3 and all(("seed" in b) is seeded for b in sampled)
    (stats,) = result.stats
    assert stats.extra["sampled"]["seeded"] is seeded
    line = breakdown_line("held-out", "trained", stats.mean_acceptance_length, stats.extra)
    assert ("unseeded on a CPU vLLM" in line) is not seeded


def test_only_the_trained_draft_gets_a_speed_batch(tmp_path: Path) -> None:
    from eagle3_assets.evaluation.evaluation_report import EvaluationReport, OnlineRun

    """The untrained baseline's acceptance is measured, its speed is not (it never pays; pairing it doubled the
    batch-1 requests, the slowest part of an evaluation on a CPU)."""
    seen: list[tuple[str, str]] = []
    config = OnlineConfig(k=K, max_tokens=8, concurrency=3, speed_prompts=3, request_timeout_s=10,
                          served_model_name="m", sampled_temperature=0.0)  # fmt: skip
    with _stub("plain", seen) as plain, _stub("draft", seen, speculative=True) as draft:
        config.plain_url, config.draft_url = plain, draft
        drafts = {"trained": tmp_path, "untrained": tmp_path}
        # the untrained draft gets a local server: stand the stub in for it
        with mock.patch("eagle3_assets.evaluation.online_metrics.local_server", _running_at(draft)):
            result = evaluate_online(tmp_path, drafts, {"held-out": _prompts(3)}, config, lambda _: None)
    sides = [side for side, _ in seen]
    assert (
        sides == ["plain"] * 3 + ["draft"] * 3 + ["plain", "draft", "draft", "plain", "plain", "draft"] + ["draft"] * 3
    )
    trained, untrained = result.stats
    assert len(trained.speed_pairs) == 3 and untrained.speed_pairs == [] and untrained.drafts > 0
    # and no speed figure for it: its acceptance batch (3 in flight) against the plain verifier's batch 1 made
    # make demo's report say 3.77 for a draft that accepts almost nothing
    assert untrained.tokens_per_second is None
    speed = result.baseline["held-out"].speed
    baseline = OnlineRun(prompts=3, max_tokens=8, baseline_output_tokens=speed.output_tokens,
                         baseline_seconds=speed.seconds, speed_prompts=3)  # fmt: skip
    report = EvaluationReport("d", "v", K, None, result.stats, online=[baseline])
    assert report.speedup("trained", "held-out") is not None
    assert report.speedup("untrained", "held-out") is None and report.verdict("untrained", "held-out") is None


def test_no_speed_batch_without_speed_prompts(tmp_path: Path) -> None:
    seen: list[tuple[str, str]] = []
    result = _evaluate(seen, tmp_path, 3, speed=0)
    assert [side for side, _ in seen] == ["plain"] * 3 + ["draft"] * 3  # the acceptance batches only
    (stats,) = result.stats
    assert stats.speed_pairs == [] and result.baseline["held-out"].speed is None
