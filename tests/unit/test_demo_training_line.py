"""The demo's last lines say how much its draft was trained on and, for the real model, where that sits against the
recipe's measured point (issue: a real model on a real dataset)."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_assets.operations import demo
from eagle3_assets.training.checkpoints import HISTORY_FILE


def _history(data_dir: Path, samples: int, epochs: int) -> Path:
    (data_dir / "draft_model").mkdir(parents=True)
    history = {"train_samples": samples, "steps": 400, "tokens_trained": 700_000, "config": {"epochs": epochs}}
    (data_dir / "draft_model" / HISTORY_FILE).write_text(json.dumps(history))
    return data_dir


def test_the_real_demo_says_its_share_of_the_recipes_data(tmp_path: Path) -> None:
    line = demo._training_line(_history(tmp_path, demo.RECIPE_POINT["samples"] // 4, 3), real=True)
    assert "trained on 500 samples x 3 epochs: 400 steps, 700,000 tokens" in line
    assert f"25% of the recipe's {demo.RECIPE_POINT['samples']:,} samples" in line
    assert f"{demo.RECIPE_POINT['humaneval_acceptance']} on HumanEval in vLLM at k=3 (run b91113d)" in line
    assert "speed-up" not in line  # that run's speed-up was unpaired: no figure to quote without its interval


def test_the_tiny_demo_names_no_curve_and_a_missing_history_is_said(tmp_path: Path) -> None:
    assert "recipe" not in demo._training_line(_history(tmp_path, 160, 2), real=False)
    assert demo._training_line(tmp_path / "nothing", real=True).strip() == "draft: no training history found"
