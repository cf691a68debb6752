"""The hidden_states asset checks, each over a whole stored partition (Dagster-free: they return outcomes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eagle3_assets.check_outcome import CheckOutcome
from eagle3_assets.hidden_states.samples import hs_file, read_ok_responses
from eagle3_assets.storage import DataLayout, read_json

if TYPE_CHECKING:
    import polars as pl

# what the trainer must agree with (aux layer ids, widths, dtype); ours, not speculators'
META_FILE = "eagle3_meta.json"


def read_meta(layout: DataLayout, partition_key: str) -> dict[str, Any]:
    """The partition's layer ids, widths and dtype as extracted (``eagle3_meta.json``)."""
    return read_json(layout.hidden_states_dir(partition_key) / META_FILE)


def _load_index(layout: DataLayout, partition_key: str) -> pl.DataFrame:
    import polars as pl

    return pl.read_parquet(layout.hidden_states_index_path(partition_key))


def _stored_rows(layout: DataLayout, partition_key: str) -> set[int]:
    """Rows whose state file the index lists (all of them, unless the partition was built with a store budget for
    online or hybrid training)."""
    index = _load_index(layout, partition_key)
    return set(index.filter(index["file"].is_not_null())["row"].to_list())


def check_token_ids(layout: DataLayout, partition_key: str) -> CheckOutcome:
    """Every stored sample's ``token_ids`` equal its dataset row's ``input_ids`` (what speculators' loader needs)."""
    from datasets import load_from_disk
    from safetensors import safe_open

    data_dir = layout.hidden_states_dir(partition_key)
    dataset = load_from_disk(str(data_dir)).with_format(None)
    stored = _stored_rows(layout, partition_key)
    bad = []
    for row, ids in enumerate(dataset["input_ids"]):
        if row not in stored:
            continue
        with safe_open(str(hs_file(data_dir, row)), framework="pt") as handle:
            if handle.get_tensor("token_ids").tolist() != list(ids):
                bad.append(row)
    description = f"{len(bad)} of {len(dataset)} samples have token_ids != input_ids"
    return CheckOutcome(not bad, description, {"bad_rows": bad[:20]})


def check_finite(layout: DataLayout, partition_key: str) -> CheckOutcome:
    """No NaN/Inf in any stored hidden state (reads every value)."""
    import torch

    from eagle3_assets.hidden_states.storage_format import load_states

    data_dir = layout.hidden_states_dir(partition_key)
    index = _load_index(layout, partition_key)
    bad = []
    for row in sorted(_stored_rows(layout, partition_key)):
        hs = load_states(hs_file(data_dir, row))
        if not bool(torch.isfinite(hs).all()):
            bad.append(row)
    return CheckOutcome(not bad, f"{len(bad)} of {index.height} samples hold NaN/Inf", {"bad_rows": bad[:20]})


def check_one_per_ok_response(layout: DataLayout, partition_key: str) -> CheckOutcome:
    """Exactly one stored sample per ``ok`` response, each sample file present."""
    ok, _failed = read_ok_responses(layout, partition_key)
    index = _load_index(layout, partition_key)
    expected = set(ok["sample_id"].to_list())
    stored = index["sample_id"].to_list()
    missing = sorted(expected - set(stored))
    extra = sorted(set(stored) - expected)
    dupes = len(stored) - len(set(stored))
    data_dir = layout.hidden_states_dir(partition_key)
    absent = [r for r in sorted(_stored_rows(layout, partition_key)) if not hs_file(data_dir, r).exists()]
    passed = not (missing or extra or dupes or absent)
    return CheckOutcome(
        passed,
        f"{len(stored)} stored for {len(expected)} ok responses: {len(missing)} missing, {len(extra)} extra, "
        f"{dupes} duplicated, {len(absent)} files absent",
        {"missing": missing[:20], "extra": extra[:20], "absent_rows": absent[:20]},
    )
