"""Issue 25 item 2: the regeneration ablation end to end on the tiny verifier and the fake vLLM server (offline)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest

from eagle3_assets.core.settings import ConfigError
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.evaluation.ablation import VARIANTS, AblationConfig, ablation_folder, run_ablation
from eagle3_assets.generation import GenerationConfig
from eagle3_assets.prompts.prompt_table import build_prompt_table, dataset_turns_path
from fake_vllm import FakeConfig, get_json, post_json, serve_in_thread
from support.common import write_jsonl


def _conversation(i: int, turns: int) -> dict:
    convo = []
    for t in range(turns):
        convo.append({"from": "human", "value": f"question {i} part {t} about the model"})
        convo.append({"from": "gpt", "value": f"DATASET answer {i} {t} with the draft"})
    return {"id": f"c{i}", "conversations": convo}


@pytest.fixture
def server() -> Iterator[str]:
    with serve_in_thread(FakeConfig(token_rate=100000, median_tokens=10, sigma=0.3, ttft_s=0.0)) as url:
        yield url


def _setup(tmp_path: Path) -> tuple[DataLayout, Path]:
    from support.hidden_states_data import cached_tiny_verifier

    layout = DataLayout.at(tmp_path / "data")
    rows = [_conversation(i, 1 + i % 3) for i in range(8)]
    build_prompt_table(write_jsonl(tmp_path / "prompts.jsonl", rows), layout, partition_size=1000)
    # the fake server's token ids run to 4,095: the tiny verifier with that vocabulary
    return layout, cached_tiny_verifier(hidden_size=256, vocab_size=4096)


def _run(layout: DataLayout, verifier: Path, url: str, max_tokens: int = 24, **overrides: object):  # type: ignore[no-untyped-def]
    from eagle3_assets.hidden_states import HiddenStatesConfig
    from eagle3_assets.training import TrainConfig

    config = AblationConfig(**{"conversations": 4, "held_out": 2, "humaneval": 2, "token_budget": 512,
                               "tokens_per_batch": 256, "seeds": (0, 1), "partition_size": 2,
                               "draft_vocab_size": 256, "k": 2, "online": False, "max_val_batches": 1,
                               "offline_max_samples": 2, **overrides})  # type: ignore[arg-type]  # fmt: skip
    generation = GenerationConfig(base_urls=[url], model="fake-model", concurrency=4, max_tokens=max_tokens,
                                  progress_interval_s=60)  # fmt: skip
    hidden = HiddenStatesConfig(layer_ids=[1, 2, 3], max_seq_len=256, num_threads=1)
    train = TrainConfig(device="cpu", num_threads=1, ttt_steps=2, init="speculators")
    return run_ablation(layout, verifier, config, generation, hidden, train, log=print)


def _fake_online(calls: list[dict]):  # type: ignore[no-untyped-def]
    """Stands in for vLLM (tests/e2e has the real one): records the drafts and prompt sets it is asked about."""
    from eagle3_assets.evaluation.evaluation_report import AcceptanceStats
    from eagle3_assets.evaluation.online_metrics import OnlineResult

    def evaluate_online(verifier, drafts, prompt_sets, config, log=None):  # type: ignore[no-untyped-def]
        calls.append({"drafts": dict(drafts), "sets": {k: [p.sample_id for p in v] for k, v in prompt_sets.items()}})
        stats = [AcceptanceStats(label, "online", config.k, 10, 20, 5 + i, [3, 2], prompt_set=name)
                 for i, label in enumerate(drafts) for name in prompt_sets]  # fmt: skip
        return OnlineResult(stats=stats, baseline={}, mismatches={}, startup_s={})

    return evaluate_online


def test_ablation_end_to_end_then_reused(tmp_path: Path, server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from eagle3_assets.evaluation import online_metrics

    calls: list[dict] = []
    monkeypatch.setattr(online_metrics, "evaluate_online", _fake_online(calls))
    layout, verifier = _setup(tmp_path)
    # raw_prompts keeps the dataset's answers beside its table; the table itself still ends on a user turn
    turns = pl.read_parquet(dataset_turns_path(layout))
    assert turns.filter(pl.col("sample_id") == "c0")["messages"][0][-1]["role"] == "assistant"
    assert pl.read_parquet(layout.prompts_path)["messages"][0][-1]["role"] == "user"

    report = _run(layout, verifier, server, online=True)
    root = ablation_folder(layout)
    rows = {row.key(): row for row in report.rows}
    assert sorted(rows) == ["all-turns/seed0", "all-turns/seed1", "dataset/seed0", "last-turn/seed0"]

    # the same conversations in every variant, the same token budget and the same number of steps
    ids = {}
    for variant in VARIANTS:
        folder = root / variant / "synthetic_responses"
        train = pl.concat([pl.read_parquet(folder / f"{key}.parquet") for key in ("00000", "00001")])
        ids[variant] = sorted(train["sample_id"].to_list())
        if variant == "dataset":  # the dataset's answers, loss on every one of them, none of it the model's
            assert all(c.startswith("DATASET answer") for c in train["content"].to_list())
            assert all(len(s) == n for s, n in zip(train["model_spans"], train["turns_total"], strict=True))
        else:  # the model's own answers
            assert not any((c or "").startswith("DATASET") for c in train["content"].to_list())
    assert ids["dataset"] == ids["last-turn"] == ids["all-turns"] == ["c0", "c1", "c2", "c3"]
    assert len({(r.token_budget, r.steps, r.epochs) for r in report.rows}) == 1 and report.rows[0].steps == 2
    assert rows["dataset/seed0"].model_tokens == 0 and rows["dataset/seed0"].generation_tokens == 0
    for key in ("last-turn/seed0", "all-turns/seed0"):
        assert rows[key].model_tokens == rows[key].loss_tokens_available > 0 and rows[key].generation_tokens > 0
    # all-turns asked every user turn (1 + 2 + 3 + 1 turns), last-turn one per conversation
    assert rows["all-turns/seed0"].generation_tokens > rows["last-turn/seed0"].generation_tokens

    # the report has every field, as JSON and as a Markdown table
    data = json.loads((root / "report.json").read_text())
    for row in data["rows"]:
        assert set(row) >= {"variant", "seed", "tokens_trained", "token_budget", "generation_tokens",
                            "generation_seconds", "acceptance"}  # fmt: skip
        assert set(row["acceptance"]) == {
            "offline/held-out",
            "offline/humaneval",
            "online/held-out",
            "online/humaneval",
        }
        assert all(v is None or v >= 1.0 for v in row["acceptance"].values())
    # one online evaluation of the four drafts, on the held-out rows after the conversations and on HumanEval
    assert len(calls) == 1 and sorted(calls[0]["drafts"]) == sorted(rows)
    assert calls[0]["sets"]["held-out"] == ["c4", "c5"] and len(calls[0]["sets"]["humaneval"]) == 2
    assert rows["dataset/seed0"].acceptance["online/held-out"] == 1.5
    assert "seed_spread" in data
    markdown = (root / "report.md").read_text()
    assert "| variant | seed |" in markdown and "offline held-out" in markdown and "online humaneval" in markdown

    # a re-run reuses everything: no request, no extraction, no training
    post_json(server.removesuffix("/v1") + "/stats/reset")
    final = Path(rows["all-turns/seed1"].draft_dir) / "model.safetensors"
    mtime = final.stat().st_mtime_ns
    again = _run(layout, verifier, server, online=True)
    assert len(calls) == 1  # the online results of the same drafts are reused
    assert sum(get_json(server.removesuffix("/v1") + "/stats")["requests"].values()) == 0
    assert final.stat().st_mtime_ns == mtime
    assert [r.__dict__ for r in again.rows] == [r.__dict__ for r in report.rows]

    # other answers (a changed max_tokens) with the same sample count: retrained from scratch, never resumed from
    # the checkpoints of the earlier data (train_draft's own checkpoint fingerprint counts samples only)
    from eagle3_assets.core.hashing import file_digest

    before = file_digest(final)
    changed = _run(layout, verifier, server, max_tokens=4, online=True)  # every answer cut shorter
    assert file_digest(final) != before
    assert {r.key(): r.steps for r in changed.rows} == {r.key(): r.steps for r in report.rows}


def test_bad_settings_are_refused_by_name(tmp_path: Path, server: str) -> None:
    layout, verifier = _setup(tmp_path)
    with pytest.raises(ConfigError, match="token_budget=100: below one step"):
        _run(layout, verifier, server, token_budget=100)
    with pytest.raises(ConfigError, match="spread_variant='every-turn'"):
        _run(layout, verifier, server, spread_variant="every-turn")
    with pytest.raises(ValueError, match=r"conversations=50: raw_prompts .* has only 8 rows with a dataset answer"):
        _run(layout, verifier, server, conversations=50)
    assert not ablation_folder(layout).exists()  # refused before anything was written


def test_asset_is_opt_in_and_reports_metadata(tmp_path: Path, server: str) -> None:
    import dagster as dg

    from eagle3_assets.definitions import build_definitions
    from eagle3_assets.defs.ablation import OPT_IN_ASSETS, RegenerationAblationRunConfig
    from eagle3_assets.defs.automation import AUTOMATED_ASSETS
    from eagle3_assets.defs.inference import RemoteVLLMResource
    from eagle3_assets.defs.registry import default_resources
    from eagle3_assets.defs.resources import DataStoreResource, VerifierResource

    layout, verifier = _setup(tmp_path)
    resources = {
        **default_resources(),
        "data_store": DataStoreResource(data_dir=str(layout.root)),
        "verifier": VerifierResource(path=str(verifier), layer_ids="1,2,3", device="cpu"),
        "inference_server": RemoteVLLMResource(base_url=server, model="fake-model", concurrency=4, max_tokens=24),
    }
    defs = build_definitions(resources)
    key = dg.AssetKey("regeneration_ablation")
    node = defs.resolve_asset_graph().get(key)
    assert node.group_name == "ablation" and node.automation_condition is None
    assert "regeneration_ablation" in OPT_IN_ASSETS and "regeneration_ablation" not in AUTOMATED_ASSETS

    with pytest.raises(ConfigError, match="seeds='0,0'"):
        RegenerationAblationRunConfig(seeds="0,0")
    config = {"conversations": 4, "held_out": 2, "humaneval": 2, "token_budget": 512, "tokens_per_batch": 256,
              "partition_size": 2, "draft_vocab_size": 256, "k": 2, "online": False, "max_val_batches": 1,
              "offline_max_samples": 2, "max_seq_len": 256}  # fmt: skip
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            list(defs.assets or []),
            selection=["regeneration_ablation"],
            instance=instance,
            resources=defs.resources,
            run_config={"ops": {"regeneration_ablation": {"config": config}}},
        )
    metadata = result.asset_materializations_for_node("regeneration_ablation")[0].metadata
    assert "| variant | seed |" in metadata["report"].value
    for prefix in ("dataset_seed0", "last-turn_seed0", "all-turns_seed0", "all-turns_seed1"):
        assert metadata[f"{prefix}/tokens_trained"].value > 0
        assert f"{prefix}/offline/held-out" in metadata


def test_demo_stages_leave_the_ablation_out(monkeypatch: pytest.MonkeyPatch) -> None:
    import dagster as dg

    from eagle3_assets.definitions import build_definitions
    from eagle3_assets.operations import demo

    selected: list[str] = []

    class _Done:
        success = True

        def get_asset_materialization_events(self) -> list:
            return []

    def materialize(assets, selection, **kwargs):  # type: ignore[no-untyped-def]
        selected.extend(str(s) for s in selection)
        return _Done()

    monkeypatch.setattr(dg, "materialize", materialize)
    with dg.instance_for_test() as instance:
        demo.run_stages(build_definitions(), instance, lambda _line: None, lambda _name: None)
        assert "regeneration_ablation" not in " ".join(selected) and selected  # the unpartitioned stages ran
        demo.run_stages(build_definitions(), instance, lambda _l: None, lambda _n: None, only=["regeneration_ablation"])
    assert "regeneration_ablation" in selected[-1]  # by name it runs
