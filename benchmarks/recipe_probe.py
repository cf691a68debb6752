"""Training-recipe probe: drafts trained side by side on the same partition for the same tokens, one knob changed each.

Each variant trains from scratch on ``--train`` partitions for one epoch (the same packed tokens, the same seed) and
is validated on ``--val`` with the same seeded batches, so the rows differ only in the knob named. It reads a data
directory the project (or ``benchmarks/learning_curve.py``) already filled with hidden states and writes only in its
own folder there, ``_recipe_probe/`` (the hidden states read through a link; its vocabulary mapping and drafts), so
the data directory's published vocab_mapping and draft_model are never touched. One JSON line per variant is appended
to ``--out`` as it finishes.

    python benchmarks/recipe_probe.py --data DIR --verifier DIR --train 00000 --val 00001 \\
        --variant 'base={}' --variant 'tokens4096={"tokens_per_batch": 4096}' --variant 'all={"loss_on": "all"}'

Every variant starts from ``--base`` (JSON of TrainConfig fields) and applies its own fields on top.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.training.vocab import RECIPE_DRAFT_VOCAB_SIZE

SCRATCH = "_recipe_probe"  # the probe's folder in the data directory
BASE = {"epochs": 1, "lr": 3e-3, "tokens_per_batch": 2048, "max_val_batches": 8, "keep_checkpoints": 1}


def scratch_layout(data: Path) -> DataLayout:
    """The probe's own data directory inside ``data``: the hidden states through a link, everything it writes here."""
    work = DataLayout.at(data / SCRATCH)
    link = work.asset_dir("hidden_states")
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        link.symlink_to(DataLayout.at(data).asset_dir("hidden_states").resolve(), target_is_directory=True)
    return work


def run_variant(
    layout: DataLayout,
    verifier: Path,
    train: list[str],
    val: str,
    base: dict[str, Any],
    name: str,
    fields: dict[str, Any],
) -> dict[str, Any]:
    from eagle3_assets.training import TrainConfig, train_draft

    shutil.rmtree(layout.draft_model_dir, ignore_errors=True)  # every variant from scratch, in the probe's folder
    config = TrainConfig(**{**base, **fields})
    started = time.perf_counter()
    result = train_draft(layout, train, val, verifier, config, log=lambda s: None)
    seconds = time.perf_counter() - started
    return {
        "variant": name, **fields, "steps": result.steps, "tokens": result.tokens_trained,
        "seconds": round(seconds, 1), "val_loss": result.val_loss[-1],
        "val_accuracy_per_step": [round(a, 4) for a in result.val_accuracy[-1]],
        "val_acceptance_length": result.val_acceptance_length[-1],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="data dir with hidden_states partitions")
    parser.add_argument("--verifier", type=Path, required=True)
    parser.add_argument("--train", default="00000", help="comma-separated training partitions")
    parser.add_argument("--val", default="00001", help="validation partition")
    parser.add_argument("--draft-vocab", type=int, default=RECIPE_DRAFT_VOCAB_SIZE)
    parser.add_argument("--base", default="{}", help="JSON: TrainConfig fields every variant starts from")
    parser.add_argument("--variant", action="append", required=True, help="NAME=JSON of TrainConfig fields")
    parser.add_argument("--out", type=Path, help="JSON lines (default: <data>/recipe_probe.jsonl)")
    args = parser.parse_args(argv)

    from transformers import AutoConfig

    from eagle3_assets.core.precision import fastest_cpu_precision
    from eagle3_assets.training import build_vocab_mapping

    train = args.train.split(",")
    base = {**BASE, "device": "cpu", "precision": fastest_cpu_precision(), **json.loads(args.base)}
    vocab = AutoConfig.from_pretrained(args.verifier).vocab_size
    layout = scratch_layout(args.data)
    build_vocab_mapping(layout, train, args.draft_vocab, target_vocab_size=vocab)
    out = args.out or args.data / "recipe_probe.jsonl"
    rows = []
    for spec in args.variant:
        name, _, fields = spec.partition("=")
        row = run_variant(layout, args.verifier, train, args.val, base, name, json.loads(fields or "{}"))
        with out.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        rows.append(row)
    first = rows[0]
    print("\n| variant | steps | tokens | seconds | val acc. per step | val acc. length | vs first |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        ratio = (row["val_acceptance_length"] - 1) / max(first["val_acceptance_length"] - 1, 1e-9)
        print(
            f"| {row['variant']} | {row['steps']} | {row['tokens']:,} | {row['seconds']:.0f} | "
            f"{row['val_accuracy_per_step']} | {row['val_acceptance_length']:.3f} | {ratio:.2f}x |"
        )


if __name__ == "__main__":
    main()
