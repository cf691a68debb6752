"""Issue 22 (items 2 and 4): a hostile server never stalls a generation run.

Against the fake vLLM server in a subprocess or thread (tests/support/fake_vllm.py):

- a server that answers 200 with a malformed body on every reply gets failed rows at once: with the default bench
  settings it is never benched (a bench is for an outage: refused, reset, timed out, 5xx);
- a deployment whose every endpoint goes down mid-run ends the run with an error naming EAGLE3_OUTAGE_BUDGET_S once
  the budget is spent (seconds here), the finished rows journaled, and a re-run resumes;
- ``/metrics`` that lies (NaN, a waiting queue of 1e9) is no reading: the run falls back to its configured cap and
  finishes; a poller that fails never fails the run; partitions wait in key order per server, not globally.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.generation import GenerationConfig, PromptToGenerate, generate_partition
from eagle3_assets.generation.capacity import CapacityMonitor, PartitionLine, parse_load
from eagle3_assets.generation.errors import OutageError
from eagle3_assets.generation.journal import read_journal
from eagle3_assets.net.endpoints import EndpointPool
from fake_vllm import FakeConfig, FakeServerProcess, serve_in_thread

KEY = "00000"
pytestmark = pytest.mark.timeout(120, method="thread")


def _prompts(n: int) -> list[PromptToGenerate]:
    return [PromptToGenerate(f"q-{i:03d}", [{"role": "user", "content": f"question {i}"}]) for i in range(n)]


def _config(url: str, **overrides: Any) -> GenerationConfig:
    values: dict[str, Any] = dict(
        base_urls=[url], model="fake-model", concurrency=4, max_tokens=200, max_attempts=2, request_timeout_s=5.0,
        backoff_base_s=0.01, backoff_max_s=0.05, progress_interval_s=60.0,
    )  # fmt: skip
    values.update(overrides)
    return GenerationConfig(**values)


def _bounded(run: Any, limit_s: float) -> Any:
    """``run()`` on a daemon thread; fails the test (instead of hanging it) when it has not returned in time."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = run()
        except BaseException as error:
            box["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"still running after {limit_s} s"
    if "error" in box:
        raise box["error"]
    return box["result"]


# ------------------------------------------------------------------------------------ malformed replies


def test_a_server_that_lies_on_every_reply_gets_failed_rows_at_once_and_is_never_benched(layout: DataLayout) -> None:
    notes: list[str] = []
    fake = FakeConfig(token_rate=20000, median_tokens=30, faults={"content_list": 1.0})
    started = time.monotonic()
    with FakeServerProcess(fake) as liar:
        # the default bench settings (5 failures, 30 s): before, the endpoint was benched and the run crawled
        result = generate_partition(_prompts(12), KEY, layout, _config(liar.base_url), log=notes.append)
    assert (result.ok, result.failed, result.requests) == (0, 12, 24)
    assert time.monotonic() - started < 20
    assert not [n for n in notes if "benched" in n], notes


# ------------------------------------------------------------------------------------ a deployment down


def test_every_endpoint_down_ends_the_run_after_the_outage_budget_keeping_its_rows(layout: DataLayout) -> None:
    prompts = _prompts(30)
    fake = FakeConfig(token_rate=20000, median_tokens=30, outage_after=6)  # 503 from the 7th chat request on
    started = time.monotonic()
    with FakeServerProcess(fake) as failing:
        config = _config(failing.base_url, max_attempts=1000, bench_s=0.2, outage_budget_s=2.0)
        with pytest.raises(OutageError) as caught:
            _bounded(lambda: generate_partition(prompts, KEY, layout, config, log=lambda _m: None), 60)
    text = str(caught.value)
    assert "EAGLE3_OUTAGE_BUDGET_S" in text and "HTTP 503" in text and "left to do" in text, text
    assert time.monotonic() - started < 30
    journaled = read_journal(layout.responses_in_progress_path(KEY)).records
    assert {r["status"] for r in journaled.values()} == {"ok"} and 1 <= len(journaled) <= 6
    assert not layout.responses_path(KEY).exists()  # nothing published

    with FakeServerProcess(FakeConfig(token_rate=20000, median_tokens=30)) as honest:
        again = generate_partition(prompts, KEY, layout, _config(honest.base_url), log=lambda _m: None)
    assert (again.ok, again.resumed) == (30, len(journaled))


def test_the_outage_budget_is_a_setting() -> None:
    from eagle3_assets.defs.inference import RemoteVLLMResource

    resource = RemoteVLLMResource.from_env({"EAGLE3_OUTAGE_BUDGET_S": "2.5"})
    assert resource.generation_config().outage_budget_s == 2.5


def test_a_5xx_benches_but_a_malformed_reply_does_not() -> None:
    from eagle3_assets.generation.errors import RequestFailed

    pool = EndpointPool(["http://a/v1"], cap=4, bench_after_failures=2)
    for failure in (RequestFailed("reply field x is a list", True), RequestFailed("HTTP 429", True, 429)):
        for _ in range(3):
            pool.release(pool.acquire(), server_failure=failure.outage)  # type: ignore[arg-type]
    assert not pool.endpoints[0].benched and pool.down_for() == 0
    for _ in range(2):
        pool.release(pool.acquire(), server_failure=RequestFailed("HTTP 503", True, 503).outage)  # type: ignore[arg-type]
    assert pool.endpoints[0].benched and pool.down_since is not None


# ------------------------------------------------------------------------------------ /metrics that lies


@pytest.mark.parametrize("lie", ["nan", "huge"])
def test_lying_load_gauges_are_no_reading_and_the_run_finishes(lie: str, layout: DataLayout) -> None:
    fake = FakeConfig(token_rate=20000, median_tokens=30, max_num_seqs=4, metrics_lie=lie)
    with FakeServerProcess(fake) as server:
        config = _config(server.base_url, capacity_poll_s=0.05)
        # before: NaN made round() raise in the poller (the run failed); 1e9 waiting held the cap at 0 forever
        result = _bounded(lambda: generate_partition(_prompts(20), KEY, layout, config, log=lambda _m: None), 60)
    assert (result.ok, result.failed) == (20, 0)
    assert set(pl.read_parquet(layout.responses_path(KEY))["status"]) == {"ok"}


def test_parse_load_refuses_nan_negative_and_absurd_values() -> None:
    page = 'vllm:num_requests_running{{engine="0"}} {r}\nvllm:num_requests_waiting{{engine="0"}} {w}\n'
    assert parse_load(page.format(r="3.0", w="1.0")) is not None
    for running, waiting in (("NaN", "0"), ("-50", "0"), ("2", "1e9"), ("inf", "0")):
        assert parse_load(page.format(r=running, w=waiting)) is None, (running, waiting)


def test_a_failing_poller_never_fails_the_run(layout: DataLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    real = CapacityMonitor.poll_once
    calls = {"n": 0}

    async def poll_once(self: CapacityMonitor) -> None:
        calls["n"] += 1
        if calls["n"] > 1:
            raise ValueError("cannot convert float NaN to integer")  # what a NaN gauge did in round()
        await real(self)

    monkeypatch.setattr(CapacityMonitor, "poll_once", poll_once)
    with FakeServerProcess(FakeConfig(token_rate=2000, median_tokens=30, max_num_seqs=4)) as server:
        config = _config(server.base_url, capacity_poll_s=0.02)
        result = generate_partition(_prompts(20), KEY, layout, config, log=lambda _m: None)
    assert (result.ok, result.failed) == (20, 0) and calls["n"] > 1


def test_partitions_wait_in_key_order_per_server_not_globally(tmp_path: Path) -> None:
    """A lower key waiting for room on busy server A does not hold a higher key off idle server B."""
    fake = FakeConfig(token_rate=20000, median_tokens=30, max_num_seqs=8)
    with serve_in_thread(fake) as url_a, serve_in_thread(fake) as url_b:

        async def run() -> int:
            low_pool = EndpointPool([url_a], cap=8)
            high_pool = EndpointPool([url_b], cap=8)
            low = CapacityMonitor(
                _config(url_a, concurrency=8), low_pool.endpoints, lambda: None, lambda _m: None,
                line=PartitionLine(tmp_path, "00001"),
            )  # fmt: skip
            high = CapacityMonitor(
                _config(url_b, concurrency=8), high_pool.endpoints, lambda: None, lambda _m: None,
                line=PartitionLine(tmp_path, "00002"),
            )  # fmt: skip
            await low.start()  # 00001 has samples and waits (in the line) for room on A
            await high.start()
            await asyncio.sleep(0.5)
            cap = high_pool.endpoints[0].cap
            await high.close()
            await low.close()
            return cap

        cap = asyncio.run(run())
    assert cap == 8, cap  # before: 0 (00002 waited behind 00001, which wanted room on another server)
