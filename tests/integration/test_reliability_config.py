"""Issue 8, bad configuration: a clear error naming the key, before any request is sent or any file written.
(GenerationConfig's field validation is covered by tests/unit/test_generation_units.py::test_config_rejects_bad_values_
naming_the_field and ::test_config_rejects_bad_urls; partition size 0 through Dagster by
tests/integration/test_raw_prompts_asset.py::test_bad_partition_size_fails_naming_the_key.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets.core import settings
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.defs.inference import RemoteVLLMResource
from eagle3_assets.defs.prompts import raw_prompts
from eagle3_assets.generation import generate_partition
from fake_vllm import FakeConfig, get_json, serve_in_thread
from support.common import child_env, error_chain, make_resources, materialize_responses, write_jsonl
from support.reliability import closed_port_url, make_prompts, quick_config


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("EAGLE3_PARTITION_SIZE", "0", "must be a positive integer"),
        ("EAGLE3_PARTITION_SIZE", "-5", "must be a positive integer"),
        ("EAGLE3_PARTITION_SIZE", "1.5", "must be a positive integer"),
        ("EAGLE3_CONCURRENCY", "0", "must be a positive integer"),
        ("EAGLE3_CONCURRENCY", "-1", "must be a positive integer"),
        ("EAGLE3_VLLM_BASE_URL", "localhost:8000", "is not an http(s) URL"),
        ("EAGLE3_VLLM_BASE_URL", "ftp://host/v1", "is not an http(s) URL"),
        ("EAGLE3_VLLM_BASE_URL", " , ", "needs at least one http(s) URL"),
        ("EAGLE3_VLLM_BASE_URL", "http://a:1/v1,http://a:1/v1/", "lists the same URL twice"),
        ("EAGLE3_MAX_REJECT_SHARE", "2", "between 0 and 1"),
        ("EAGLE3_REQUEST_TIMEOUT_S", "nan", "must be a positive number"),
        ("EAGLE3_STREAM", "maybe", "must be true or false"),
        ("EAGLE3_TEMPERATURE", "-1", "must be a number >= 0 (or empty)"),
        ("EAGLE3_TRANSPORT", "pigeon", "must be 'openai' or 'aiohttp'"),
        ("EAGLE3_EXTRA_BODY", "[1]", "must be a JSON object"),
        ("EAGLE3_LAYER_IDS", "1,x", "comma-separated integers"),
        ("EAGLE3_DATA_DIR", "  ", "must not be empty"),
        ("EAGLE3_REQUEST_TIMEOUT_S", "inf", "must be a positive number"),
        ("EAGLE3_HIDDEN_STATES_BACKEND", "trt", "must be 'hf' or 'vllm'"),
        ("EAGLE3_DEVICE", "gpu0", "must be auto, cpu, cuda or cuda:N"),
        ("EAGLE3_HIDDEN_STATES_URL", "hs-0:8000", "is not an http"),
        ("EAGLE3_TRAIN_PROCS", "0", "must be a positive integer"),
    ],
)
def test_bad_environment_values_name_the_key(key: str, value: str, why: str) -> None:
    from eagle3_assets.environment import env_value

    with pytest.raises(settings.ConfigError) as raised:
        env_value(key, {key: value})
    assert str(raised.value).startswith(f"{key}={value!r}: ") and why in str(raised.value)


def test_negative_partition_size_fails_raw_prompts_before_writing(
    tmp_path: Path, layout: DataLayout, instance: dg.DagsterInstance
) -> None:
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(3)])
    with pytest.raises(settings.ConfigError, match="EAGLE3_PARTITION_SIZE=-5: must be a positive integer"):
        make_resources(layout, dataset, partition_size=-5)
    result = dg.materialize(  # the same value from the launchpad fails the run with the same message
        [raw_prompts],
        instance=instance,
        raise_on_error=False,
        resources=make_resources(layout, dataset),
        run_config={"resources": {"prompt_dataset": {"config": {"partition_size": -5}}}},
    )
    assert not result.success
    assert "EAGLE3_PARTITION_SIZE=-5: must be a positive integer" in _failure_text(result)
    assert not layout.root.exists()  # nothing written


def _failure_text(result: dg.ExecuteInProcessResult) -> str:
    texts = []
    for event in result.all_events:
        data = event.event_specific_data
        error = getattr(data, "error", None)
        if error is not None:
            texts.append(error.to_string())
    return "\n".join(texts)


BAD_INFERENCE_SETTINGS = [
    ({"concurrency": 0}, "EAGLE3_CONCURRENCY=0: must be a positive integer"),
    ({"concurrency": -3}, "EAGLE3_CONCURRENCY=-3: must be a positive integer"),
    ({"base_url": "localhost:8000"}, "EAGLE3_VLLM_BASE_URL='localhost:8000': 'localhost:8000' is not an http(s)"),
    ({"max_tokens": 0}, "EAGLE3_MAX_TOKENS=0: must be a positive integer"),
    ({"transport": "carrier-pigeon"}, "EAGLE3_TRANSPORT='carrier-pigeon'"),
    ({"extra_body_json": "{not json"}, "EAGLE3_EXTRA_BODY='{not json': invalid JSON"),
]


@pytest.mark.slow
def test_bad_inference_settings_fail_the_run_before_any_request(
    tmp_path: Path, layout: DataLayout, instance: dg.DagsterInstance
) -> None:
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(3)])
    with serve_in_thread(FakeConfig(token_rate=5000, median_tokens=20)) as base_url:
        stats_url = base_url.removesuffix("/v1") + "/stats"
        good = make_resources(
            layout, dataset, partition_size=10, inference_server=RemoteVLLMResource(base_url=base_url)
        )
        assert dg.materialize([raw_prompts], instance=instance, resources=good).success
        for overrides, expected in BAD_INFERENCE_SETTINGS:
            with pytest.raises(settings.ConfigError) as raised:
                RemoteVLLMResource(**{"base_url": base_url, **overrides})
            assert expected in str(raised.value), overrides
            result = materialize_responses(  # the launchpad path: the run fails before any request
                "00000",
                instance,
                good,
                raise_on_error=False,
                run_config={"resources": {"inference_server": {"config": overrides}}},
            )
            assert not result.success, overrides
            assert expected in _failure_text(result), overrides
            assert get_json(stats_url)["total_requests"] == 0
    assert not layout.asset_dir("synthetic_responses").exists()


def test_unreachable_server_without_a_model_fails_fast_naming_the_url(layout: DataLayout) -> None:
    url = closed_port_url()
    started = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        generate_partition(make_prompts(50), "00000", layout, quick_config(url, max_attempts=3), log=lambda _m: None)
    assert time.monotonic() - started < 10
    assert "could not find the served model via GET /v1/models" in str(raised.value)
    assert url in str(raised.value)
    assert not layout.responses_in_progress_path("00000").exists()
    assert not layout.responses_path("00000").exists()


def test_unreachable_server_through_dagster_fails_the_run_naming_the_url(
    tmp_path: Path, layout: DataLayout, instance: dg.DagsterInstance
) -> None:
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(3)])
    url = closed_port_url()
    resources = make_resources(
        layout, dataset, partition_size=10, inference_server=RemoteVLLMResource(base_url=url, max_attempts=2)
    )
    assert dg.materialize([raw_prompts], instance=instance, resources=resources).success
    with pytest.raises(Exception) as raised:
        materialize_responses(
            "00000",
            instance,
            resources,
        )
    assert url in error_chain(raised.value)
    assert not layout.responses_in_progress_path("00000").exists()


UNREACHABLE_WITH_MODEL = textwrap.dedent(
    """
    import sys
    from eagle3_assets.generation import GenerationConfig, PromptToGenerate, generate_partition
    from eagle3_assets.core.storage import DataLayout

    prompts = [PromptToGenerate(f"u{i}", [{"role": "user", "content": f"q{i}"}]) for i in range(20)]
    config = GenerationConfig(base_urls=[sys.argv[1]], model="fake-model", max_attempts=3, backoff_base_s=0.05,
                              backoff_max_s=0.5, bench_s=1.0)
    try:
        generate_partition(prompts, "00000", DataLayout.at(sys.argv[2]), config, log=lambda m: None)
    except Exception as error:
        print("ERROR", error)
    else:
        print("FINISHED")
    """
)


@pytest.mark.slow
def test_unreachable_server_with_a_model_configured_fails_before_the_pool(tmp_path: Path) -> None:
    script = tmp_path / "unreachable.py"
    script.write_text(UNREACHABLE_WITH_MODEL)
    url = closed_port_url()
    try:
        out = subprocess.run(
            [sys.executable, str(script), url, str(tmp_path / "data")],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=6,
            cwd=tmp_path,
        ).stdout
    except subprocess.TimeoutExpired:
        pytest.fail("generate_partition against an unreachable server was still running after 6 s")
    assert out.startswith("ERROR") and url in out, out


def test_refused_connection_is_reported_as_a_connection_error(layout: DataLayout) -> None:
    with pytest.raises(RuntimeError) as raised:
        generate_partition(
            make_prompts(2), "00000", layout, quick_config(closed_port_url(), max_attempts=1), log=lambda _m: None
        )
    assert "connect" in str(raised.value).lower(), str(raised.value)


# ------------------------------------------------- hidden states / training (core modules; no assets yet)


# Out-of-range, decreasing and default-on-a-small-verifier ids: tests/unit/test_hidden_states.py::
# test_layer_ids_validation_names_the_key and ::test_bad_layer_id_fails_before_any_work. These are the other shapes.
@pytest.mark.parametrize(
    ("layer_ids", "why"),
    [
        ([-1, 2], "layer ids must lie in [0, 3]"),
        ([1, 1], "distinct and increasing"),
        ([], "needs at least one layer id"),
    ],
)
def test_layer_ids_out_of_range_name_the_key(layer_ids: list[int], why: str) -> None:
    from eagle3_assets.core.verifier import resolve_layer_ids

    with pytest.raises(settings.ConfigError) as raised:
        resolve_layer_ids(layer_ids, 4)
    assert str(raised.value).startswith(f"layer_ids={layer_ids!r}: ") and why in str(raised.value)


def test_missing_verifier_path_names_the_key(tmp_path: Path) -> None:
    from eagle3_assets.defs.resources import VerifierResource

    with pytest.raises(settings.ConfigError, match="EAGLE3_VERIFIER_PATH='': set it"):
        VerifierResource(path="").resolved_path()
    with pytest.raises(settings.ConfigError, match=r"EAGLE3_VERIFIER_PATH=.*no config\.json"):
        VerifierResource(path=str(tmp_path / "nowhere")).resolved_path()


def test_bad_draft_vocab_size_fails_before_importing_speculators(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from eagle3_assets.training.vocab import build_vocab_mapping

    # Any import of torch or speculators inside the call now raises ImportError: the check must come first.
    for module in ("torch", "speculators", "speculators.train", "speculators.train.vocab_mapping"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(settings.ConfigError, match="draft_vocab_size=0: must be a positive integer"):
        build_vocab_mapping(DataLayout.at(tmp_path / "data"), ["00000"], draft_vocab_size=0, target_vocab_size=100)
    with pytest.raises(settings.ConfigError, match="target_vocab_size=-1: must be a positive integer"):
        build_vocab_mapping(DataLayout.at(tmp_path / "data"), ["00000"], draft_vocab_size=10, target_vocab_size=-1)
