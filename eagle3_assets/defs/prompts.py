"""``raw_prompts``: the validated, deduplicated prompt table and the partitions it defines.

The Dagster layer of ``prompts/`` (the same concept one layer up: this asset, that room its engine).
"""

import dagster as dg

from eagle3_assets.core.partition_keys import check_partition_key
from eagle3_assets.defs import plots
from eagle3_assets.defs.metadata import counts_table, parquet_table, same_named
from eagle3_assets.defs.partitions import PROMPT_PARTITIONS
from eagle3_assets.defs.resources import DataStoreResource, PromptDatasetResource
from eagle3_assets.prompts import prompt_files, prompt_table


@dg.asset(
    group_name="prompts",
    kinds={"polars", "parquet"},
    description=(
        "Every accepted prompt of the dataset (EAGLE3_PROMPTS_PATH) as a normalized conversation with a "
        "stable sample_id and a fixed position; rows that fail validation go to rejects.jsonl with their "
        "line and reason, exact duplicates are dropped (both reported in the run log). Registers one "
        "partition per EAGLE3_PARTITION_SIZE positions."
    ),
)
def raw_prompts(
    context: dg.AssetExecutionContext, data_store: DataStoreResource, prompt_dataset: PromptDatasetResource
) -> dg.MaterializeResult:
    layout = data_store.layout
    result = prompt_table.build_prompt_table(
        prompt_dataset.path,
        layout,
        prompt_dataset.partition_size,
        prompt_dataset.max_reject_share,
        max_prompt_chars=prompt_dataset.max_prompt_chars,
        truncated=prompt_dataset.truncated,
        turns_kept=prompt_dataset.turns,
        limit=prompt_dataset.limit,
    )
    known = set(context.instance.get_dynamic_partitions(PROMPT_PARTITIONS.name))
    # keys are made by the partition scheme; checked again here, where they enter Dagster
    new_keys = [check_partition_key(key) for key in result.partition_keys if key not in known]
    if new_keys:
        context.instance.add_dynamic_partitions(PROMPT_PARTITIONS.name, new_keys)
    for line in result.log_lines():  # the cut taken, rejects and duplicates, with examples
        context.log.warning(line)
    chars = result.prompt_chars
    return dg.MaterializeResult(
        metadata={
            **parquet_table(result.table_path, result.rows, partitioned=False),
            **same_named(result, "rows_read", "rejects", "duplicates", "new_samples", "dropped_samples"),
            **_cut_metadata(result.cut),
            "partitions": len(result.partition_keys),
            "new_partitions": dg.MetadataValue.text(", ".join(new_keys) or "none"),
            "partition_size": result.partition_size,
            "reject_reasons": counts_table(result.reject_reasons, "reason"),
            "prompt_chars_p50": plots.percentile(chars, 50),
            "prompt_chars_p95": plots.percentile(chars, 95),
            "prompt_chars_max": max(chars, default=0),
            "path": dg.MetadataValue.path(str(result.table_path)),
            "rejects_path": dg.MetadataValue.path(str(result.rejects_path)),
            "prompt_length_histogram": dg.MetadataValue.md(
                plots.histogram_markdown(chars, "Prompt length", "characters")
            ),
        }
    )


def _cut_metadata(cut: prompt_files.Cut | None) -> dict:
    """Where a JSON-array dataset was cut and how many of its records were taken (EAGLE3_PROMPTS_TRUNCATED)."""
    if cut is None:
        return {}
    return {
        "dataset_cut": dg.MetadataValue.text(cut.describe()),
        "dataset_cut_at_byte": cut.byte_offset,
        "dataset_records_taken": cut.complete_records,
    }


@dg.asset_check(asset=raw_prompts, description="Every sample_id appears once and every position is unique.")
def raw_prompts_unique_ids(data_store: DataStoreResource) -> dg.AssetCheckResult:
    # lazy: loads duckdb (heavy), which only this path needs
    import duckdb

    path = str(data_store.layout.prompts_path).replace("'", "''")
    with duckdb.connect() as con:
        rows, ids, positions = con.execute(
            f"SELECT count(*), count(DISTINCT sample_id), count(DISTINCT position) FROM read_parquet('{path}')"
        ).fetchone()
    return dg.AssetCheckResult(
        passed=bool(rows == ids == positions),
        metadata={"rows": rows, "distinct_sample_ids": ids, "distinct_positions": positions},
    )
