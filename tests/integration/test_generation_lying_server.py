"""A server that lies gets failed rows, never a stuck partition (issue 14, item 3).

- a 200 whose fields have the wrong type (a list as ``content``, an object as ``reasoning``, usage counts as
  strings) is a retryable failure naming the field; it never reaches the journal as an ok row;
- a key refused (401/403) in the middle of a run stops the run: the samples left stay unrequested (no failed
  rows), the partition is not written and the asset fails, so nothing is marked materialized;
- an exception in one sample's bookkeeping fails that sample, never the pool, and never hangs the run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import polars as pl
import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.defs.inference import RemoteVLLMResource
from eagle3_assets.defs.prompts import raw_prompts
from eagle3_assets.generation import GenerationConfig, PromptToGenerate, generate_partition
from eagle3_assets.generation.engine import Engine
from eagle3_assets.generation.journal import Journal, read_journal
from eagle3_assets.generation.replies import Completion
from fake_vllm import FakeConfig, FakeServerProcess, serve_in_thread
from support.common import error_chain, make_resources, materialize_responses, write_jsonl
from support.reliability import quick_config

KEY = "00000"
# the field each lying fault gets wrong, as the failed row's error names it (stream: choices[0].delta...)
LIES = {
    "content_list": "choices[0].{part}.content",
    "reasoning_object": "choices[0].{part}.reasoning",
    "usage_strings": "usage.prompt_tokens",
}

# a hang (an in-flight slot never given back) fails the test instead of blocking the suite; the thread method, since
# a signal handler's exception can be swallowed by the event loop's tasks
pytestmark = pytest.mark.timeout(120, method="thread")


def _prompts(n: int, tag: str = "q") -> list[PromptToGenerate]:
    return [PromptToGenerate(f"{tag}-{i:03d}", [{"role": "user", "content": f"{tag} question {i}"}]) for i in range(n)]


def _config(url: str, **overrides: Any) -> GenerationConfig:
    """quick_config with few requests in flight, two attempts, and the core's connect timeout, benching and fsync."""
    core = GenerationConfig(base_urls=[url])
    values: dict[str, Any] = dict(
        model="fake-model", concurrency=4, max_tokens=200, max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.05,
        progress_interval_s=60.0, connect_timeout_s=core.connect_timeout_s,
        bench_after_failures=core.bench_after_failures, fsync_interval_s=core.fsync_interval_s,
    )  # fmt: skip
    return quick_config(url, **{**values, **overrides})


def _ids(fault: str) -> bool:
    # Usage counts as strings without token ids: with ids, a count that is not an int also disagrees with the ids'
    # length and fails for that reason; without them it reached the row (and the run's counters) unchecked.
    return fault != "usage_strings"


@pytest.fixture(scope="module")
def honest() -> Iterator[FakeServerProcess]:
    with FakeServerProcess(FakeConfig(token_rate=20000, median_tokens=30, stream_interval_s=0.002)) as server:
        yield server


# ------------------------------------------------------------------------------------ wrong types


