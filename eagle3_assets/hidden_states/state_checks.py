"""The hidden_states asset checks, each over a whole stored partition (Dagster-free: they return outcomes).

Each check reads ONE version of the partition: the folder its caller pinned (``data_dir``, from
``publish.pinned``), else the one it pins itself. Read through the pointer instead, a rebuild published between
two reads would pair the index of one build with the sample files of another.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_assets.core.check_outcome import CheckOutcome
from eagle3_assets.core.storage import DataLayout, read_json
from eagle3_assets.hidden_states import publish
from eagle3_assets.hidden_states.publish import INDEX_FILE
from eagle3_assets.hidden_states.samples import hs_file, read_ok_responses
from eagle3_assets.hidden_states.storage_format import load_states

if TYPE_CHECKING:
    import polars as pl

# what the trainer must agree with (aux layer ids, widths, dtype); ours, not speculators'
META_FILE = "eagle3_meta.json"


@contextlib.contextmanager
def version_folder(layout: DataLayout, partition_key: str, data_dir: Path | None = None) -> Iterator[Path]:
    """``data_dir`` (a version folder the caller pinned), else the partition's current version, pinned while the
    block runs."""
    if data_dir is not None:
        yield data_dir
        return

    with publish.pinned(layout, [partition_key]) as dirs:
        yield dirs[partition_key]


def version_index_path(layout: DataLayout, partition_key: str, data_dir: Path) -> Path:
    """The index of the version ``data_dir``; a folder of the earlier layout keeps it beside the folder."""
    own = data_dir / INDEX_FILE
    return own if own.exists() else layout.hidden_states_index_path(partition_key)


def read_meta(layout: DataLayout, partition_key: str, data_dir: Path | None = None) -> dict[str, Any]:
    """The partition's layer ids, widths and dtype as extracted (``eagle3_meta.json``) of ``data_dir`` (a pinned
    version) or the current version."""
    return read_json((data_dir or layout.hidden_states_dir(partition_key)) / META_FILE)


def _load_index(layout: DataLayout, partition_key: str, data_dir: Path) -> pl.DataFrame:
    # lazy: loads polars (heavy), which only this path needs
    import polars as pl

    return pl.read_parquet(version_index_path(layout, partition_key, data_dir))


def _stored_rows(index: pl.DataFrame) -> set[int]:
    """Rows whose state file the index lists (all of them, unless the partition was built with a store budget for
    online or hybrid training)."""
    return set(index.filter(index["file"].is_not_null())["row"].to_list())


def check_token_ids(layout: DataLayout, partition_key: str, data_dir: Path | None = None) -> CheckOutcome:
    """Every stored sample's ``token_ids`` equal its dataset row's ``input_ids`` (what speculators' loader needs)."""
    # lazy: loads datasets (heavy), which only this path needs
    from datasets import load_from_disk

    # lazy: loads safetensors (heavy), which only this path needs
    from safetensors import safe_open

    with version_folder(layout, partition_key, data_dir) as folder:
        dataset = load_from_disk(str(folder)).with_format(None)
        stored = _stored_rows(_load_index(layout, partition_key, folder))
        bad = []
        for row, ids in enumerate(dataset["input_ids"]):
            if row not in stored:
                continue
            with safe_open(str(hs_file(folder, row)), framework="pt") as handle:
                if handle.get_tensor("token_ids").tolist() != list(ids):
                    bad.append(row)
    description = f"{len(bad)} of {len(dataset)} samples have token_ids != input_ids"
    return CheckOutcome(not bad, description, {"bad_rows": bad[:20]})


def check_finite(layout: DataLayout, partition_key: str, data_dir: Path | None = None) -> CheckOutcome:
    """No NaN/Inf in any stored hidden state (reads every value)."""
    # lazy: loads torch (heavy), which only this path needs
    import torch

    with version_folder(layout, partition_key, data_dir) as folder:
        index = _load_index(layout, partition_key, folder)
        bad = []
        for row in sorted(_stored_rows(index)):
            hs = load_states(hs_file(folder, row))
            if not bool(torch.isfinite(hs).all()):
                bad.append(row)
    return CheckOutcome(not bad, f"{len(bad)} of {index.height} samples hold NaN/Inf", {"bad_rows": bad[:20]})


def check_one_per_ok_response(layout: DataLayout, partition_key: str, data_dir: Path | None = None) -> CheckOutcome:
    """Exactly one stored sample per ``ok`` response, each sample file present."""
    ok, _failed = read_ok_responses(layout, partition_key)
    with version_folder(layout, partition_key, data_dir) as folder:
        index = _load_index(layout, partition_key, folder)
        absent = [r for r in sorted(_stored_rows(index)) if not hs_file(folder, r).exists()]
    expected = set(ok["sample_id"].to_list())
    stored = index["sample_id"].to_list()
    missing = sorted(expected - set(stored))
    extra = sorted(set(stored) - expected)
    dupes = len(stored) - len(set(stored))
    passed = not (missing or extra or dupes or absent)
    return CheckOutcome(
        passed,
        f"{len(stored)} stored for {len(expected)} ok responses: {len(missing)} missing, {len(extra)} extra, "
        f"{dupes} duplicated, {len(absent)} files absent",
        {"missing": missing[:20], "extra": extra[:20], "absent_rows": absent[:20]},
    )
