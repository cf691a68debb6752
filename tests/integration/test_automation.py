"""Opt-in declarative automation (issue 16): off by default, EAGLE3_AUTOMATION=true turns it on, and a real
``dagster-daemon run`` then materializes a hidden_states partition once its synthetic_responses partition lands."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.defs.automation import SENSOR_NAME, automation_condition
from eagle3_assets.environment import code_location_settings
from fake_vllm import FakeConfig, FakeServerProcess
from support.operations import (
    dagster_daemon,
    initialize_storage,
    make_dagster_home,
    pipeline_env,
    wait_for,
    write_prompts,
    write_workspace,
)


def _conditions(defs: dg.Definitions) -> dict[str, bool]:
    return {spec.key.to_user_string(): spec.automation_condition is not None for a in defs.assets for spec in a.specs}


def test_off_by_default_and_one_setting_turns_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from eagle3_assets.definitions import build_definitions

    monkeypatch.delenv("EAGLE3_AUTOMATION", raising=False)
    off = build_definitions()
    assert not any(_conditions(off).values()) and not list(off.sensors or [])
    monkeypatch.setenv("EAGLE3_AUTOMATION", "true")
    on = build_definitions()
    assert [name for name, has in _conditions(on).items() if has] == ["hidden_states"]
    (sensor,) = on.sensors
    assert sensor.name == SENSOR_NAME and sensor.default_status == dg.DefaultSensorStatus.RUNNING
    monkeypatch.setenv("EAGLE3_AUTOMATION", "sometimes")  # a bad value: the location loads, automation stays off
    assert code_location_settings().automation is False
    assert not list(build_definitions().sensors or [])


def test_the_condition_waits_for_the_upstream_partition_and_its_blocking_checks() -> None:
    parts = dg.StaticPartitionsDefinition(["a", "b", "c"])

    @dg.asset(
        partitions_def=parts,
        check_specs=[dg.AssetCheckSpec("good", asset="up", blocking=True)],
        config_schema={"good": bool},
    )
    def up(context):  # type: ignore[no-untyped-def]  # (annotations are strings here: Dagster wants none)
        yield dg.MaterializeResult()
        yield dg.AssetCheckResult(check_name="good", passed=context.op_config["good"])

    @dg.asset(partitions_def=parts, deps=[up], automation_condition=automation_condition())
    def down() -> None:
        return None

    defs = dg.Definitions(assets=[up, down])

    def requested(instance: dg.DagsterInstance, cursor: object) -> tuple[list[str], object]:
        result = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor)
        keys = sorted(
            pk for r in result.results if r.key == down.key for pk in r.true_subset.expensively_compute_partition_keys()
        )
        return keys, result.cursor

    with dg.instance_for_test() as instance:
        keys, cursor = requested(instance, None)
        assert keys == []  # nothing upstream yet

        def land(instance: dg.DagsterInstance, key: str, good: bool) -> None:
            dg.materialize(
                [up],
                partition_key=key,
                instance=instance,
                raise_on_error=False,
                run_config={"ops": {"up": {"config": {"good": good}}}},
            )

        land(instance, "a", good=False)
        keys, cursor = requested(instance, cursor)
        assert keys == []  # "a" landed, but its blocking check failed
        land(instance, "a", good=True)
        keys, cursor = requested(instance, cursor)
        assert keys == ["a"]  # landed again and passed; "b" and "c" never landed
        keys, cursor = requested(instance, cursor)
        assert keys == []  # handled: not requested twice

    with dg.instance_for_test() as instance:  # "b" lands before the very first evaluation (daemon starting up)
        land(instance, "b", good=True)
        keys, cursor = requested(instance, None)
        assert keys == ["b"]
        keys, cursor = requested(instance, cursor)
        assert keys == []  # handled: not requested twice


@pytest.mark.slow
def test_the_daemon_materializes_hidden_states_once_the_responses_land(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from eagle3_assets.definitions import build_definitions
    from support.hidden_states_data import cached_tiny_verifier

    home = make_dagster_home(tmp_path)
    layout = DataLayout.at(tmp_path / "data")
    dataset = write_prompts(tmp_path, 8)
    workspace = write_workspace(tmp_path)
    with FakeServerProcess(FakeConfig(token_rate=20000, median_tokens=20)) as server:
        env = {
            **pipeline_env(layout.root, dataset, 4, server.base_url, home),
            "EAGLE3_AUTOMATION": "true",
            "EAGLE3_AUTOMATION_INTERVAL_S": "5",
            "EAGLE3_VERIFIER_PATH": str(cached_tiny_verifier()),
            "EAGLE3_LAYER_IDS": "1,2,3",
            "EAGLE3_RETURN_TOKEN_IDS": "false",  # the fake server's ids are not the tiny verifier's
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        with dg.DagsterInstance.get() as instance:
            initialize_storage(instance)
        log = tmp_path / "daemon.log"
        with dagster_daemon(workspace, env, log) as daemon, dg.DagsterInstance.get() as instance:
            defs = build_definitions()  # from the environment above, as the daemon's code location loads them
            assets = list(defs.assets)
            assert dg.materialize(assets, selection=["raw_prompts"], instance=instance, resources=defs.resources)
            result = dg.materialize(
                assets,
                selection=["synthetic_responses"],
                partition_key="00000",
                instance=instance,
                resources=defs.resources,
            )
            assert result.success

            def hidden_states_runs() -> list[dg.DagsterRun]:
                assert daemon.poll() is None, log.read_text()[-3000:]
                runs = instance.get_runs(dg.RunsFilter(tags={"dagster/partition": "00000"}))
                return [r for r in runs if "hidden_states" in {k.to_user_string() for k in r.asset_selection or []}]

            try:
                wait_for(lambda: any(r.is_finished for r in hidden_states_runs()), 600, "the automation run")
            except TimeoutError:
                print(log.read_text()[-5000:])
                raise
            (run,) = hidden_states_runs()
            assert run.status == dg.DagsterRunStatus.SUCCESS, log.read_text()[-3000:]
            assert run.tags.get("dagster/from_automation_condition") == "true" or any(
                "automation" in key for key in run.tags
            ), run.tags
            # 00001 never got responses: nothing is launched for it
            assert not instance.get_runs(dg.RunsFilter(tags={"dagster/partition": "00001"}))
    assert sorted(layout.partition_files("hidden_states")) == ["00000"]
