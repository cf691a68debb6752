"""``benchmarks/recipe_probe.py`` on a data directory the project filled: it trains its variants in its own folder
(``_recipe_probe/``), so the published vocab_mapping and draft_model are left byte for byte. Before, every variant
deleted the data directory's draft_model and the probe rebuilt its vocab_mapping at the probe's size."""

from __future__ import annotations

import json
from pathlib import Path

import recipe_probe

from support.hidden_states_data import TRAINING_KEYS, training_inputs
from support.safety_training import tree


def test_the_probe_leaves_the_published_vocab_mapping_and_draft_as_they_were(tmp_path: Path) -> None:
    layout, verifier = training_inputs(tmp_path / "data")
    published_draft = layout.draft_model_dir / "final" / "config.json"  # stands for a trained draft
    published_draft.parent.mkdir(parents=True)
    published_draft.write_text('{"speculators_model_type": "eagle3"}')
    before = tree(layout.root)
    out = tmp_path / "probe.jsonl"
    variant = json.dumps({"max_steps_per_epoch": 2, "tokens_per_batch": 768, "max_val_batches": 2})
    recipe_probe.main(
        ["--data", str(layout.root), "--verifier", str(verifier), "--train", TRAINING_KEYS[0],
         "--val", TRAINING_KEYS[1], "--draft-vocab", "128", "--variant", f"short={variant}", "--out", str(out)]
    )  # fmt: skip
    after = {path: digest for path, digest in tree(layout.root).items() if not path.startswith(recipe_probe.SCRATCH)}
    assert after == before  # the vocabulary (256 tokens, not the probe's 128) and the draft: untouched
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["variant"] == "short" and row["steps"] == 2
    assert (layout.root / recipe_probe.SCRATCH / "draft_model" / "final" / "config.json").is_file()
