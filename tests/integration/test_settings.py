"""One declaration per setting (issue 17 item 2) and launch-time settings (issue 16 item 2)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets.core import settings
from eagle3_assets.defs.ablation import RegenerationAblationRunConfig
from eagle3_assets.defs.draft import DraftModelRunConfig
from eagle3_assets.defs.evaluation import DraftEvaluationRunConfig
from eagle3_assets.defs.hidden_states import HiddenStatesRunConfig
from eagle3_assets.defs.inference import RemoteVLLMResource
from eagle3_assets.defs.prompts import raw_prompts
from eagle3_assets.defs.registry import default_resources
from eagle3_assets.environment import env_value, settings_classes, settings_markdown
from support.common import materialize_responses, write_jsonl

REPO = Path(__file__).resolve().parents[2]


def _failure_text(result: dg.ExecuteInProcessResult) -> str:
    return "\n".join(
        error.to_string()
        for event in result.all_events
        if (error := getattr(event.event_specific_data, "error", None)) is not None
    )


def test_bad_env_value_loads_the_location_and_fails_only_the_run_that_uses_it(
    tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(3)])
    monkeypatch.setenv("EAGLE3_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("EAGLE3_PROMPTS_PATH", str(dataset))
    monkeypatch.setenv("EAGLE3_PARTITION_SIZE", "10")
    monkeypatch.setenv("EAGLE3_CONCURRENCY", "lots")
    from eagle3_assets.definitions import build_definitions

    defs = build_definitions()  # loads although EAGLE3_CONCURRENCY is bad
    assert defs.resources["inference_server"].concurrency == 128
    assert dg.materialize([raw_prompts], instance=instance, resources=defs.resources).success  # does not use it
    result = materialize_responses(
        "00000",
        instance,
        defs.resources,
        raise_on_error=False,
    )
    assert not result.success
    assert "EAGLE3_CONCURRENCY='lots': must be a positive integer" in _failure_text(result)
    assert not (tmp_path / "data" / "synthetic_responses").exists()


def test_code_location_loads_with_a_bad_value_through_the_dagster_cli(tmp_path: Path) -> None:
    env = {**os.environ, "EAGLE3_PARTITION_SIZE": "-3", "EAGLE3_VLLM_BASE_URL": "nope", "PYTHONPATH": str(REPO)}
    env["DAGSTER_HOME"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "dagster", "definitions", "validate", "-m", "eagle3_assets.definitions"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_launchpad_defaults_are_the_effective_environment_values() -> None:
    resources = default_resources({"EAGLE3_CONCURRENCY": "7", "EAGLE3_TEMPERATURE": "0.3", "EAGLE3_STREAM": "yes"})
    schema = resources["inference_server"].get_resource_definition().config_schema.as_field().default_value
    assert schema["concurrency"] == 7 and schema["temperature"] == 0.3 and schema["stream"] is True
    bad = default_resources({"EAGLE3_CONCURRENCY": "0"})  # a bad value keeps the declared default at load
    assert bad["inference_server"].concurrency == 128


def test_empty_optional_means_none_and_values_are_typed() -> None:
    assert env_value("EAGLE3_TEMPERATURE", {"EAGLE3_TEMPERATURE": ""}) is None
    assert env_value("EAGLE3_TEMPERATURE", {}) is None
    assert env_value("EAGLE3_PARTITION_SIZE", {"EAGLE3_PARTITION_SIZE": "12"}) == 12
    assert env_value("EAGLE3_STREAM", {"EAGLE3_STREAM": "off"}) is False


def test_run_config_errors_have_the_same_shape() -> None:
    with pytest.raises(settings.ConfigError) as raised:
        DraftModelRunConfig(epochs=0)
    assert str(raised.value) == "epochs=0: must be a positive integer"
    with pytest.raises(settings.ConfigError) as raised:
        HiddenStatesRunConfig(dtype="fp8")
    assert str(raised.value) == "dtype='fp8': must be 'bfloat16' or 'float32' or 'float8_e4m3fn'"


def test_readme_table_is_generated_from_the_declarations() -> None:
    table = settings_markdown()
    assert table in (REPO / "README.md").read_text(), "run `eagle3 config --markdown` and paste it into README.md"
    env_keys = [f.env for cls in settings_classes() for f in settings.declared(cls) if f.env]
    assert len(env_keys) == len(set(env_keys)), "an EAGLE3_* variable is declared twice"
    for key in [*env_keys, "EAGLE3_API_KEY"]:
        assert f"`{key}`" in table


def _same(a: object, b: object) -> bool:
    """Equal, counting the Dagster side's "" (a text field left empty) as the core's None."""
    return a == b or {a, b} <= {None, ""}


@pytest.mark.parametrize(
    ("dagster_side", "core", "allowed_to_differ"),
    [
        (RemoteVLLMResource, "eagle3_assets.generation:GenerationConfig", set()),
        (HiddenStatesRunConfig, "eagle3_assets.hidden_states:HiddenStatesConfig", set()),
        (DraftModelRunConfig, "eagle3_assets.training:TrainConfig", set()),
        # the asset caps the offline simulation (minutes on a CPU); the core's default is the whole partition
        (DraftEvaluationRunConfig, "eagle3_assets.evaluation.online_metrics:OnlineConfig", set()),
        (DraftEvaluationRunConfig, "eagle3_assets.evaluation.evaluate:EvaluationOptions", {"offline_max_samples"}),
        # seeds: comma-separated text on the Dagster side, a tuple in the core
        (RegenerationAblationRunConfig, "eagle3_assets.evaluation.ablation:AblationConfig", {"seeds"}),
    ],
)
def test_no_default_drifts_between_a_setting_and_the_core_dataclass(
    dagster_side: type, core: str, allowed_to_differ: set[str]
) -> None:
    import importlib

    module, name = core.split(":")
    core_fields = {f.name: f for f in dataclasses.fields(getattr(importlib.import_module(module), name))}
    shared = [f for f in settings.declared(dagster_side) if f.name in core_fields and f.name not in allowed_to_differ]
    assert shared, "no shared fields: the comparison would be empty"
    for field in shared:
        core_default = core_fields[field.name].default
        if core_default is dataclasses.MISSING:
            continue
        assert _same(field.default, core_default), f"{dagster_side.__name__}.{field.name}: {field.default!r} vs {core}"
