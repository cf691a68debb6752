"""Issue 23, the Dagster shape in online mode: the whole graph run the way `eagle3 demo` runs it (definitions from the
EAGLE3_* environment, Dagster's materialize() per asset and partition, the blocking checks beside them) with
``hidden_states`` built to store no states (``store_budget_gib: 0``) and ``draft_model`` trained online. The
partitions pass their checks and hold no state file, the draft's metadata and training history say it was trained
online, draft_evaluation's offline simulation computes the held-out states it needs, and a missing-only backfill
plans nothing."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets.core.storage import DataLayout
from fake_vllm import FakeConfig, FakeServerProcess
from support.common import fake_server_pipeline_env, write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PARTITIONS = ["00000", "00001"]  # one trains the draft, the other is held out
ASSET_CONFIG: dict[str, dict[str, object]] = {
    "hidden_states": {"store_budget_gib": 0},
    "vocab_mapping": {"draft_vocab_size": 256},
    "draft_model": {"epochs": 2, "tokens_per_batch": 256, "max_steps_per_epoch": 3, "hidden_states_source": "online"},
    "draft_evaluation": {"online": False},
}


def test_the_graph_runs_online_with_no_state_file_and_dagster_sees_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from eagle3_assets.definitions import build_definitions
    from eagle3_assets.operations import backfill
    from eagle3_assets.operations.demo import materialize_asset

    (tmp_path / "dagster_home").mkdir()
    layout = DataLayout.at(tmp_path / "data")
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"id": f"k{i}", "prompt": f"online mode {i}"} for i in range(8)])
    with FakeServerProcess(FakeConfig(token_rate=5000, median_tokens=30)) as server:
        env = fake_server_pipeline_env(tmp_path / "dagster_home", layout, dataset, server.base_url)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        defs = build_definitions()
        with dg.DagsterInstance.get() as instance:
            metadata: dict[str, dict] = {}
            for name in ("raw_prompts", "synthetic_responses", "hidden_states", "vocab_mapping", "draft_model",
                         "draft_evaluation"):  # fmt: skip
                partitioned = name in ("synthetic_responses", "hidden_states")
                for partition in PARTITIONS if partitioned else [None]:
                    config = {"ops": {name: {"config": ASSET_CONFIG[name]}}} if name in ASSET_CONFIG else None
                    result = materialize_asset(defs, instance, name, partition, config)
                    assert result.success, (name, partition)
                    failed = [e.check_name for e in result.get_asset_check_evaluations() if not e.passed]
                    assert failed == [], (name, partition, failed)
                    metadata[f"{name} {partition}"] = result.asset_materializations_for_node(name)[0].metadata
            plan = backfill.plan_missing(instance, "synthetic_responses", layout=layout)

    for key in PARTITIONS:
        hs = metadata[f"hidden_states {key}"]
        assert (
            hs["samples_with_states"].value == 0
            and hs["bytes"].value == 0
            and hs["dagster/partition_row_count"].value == 4
        )
    assert not list(layout.root.rglob("*.safetensors.lock"))
    assert not [p for p in layout.root.rglob("hs_*.safetensors")]  # no state tensor file anywhere
    assert metadata["draft_model None"]["hidden_states_source"].value == "online"
    history = json.loads((layout.draft_model_dir / "training_history.json").read_text())
    assert history["config"]["hidden_states_source"] == "online"
    report = json.loads((layout.evaluation_dir / "report.json").read_text())
    offline = [s for s in report["stats"] if s["method"] == "offline"]
    assert offline and all(s["extra"]["samples"] > 0 for s in offline), offline
    assert any("computed by the hf backend" in note for note in report["notes"]), report["notes"]
    assert plan.empty and not plan.stale_downstream, plan.describe()
