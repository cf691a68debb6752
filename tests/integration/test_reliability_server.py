"""Issue 8, server faults beyond the happy path: a server that crashes mid-partition and comes back on the same
port, 200s that are not chat completions or have no choices (persistently, so retries run out), and a wrong
model name (HTTP 404). Sporadic faults of every kind are already covered by
tests/unit/test_generation_engine.py::test_every_fault_kind_is_retried_streaming_or_not."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import polars as pl
import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.generation import generate_partition
from eagle3_assets.generation.journal import read_journal
from eagle3_assets.generation.response_checks import completeness_check, error_rate_check
from fake_vllm import FakeConfig, FakeServerProcess, draw_fault
from support.reliability import (
    journal_lines,
    key_of,
    make_prompts,
    quick_config,
    restartable_server,
    wait_for,
)

KEY = "00000"
DOWNTIME_S = 60.0  # the outage: a server down for a minute


def _rows(layout: DataLayout) -> pl.DataFrame:
    return pl.read_parquet(layout.responses_path(KEY))


@pytest.mark.slow
def test_server_down_mid_partition_then_back_completes_without_losing_or_redoing_finished_samples(
    layout: DataLayout,
) -> None:
    prompts = make_prompts(300, tag="down")
    # ~0.1 s per response at C=16: the partition would take ~2 s without the outage
    fake = FakeConfig(token_rate=2000, median_tokens=200, sigma=0.3)
    journal = layout.responses_in_progress_path(KEY)
    before_crash: dict[str, dict] = {}
    second_stats: dict = {}
    events: list[str] = []
    with restartable_server(fake) as server:

        def outage() -> None:
            wait_for(lambda: journal_lines(journal) >= 80, 60, "80 journaled samples")
            before_crash.update(read_journal(journal).records)
            server.crash()
            events.append(f"crashed at {time.monotonic():.2f}")
            time.sleep(DOWNTIME_S)
            server.start()
            events.append(f"back at {time.monotonic():.2f}")

        thread = threading.Thread(target=outage, daemon=True)
        thread.start()
        logs: list[str] = []
        # Requests to the dead port fail at once: the endpoint is benched and probed at doubling intervals (0.5 s,
        # 1 s, ... 32 s: only a failed probe doubles the bench), back in rotation when a probe is answered.
        config = quick_config(
            server.base_url, model="fake-model", bench_after_failures=5, bench_s=0.5, backoff_max_s=1.0, max_attempts=20
        )
        started = time.monotonic()
        result = generate_partition(prompts, KEY, layout, config, log=logs.append)
        elapsed = time.monotonic() - started
        thread.join(30)
        second_stats = server.stats()  # the restarted process: it only saw requests made after the outage

    assert len(events) == 2, events  # the outage really happened during the run
    assert 80 <= len(before_crash) < 300
    # the outage plus at most one full bench (the last failed probe's doubling, <= 64 s) plus the work itself
    assert DOWNTIME_S < elapsed < DOWNTIME_S + 90, f"took {elapsed:.0f}s"
    assert (result.ok, result.failed, result.total) == (300, 0, 300)
    frame = _rows(layout)
    assert frame["sample_id"].to_list() == [p.sample_id for p in prompts]
    assert set(frame["status"]) == {"ok"}
    assert any("benched" in line for line in logs) and any("back in rotation" in line for line in logs)
    assert result.retries > 0 and any("connection" in reason or "timeout" in reason for reason in result.retry_reasons)
    # Nothing finished before the crash was lost or requested again: same rows, and the restarted server never
    # saw those prompts.
    for row in frame.filter(pl.col("sample_id").is_in(list(before_crash))).iter_rows(named=True):
        assert row["finished_at"] == before_crash[row["sample_id"]]["finished_at"]
        assert row["content"] == before_crash[row["sample_id"]]["content"]
    keys_before = {key_of(p) for p in prompts if p.sample_id in before_crash}
    assert not keys_before & set(second_stats["requests"])
    assert second_stats["total_requests"] >= 300 - len(before_crash) - 16  # the rest was done after the outage


def _expected_failures(prompts: list, fake: FakeConfig, attempts: int) -> set[str]:
    """Samples whose every attempt draws a fault (the fake server's draws are deterministic)."""
    return {
        p.sample_id for p in prompts if all(draw_fault(key_of(p), seen, fake) is not None for seen in range(attempts))
    }


@pytest.mark.parametrize(
    ("kind", "stream", "reason"),
    [
        ("non_completion", False, "200 response is not a chat completion"),
        ("empty_choices", False, "chat completion has no choices"),
        ("non_completion", True, "stream event is not a chat completion chunk"),
        ("empty_choices", True, "truncated stream"),
    ],
)
def test_bad_200_bodies_that_persist_fail_only_the_affected_samples_with_the_reason(
    layout: DataLayout, kind: str, stream: bool, reason: str
) -> None:
    prompts = make_prompts(80, tag=f"{kind}{int(stream)}")
    fake = FakeConfig(token_rate=5000, median_tokens=30, stream_interval_s=0.005, faults={kind: 0.5})
    expected_failed = _expected_failures(prompts, fake, attempts=2)
    assert 5 < len(expected_failed) < 60  # the draw makes some samples fail twice and the others succeed
    with FakeServerProcess(fake) as server:
        config = quick_config(server.base_url, stream=stream, max_attempts=2)
        result = generate_partition(prompts, KEY, layout, config, log=lambda _m: None)
        frame = _rows(layout)
        failed = frame.filter(pl.col("status") == "failed")
        assert set(failed["sample_id"]) == expected_failed
        assert (result.total, result.failed, result.ok) == (80, len(expected_failed), 80 - len(expected_failed))
        for row in failed.iter_rows(named=True):
            assert row["error"].startswith("gave up after 2 attempts; last error: ")
            assert reason in row["error"], row["error"]
            assert row["attempts"] == 2 and row["content"] is None
        ok = frame.filter(pl.col("status") == "ok")
        assert ok["content"].null_count() == 0 and ok["finish_reason"].null_count() == 0
        assert completeness_check(layout.responses_path(KEY), [p.sample_id for p in prompts]).passed
        check = error_rate_check(layout.responses_path(KEY))
        assert not check.passed and any(reason in text for text in check.metadata["top_errors"])

        # The next materialization asks only for the failed samples and keeps every ok row as it was.
        server.reset_stats()
        again = generate_partition(
            prompts, KEY, layout, quick_config(server.base_url, stream=stream, max_attempts=8), log=lambda _m: None
        )
        requested = set(server.stats()["requests"])
    assert requested == {key_of(p) for p in prompts if p.sample_id in expected_failed}
    assert (again.resumed, again.requested) == (80 - len(expected_failed), len(expected_failed))
    assert _rows(layout).filter(pl.col("sample_id").is_in(ok["sample_id"].to_list())).equals(ok)


def test_wrong_model_name_fails_with_the_404_and_the_right_one_reuses_finished_samples(
    layout: DataLayout, tmp_path: Path
) -> None:
    first = make_prompts(20, tag="model")
    more = first + make_prompts(10, tag="later")
    with FakeServerProcess(FakeConfig(token_rate=5000, median_tokens=30)) as server:
        generate_partition(first, KEY, layout, quick_config(server.base_url), log=lambda _m: None)
        done = _rows(layout)

        server.reset_stats()
        logs: list[str] = []
        result = generate_partition(
            more, KEY, layout, quick_config(server.base_url, model="no-such-model"), log=logs.append
        )
        stats = server.stats()
        assert any("'no-such-model' is not among the served models" in line for line in logs), logs
        # another model is another request (issue 14): the finished rows answer the old one and are asked again;
        # a 404 is not retried: one request per sample
        assert (result.total, result.resumed, result.ok, result.failed) == (30, 0, 0, 30)
        assert stats["total_requests"] == 30 and stats["outcomes"] == {"404": 30}
        frame = _rows(layout)
        failed = frame.filter(pl.col("status") == "failed")
        assert failed["sample_id"].to_list() == [p.sample_id for p in more]
        assert set(failed["error"]) == {"HTTP 404: The model `no-such-model` does not exist."}
        assert set(failed["attempts"]) == {1}

        # the right name again: the rows finished for it were kept aside (_superseded) and are reused as they were
        server.reset_stats()
        fixed = generate_partition(more, KEY, layout, quick_config(server.base_url), log=lambda _m: None)
        assert server.stats()["total_requests"] == 10
    assert (fixed.ok, fixed.failed, fixed.resumed) == (30, 0, 20)
    assert _rows(layout).head(20).equals(done)


def test_requests_in_flight_when_an_endpoint_is_benched_do_not_stretch_its_bench() -> None:
    from eagle3_assets.net.endpoints import EndpointPool

    now = [0.0]
    pool = EndpointPool(["http://a/v1"], cap=16, bench_after_failures=3, bench_s=0.5, clock=lambda: now[0])
    taken = [pool.acquire() for _ in range(16)]  # 16 requests in flight when the server crashes
    for endpoint in taken:
        assert endpoint is not None
        pool.release(endpoint, server_failure=True)  # they all fail with a connection reset
    endpoint = pool.endpoints[0]
    assert endpoint.benched
    # one bench for one outage: probed again after bench_s, not after 2**13 * bench_s (capped at 300 s)
    assert endpoint.bench_s == 0.5 and pool.next_change_in() == 0.5