@pytest.mark.parametrize("transport", ["aiohttp", "openai"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("fault", sorted(LIES))
def test_a_reply_with_a_wrong_type_is_a_failed_row_naming_the_field(
    fault: str, stream: bool, transport: str, layout: DataLayout, honest: FakeServerProcess
) -> None:
    prompts = _prompts(12)
    fake = FakeConfig(token_rate=20000, median_tokens=30, stream_interval_s=0.002, faults={fault: 1.0})
    with FakeServerProcess(fake) as liar:
        config = _config(liar.base_url, stream=stream, transport=transport, return_token_ids=_ids(fault))
        result = generate_partition(prompts, KEY, layout, config, log=lambda _m: None)
    assert (result.ok, result.failed, result.requests) == (0, 12, 24)  # retried (max_attempts=2), then failed
    frame = pl.read_parquet(layout.responses_path(KEY))
    field = LIES[fault].format(part="delta" if stream else "message")
    assert all(e.startswith(f"gave up after 2 attempts; last error: reply field {field} is a") for e in frame["error"])
    assert frame["content"].null_count() == 12 and frame["prompt_tokens"].null_count() == 12

    # not stuck: the next run against an honest server regenerates every sample and writes the partition
    again = generate_partition(prompts, KEY, layout, _config(honest.base_url, stream=stream), log=lambda _m: None)
    assert (again.ok, again.failed, again.requested) == (12, 0, 12)
    assert set(pl.read_parquet(layout.responses_path(KEY))["status"]) == {"ok"}


@pytest.mark.parametrize("fault", sorted(LIES))
def test_an_occasional_lie_is_retried_into_an_ok_row(fault: str, layout: DataLayout) -> None:
    fake = FakeConfig(token_rate=20000, median_tokens=30, faults={fault: 0.3})
    with FakeServerProcess(fake) as liar:
        config = _config(liar.base_url, max_attempts=8, return_token_ids=_ids(fault))
        result = generate_partition(_prompts(40), KEY, layout, config, log=print)
        outcomes = liar.stats()["outcomes"]
    assert outcomes.get(fault, 0) > 0, outcomes
    assert (result.ok, result.failed) == (40, 0) and result.retries >= outcomes[fault]
    frame = pl.read_parquet(layout.responses_path(KEY))
    assert frame["content"].null_count() == 0 and frame["prompt_tokens"].null_count() == 0


# ------------------------------------------------------------------------------------ 401/403 mid-run


@pytest.mark.parametrize("transport", ["aiohttp", "openai"])
@pytest.mark.parametrize("status", [401, 403])
def test_a_key_refused_mid_run_stops_the_run_and_leaves_the_rest_unrequested(
    status: int, transport: str, layout: DataLayout, honest: FakeServerProcess
) -> None:
    prompts = _prompts(40)
    fake = FakeConfig(token_rate=20000, median_tokens=30, revoke_after=10, revoke_status=status)
    with FakeServerProcess(fake) as revoking:
        with pytest.raises(RuntimeError, match=f"refused the API key mid-run \\(HTTP {status}") as caught:
            generate_partition(prompts, KEY, layout, _config(revoking.base_url, transport=transport), log=print)
        requests = revoking.stats()["total_requests"]
    assert "EAGLE3_API_KEY" in str(caught.value) and "not requested" in str(caught.value)
    assert requests < 10 + 4 + 1, requests  # the samples in flight at most, not one request per sample left
    assert not layout.responses_path(KEY).exists()  # the partition is not written
    journaled = read_journal(layout.responses_in_progress_path(KEY)).records
    assert len(journaled) <= 10 and {r["status"] for r in journaled.values()} <= {"ok"}  # no failed rows

    # once the key works again, the finished samples are kept and only the rest is requested
    result = generate_partition(prompts, KEY, layout, _config(honest.base_url), log=lambda _m: None)
    assert (result.ok, result.resumed, result.requested) == (40, len(journaled), 40 - len(journaled))


def test_a_key_refused_mid_run_fails_the_asset_so_nothing_is_materialized(
    tmp_path: Path, layout: DataLayout, instance: dg.DagsterInstance
) -> None:
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"id": f"s{i}", "prompt": f"question {i}"} for i in range(30)])
    with serve_in_thread(FakeConfig(token_rate=20000, median_tokens=30, revoke_after=5, revoke_status=403)) as url:
        server = RemoteVLLMResource(base_url=url, concurrency=4)
        resources = make_resources(layout, dataset, partition_size=30, inference_server=server)
        assert dg.materialize([raw_prompts], instance=instance, resources=resources).success
        with pytest.raises(Exception) as caught:
            materialize_responses(
                KEY,
                instance,
                resources,
            )
    assert "refused the API key mid-run (HTTP 403" in error_chain(caught.value)
    assert instance.get_latest_materialization_event(dg.AssetKey("synthetic_responses")) is None
    assert not layout.responses_path(KEY).exists()


# ------------------------------------------------------------------------------------ bookkeeping


def test_a_record_the_journal_refuses_fails_that_sample_not_the_run(
    layout: DataLayout, honest: FakeServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_append = Journal.append

    def append(self: Journal, record: dict[str, Any]) -> None:
        if record["sample_id"] == "q-007" and record["status"] == "ok":
            raise ValueError("cannot serialize this record")
        real_append(self, record)

    monkeypatch.setattr(Journal, "append", append)
    result = generate_partition(_prompts(20), KEY, layout, _config(honest.base_url), log=lambda _m: None)
    assert (result.ok, result.failed, result.total) == (19, 1, 20)
    failed = pl.read_parquet(layout.responses_path(KEY)).filter(pl.col("status") == "failed").row(0, named=True)
    assert failed["sample_id"] == "q-007"
    assert failed["error"] == "the reply could not be journaled: ValueError: cannot serialize this record"


class _BuggyTransport:
    """Answers every request; for one sample with a Completion of the wrong types (a transport's bug)."""

    url = "http://127.0.0.1:9/v1"

    async def complete(self, body: bytes, *, stream: bool, deadline_s: float) -> Completion:
        await asyncio.sleep(0.001)
        if b"question 3" in body:
            return Completion("r", "c", "stop", "12", 5, "fake-model")  # type: ignore[arg-type]
        return Completion("r", "c", "stop", 12, 5, "fake-model")


def test_an_exception_in_bookkeeping_fails_one_sample_and_never_hangs_the_run() -> None:
    records: list[dict[str, Any]] = []
    config = _config(_BuggyTransport.url)
    engine = Engine(
        config,
        "fake-model",
        {_BuggyTransport.url: _BuggyTransport()},  # type: ignore[dict-item]
        records.append,
        partition_key=KEY,
        log=lambda _m: None,
    )

    async def run() -> Any:
        async with asyncio.timeout(20):  # before: the slot was never given back and the run waited forever
            return await engine.run(_prompts(10))

    stats = asyncio.run(run())
    assert (stats.ok, stats.failed, stats.finished) == (9, 1, 10) and engine._in_flight == 0
    (bad,) = [r for r in records if r["status"] == "failed"]
    assert bad["sample_id"] == "q-003" and "prompt_tokens" in bad["error"]
    assert stats.prompt_tokens == 9 * 12
