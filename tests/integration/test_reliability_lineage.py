"""Issue 14: every response row answers the current prompt under the current settings (docs/reliability.md).

Each test is one scenario of the issue's list that gave silently wrong training data before request
fingerprints, data versions and blocking checks: it fails on that code and passes now.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from eagle3_assets.core import hashing, storage
from eagle3_assets.core.settings import ConfigError
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.generation import GenerationConfig, PromptToGenerate, generate_partition, partition_prompts
from eagle3_assets.generation.fingerprint import (
    FINGERPRINT_COLUMN,
    STALE_PROMPT,
    STALE_SETTINGS,
    STALE_UNFINGERPRINTED,
)
from eagle3_assets.prompts import prompt_table
from fake_vllm import FakeConfig, FakeServerProcess
from support.common import make_resources, write_jsonl

KEY = "00000"
N = 12


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServerProcess]:
    with FakeServerProcess(FakeConfig(token_rate=20000, median_tokens=20)) as running:
        yield running


def make_prompts(n: int = N, edit: dict[int, str] | None = None) -> list[PromptToGenerate]:
    edit = edit or {}
    return [
        PromptToGenerate(f"fp-{i:03d}", [{"role": "user", "content": edit.get(i, f"fingerprint question {i}")}])
        for i in range(n)
    ]


def config(url: str, **overrides: object) -> GenerationConfig:
    values: dict[str, object] = dict(base_urls=[url], model="fake-model", concurrency=8, max_tokens=2000)
    values.update(overrides)
    return GenerationConfig(**values)  # type: ignore[arg-type]


def run(layout: DataLayout, url: str, prompt_list: list[PromptToGenerate] | None = None, **overrides: object):
    return generate_partition(prompt_list or make_prompts(), KEY, layout, config(url, **overrides), log=lambda _m: None)


def test_a_prompt_edited_under_the_same_id_is_answered_again(layout: DataLayout, server: FakeServerProcess) -> None:
    run(layout, server.base_url)
    edited = make_prompts(edit={3: "a different question under the same id"})
    result = run(layout, server.base_url, edited)
    assert (result.requested, result.resumed) == (1, N - 1)
    assert (result.stale, result.stale_reasons) == (1, {STALE_PROMPT: 1})
    row = pl.read_parquet(layout.responses_path(KEY)).filter(pl.col("sample_id") == "fp-003").row(0, named=True)
    assert row["messages"][0]["content"] == "a different question under the same id"


def test_raised_max_tokens_regenerates_every_row(layout: DataLayout, server: FakeServerProcess) -> None:
    run(layout, server.base_url, max_tokens=2000)
    result = run(layout, server.base_url, max_tokens=4000)
    assert (result.requested, result.resumed) == (N, 0)
    assert (result.stale, result.stale_reasons) == (N, {STALE_SETTINGS: N})
    params = pl.read_parquet(layout.responses_path(KEY))["sampling_params"].unique().to_list()
    assert [json.loads(p)["max_tokens"] for p in params] == [4000]
    # unchanged settings: nothing is requested again
    assert run(layout, server.base_url, max_tokens=4000).requested == 0
    # back to the first settings: their answers were kept aside and are reused as they were, nothing is mixed
    back = run(layout, server.base_url, max_tokens=2000)
    assert (back.requested, back.resumed) == (0, N)
    params = pl.read_parquet(layout.responses_path(KEY))["sampling_params"].unique().to_list()
    assert [json.loads(p)["max_tokens"] for p in params] == [2000]


def test_a_run_killed_and_resumed_with_other_settings_never_mixes_two_settings(
    layout: DataLayout, server: FakeServerProcess
) -> None:
    """The journal of an interrupted run at temperature 0.2, resumed at 0.9: every row is answered at 0.9."""
    run(layout, server.base_url, temperature=0.2)
    frame = pl.read_parquet(layout.responses_path(KEY))
    journal = layout.responses_in_progress_path(KEY)
    journal.parent.mkdir(parents=True, exist_ok=True)
    journal.write_text("".join(json.dumps(row) + "\n" for row in frame.head(N // 2).to_dicts()))
    layout.responses_path(KEY).unlink()  # the interrupted run never wrote its Parquet
    result = run(layout, server.base_url, temperature=0.9)
    params = pl.read_parquet(layout.responses_path(KEY))["sampling_params"].unique().to_list()
    assert [json.loads(p).get("temperature") for p in params] == [0.9]
    assert (result.requested, result.resumed, result.stale) == (N, 0, N // 2)


def test_other_weights_under_the_same_served_name_are_answered_again(
    layout: DataLayout, server: FakeServerProcess
) -> None:
    run(layout, server.base_url, model_revision="content:aaaa")
    assert run(layout, server.base_url, model_revision="content:aaaa").requested == 0
    result = run(layout, server.base_url, model_revision="content:bbbb")  # e.g. a fine-tuned folder, same name
    assert (result.requested, result.stale_reasons) == (N, {STALE_SETTINGS: N})
    assert storage.read_json(layout.responses_manifest_path(KEY))["request"]["model_revision"] == "content:bbbb"


def test_rows_written_before_fingerprints_are_stale(layout: DataLayout, server: FakeServerProcess) -> None:
    run(layout, server.base_url)
    path = layout.responses_path(KEY)
    pl.read_parquet(path).drop(FINGERPRINT_COLUMN).write_parquet(path)  # a file of the previous layout
    result = run(layout, server.base_url)
    assert result.requested == N
    assert result.stale_reasons == {STALE_UNFINGERPRINTED: N}
    assert pl.read_parquet(path)[FINGERPRINT_COLUMN].null_count() == 0


def test_the_manifest_records_what_produced_the_partition(layout: DataLayout, server: FakeServerProcess) -> None:
    result = run(layout, server.base_url, temperature=0.3, seed=5)
    manifest = storage.read_json(layout.responses_manifest_path(KEY))
    assert manifest["request"]["model"] == "fake-model"
    assert manifest["request"]["sampling_params"] == {"max_tokens": 2000, "temperature": 0.3, "seed": 5}
    assert manifest["settings_digest"] == result.settings_digest
    assert manifest["data_version"] == result.data_version == hashing.file_digest(result.path)
    assert pl.read_parquet(result.path)[FINGERPRINT_COLUMN].n_unique() == N  # one request per prompt


# ------------------------------------------------------------------- half-full partitions, status, backfill


def _dataset(path: Path, count: int) -> Path:
    return write_jsonl(path, [{"id": f"s{i}", "prompt": f"half-full question {i}"} for i in range(count)])


def test_prompts_appended_to_a_half_full_partition_are_reported_and_planned(
    tmp_path: Path, layout: DataLayout, server: FakeServerProcess, instance: dg.DagsterInstance
) -> None:
    from eagle3_assets.operations import backfill, status

    dataset = _dataset(tmp_path / "prompts.jsonl", 15)
    prompt_table.build_prompt_table(dataset, layout, partition_size=10)  # 00000 full, 00001 half full
    instance.add_dynamic_partitions("prompt_partitions", ["00000", "00001"])
    for key in ("00000", "00001"):
        generate_partition(partition_prompts(layout, key), key, layout, config(server.base_url), log=lambda _m: None)
        instance.report_runless_asset_event(dg.AssetMaterialization("synthetic_responses", partition=key))
    assert backfill.plan_missing(instance, downstream=False, layout=layout).targets["synthetic_responses"] == []

    _dataset(dataset, 18)  # three prompts appended: they land in the half-full 00001, no new partition key
    table = prompt_table.build_prompt_table(dataset, layout, partition_size=10)
    assert table.partition_keys == ["00000", "00001"]

    plan = backfill.plan_missing(instance, downstream=False, layout=layout)
    assert plan.targets["synthetic_responses"] == ["00001"]
    assert "3 new" in plan.stale["00001"] and "3 new" in plan.describe()
    rows = {(r.asset, r.partition_key): r for r in status.partition_table(instance, layout)}
    assert "3 new" in rows[("synthetic_responses", "00001")].stale
    assert rows[("synthetic_responses", "00000")].stale == ""
    assert "PROMPTS CHANGED" in status.render(list(rows.values()))

    # generating the partition again answers the new prompts and the partition is current
    result = generate_partition(partition_prompts(layout, "00001"), "00001", layout, config(server.base_url))
    assert (result.total, result.requested, result.resumed) == (8, 3, 5)
    assert backfill.plan_missing(instance, downstream=False, layout=layout).stale == {}


def test_sync_does_not_record_a_partition_whose_prompts_were_edited(
    tmp_path: Path, layout: DataLayout, server: FakeServerProcess, instance: dg.DagsterInstance
) -> None:
    from eagle3_assets.operations.sync import validate_responses

    dataset = write_jsonl(tmp_path / "p.jsonl", [{"id": f"s{i}", "prompt": f"q {i}"} for i in range(5)])
    prompt_table.build_prompt_table(dataset, layout, partition_size=10)
    generate_partition(partition_prompts(layout, KEY), KEY, layout, config(server.base_url), log=lambda _m: None)
    ids = [p.sample_id for p in partition_prompts(layout, KEY)]
    assert validate_responses(layout, KEY, ids).valid
    write_jsonl(dataset, [{"id": f"s{i}", "prompt": "edited" if i == 2 else f"q {i}"} for i in range(5)])
    prompt_table.build_prompt_table(dataset, layout, partition_size=10)
    verdict = validate_responses(layout, KEY, ids)  # same ids: an id-only comparison accepted it
    assert not verdict.valid and "1 edited" in verdict.reason


def test_partition_size_change_is_refused_while_a_partition_exists_only_as_a_journal(
    tmp_path: Path, layout: DataLayout
) -> None:
    dataset = _dataset(tmp_path / "prompts.jsonl", 15)
    prompt_table.build_prompt_table(dataset, layout, partition_size=10)
    journal = layout.responses_in_progress_path("00000")
    journal.parent.mkdir(parents=True)
    journal.write_text(json.dumps({"sample_id": "s0", "status": "ok"}) + "\n")  # generation under way, no Parquet
    with pytest.raises(ConfigError, match=r"EAGLE3_PARTITION_SIZE=5: .* partitioned with 10 .* 00000"):
        prompt_table.build_prompt_table(dataset, layout, partition_size=5)
    assert pl.read_parquet(layout.prompts_path)["partition_key"].max() == "00001"  # nothing re-keyed


# ------------------------------------------------------------------------- Dagster: versions, blocking checks


def test_responses_report_a_data_version_and_failed_checks_block_downstream(
    tmp_path: Path, layout: DataLayout, instance: dg.DagsterInstance
) -> None:
    """A partition over the error-rate limit fails its step: hidden_states of it never starts, and the partition
    is not recorded as materialized-and-passing (a missing-only backfill plans it again)."""
    from eagle3_assets.defs.hidden_states import hidden_states
    from eagle3_assets.defs.inference import RemoteVLLMResource
    from eagle3_assets.defs.prompts import raw_prompts
    from eagle3_assets.defs.resources import VerifierResource
    from eagle3_assets.defs.responses import synthetic_responses

    assert all(spec.blocking for spec in synthetic_responses.check_specs)
    assert all(spec.blocking for spec in hidden_states.check_specs)
    assert synthetic_responses.code_versions_by_key[synthetic_responses.key]
    assert hidden_states.code_versions_by_key[hidden_states.key]

    dataset = write_jsonl(tmp_path / "p.jsonl", [{"id": f"s{i}", "prompt": f"q {i}"} for i in range(6)])
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    (verifier / "config.json").write_text("{}")
    with FakeServerProcess(FakeConfig(token_rate=20000, median_tokens=20, faults={"error_500": 0.5})) as flaky:
        server = RemoteVLLMResource(base_url=flaky.base_url, concurrency=4, max_attempts=1, request_timeout_s=5)
        resources = make_resources(
            layout, dataset, partition_size=10, inference_server=server, verifier=VerifierResource(path=str(verifier))
        )
        assert dg.materialize([raw_prompts], instance=instance, resources=resources).success
        result = dg.materialize(
            [raw_prompts, synthetic_responses, hidden_states],
            selection=[synthetic_responses, hidden_states],
            partition_key=KEY,
            instance=instance,
            resources=resources,
            raise_on_error=False,
            run_config={"ops": {"synthetic_responses": {"config": {"max_error_rate": 0.0}}}},
        )
    assert not result.success
    started = {e.step_key for e in result.all_events if e.event_type_value == "STEP_START"}
    assert started == {"synthetic_responses"}  # hidden_states never ran on the failed partition
    event = instance.get_latest_materialization_event(synthetic_responses.key)
    assert event is not None and event.asset_materialization is not None
    assert event.asset_materialization.tags["dagster/data_version"] == hashing.file_digest(layout.responses_path(KEY))
    from eagle3_assets.core.lineage import PartitionLineage

    recorded = PartitionLineage.load(layout, "synthetic_responses", KEY)
    assert recorded is not None and not recorded.checks_passed
    from eagle3_assets.operations import backfill

    plan = backfill.plan_missing(instance, layout=layout)  # Dagster counts it materialized: planned for its checks
    assert plan.status["synthetic_responses"][KEY] == "materialized"
    assert plan.targets["synthetic_responses"] == [KEY]
    assert plan.stale[KEY] == "checks failed: responses_error_rate", (plan.status, plan.stale)
    from eagle3_assets.operations import status

    rows = {(r.asset, r.partition_key): r for r in status.partition_table(instance, layout)}
    assert rows["synthetic_responses", KEY].stale == "checks failed: responses_error_rate"


def test_without_a_configured_model_a_complete_partition_needs_no_server(
    layout: DataLayout, server: FakeServerProcess
) -> None:
    """The model is part of every fingerprint; unconfigured, the server names it. With no server answering, the
    model the manifest recorded stands in: a partition current under it completes, anything to generate fails."""
    run(layout, server.base_url, model=None)
    dead = "http://127.0.0.1:9/v1"
    quick = {"model": None, "max_attempts": 1, "connect_timeout_s": 1.0}
    assert run(layout, dead, **quick).requested == 0
    with pytest.raises(RuntimeError, match="could not find the served model"):
        run(layout, dead, make_prompts(edit={0: "edited"}), **quick)


def test_hidden_states_are_marked_stale_when_their_responses_change(
    tmp_path: Path, layout: DataLayout, instance: dg.DagsterInstance
) -> None:
    """What the UI shows: after a partition's responses are generated again (an edited prompt), Dagster's stale
        status of that hidden_states partition is STALE (the responses' data version changed); the other partition's
    responses materialized again unchanged keep their data version, so its hidden states stay FRESH."""
    from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
    from dagster._core.loader import LoadingContextForTest

    from eagle3_assets.defs.hidden_states import hidden_states
    from eagle3_assets.defs.inference import RemoteVLLMResource
    from eagle3_assets.defs.prompts import raw_prompts
    from eagle3_assets.defs.resources import VerifierResource
    from eagle3_assets.defs.responses import synthetic_responses
    from support.hidden_states_data import cached_tiny_verifier

    rows = [{"id": f"s{i}", "prompt": f"stale question {i}"} for i in range(6)]
    dataset = write_jsonl(tmp_path / "p.jsonl", rows)
    assets = [raw_prompts, synthetic_responses, hidden_states]
    with FakeServerProcess(FakeConfig(token_rate=20000, median_tokens=20)) as fake:
        resources = make_resources(
            layout,
            dataset,
            partition_size=3,
            # the fake server's token ids are not the tiny verifier's: hidden states render the text instead
            inference_server=RemoteVLLMResource(base_url=fake.base_url, concurrency=4, return_token_ids=False),
            verifier=VerifierResource(path=str(cached_tiny_verifier()), layer_ids="1,2,3"),
        )

        def materialize(*selection: dg.AssetsDefinition, partition: str | None = None) -> None:
            result = dg.materialize(
                assets, selection=list(selection), partition_key=partition, instance=instance, resources=resources
            )
            assert result.success

        materialize(raw_prompts)
        for key in ("00000", "00001"):
            materialize(synthetic_responses, hidden_states, partition=key)

        def status(key: str) -> StaleStatus:
            graph = dg.Definitions(assets=assets, resources=resources).resolve_asset_graph()
            resolver = CachingStaleStatusResolver(instance, graph, LoadingContextForTest(instance))
            return resolver.get_status(hidden_states.key, key)

        assert (status("00000"), status("00001")) == (StaleStatus.FRESH, StaleStatus.FRESH)
        write_jsonl(dataset, [{**r, "prompt": "edited"} if r["id"] == "s1" else r for r in rows])
        materialize(raw_prompts)
        materialize(synthetic_responses, partition="00000")
        materialize(synthetic_responses, partition="00001")  # nothing changed: same content, same data version
    assert (status("00000"), status("00001")) == (StaleStatus.STALE, StaleStatus.FRESH)


@pytest.mark.parametrize("regenerate", ["last-turn", "all-turns"])
def test_a_rerun_whose_failures_fail_alike_leaves_the_partition_and_its_data_version_as_they_were(
    layout: DataLayout, regenerate: str
) -> None:
    """A prompt over the model's context fails with the same 400 on every run. Its retry once rewrote the row (a new
    finished_at), so the partition's data version changed, hidden_states got a new lineage and a finished draft
    retrained from scratch on a re-run of the finished pipeline (demo-real's re-run at 764236e: its 66-minute draft)."""
    prompts = make_prompts(4, edit={2: "a question far too long for the context " * 40})
    with FakeServerProcess(FakeConfig(token_rate=20000, median_tokens=20, max_model_len=64)) as small:
        first = run(layout, small.base_url, prompts, regenerate=regenerate)
        written = layout.responses_path(KEY).read_bytes()
        again = run(layout, small.base_url, prompts, regenerate=regenerate)
    assert (first.ok, first.failed) == (3, 1) and (again.requested, again.ok, again.failed) == (1, 3, 1)
    assert again.data_version == first.data_version
    assert layout.responses_path(KEY).read_bytes() == written
    assert hashing.file_digest(layout.responses_path(KEY)) == first.data_version


def test_a_retry_that_ends_otherwise_or_answers_another_prompt_is_a_new_row(layout: DataLayout) -> None:
    """The earlier failed row is kept only for a retry that fails alike, to the same request."""
    long = "a question far too long for the context " * 40
    prompts = make_prompts(4, edit={2: long})
    with FakeServerProcess(FakeConfig(token_rate=20000, median_tokens=20, max_model_len=64)) as small:
        first = run(layout, small.base_url, prompts)
        failed = pl.read_parquet(layout.responses_path(KEY)).filter(pl.col("sample_id") == "fp-002")
        edited = run(layout, small.base_url, make_prompts(4, edit={2: long + "edited"}))  # still too long
    row = pl.read_parquet(layout.responses_path(KEY)).filter(pl.col("sample_id") == "fp-002").row(0, named=True)
    assert edited.failed == 1 and edited.data_version != first.data_version
    assert row["messages"][0]["content"].endswith("edited") and row["finished_at"] != failed["finished_at"][0]
    with FakeServerProcess(FakeConfig(token_rate=20000, median_tokens=20, max_model_len=4096)) as large:
        answered = run(layout, large.base_url, make_prompts(4, edit={2: long + "edited"}))
    assert (answered.requested, answered.ok, answered.failed) == (1, 4, 0)
