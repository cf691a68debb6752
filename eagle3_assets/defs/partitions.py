"""The Dagster side of the 1k-sample partitions.

Dynamic partitions registered by ``raw_prompts``: the set follows the dataset without a code edit or a
definitions reload, and definition load never reads the (possibly huge) dataset. Keys are only ever
added, because a sample's partition never changes (``eagle3_assets.core.partition_keys``).
"""

from __future__ import annotations

import dagster as dg

from eagle3_assets.core.partition_keys import check_partition_key

PROMPT_PARTITIONS = dg.DynamicPartitionsDefinition(name="prompt_partitions")


def partition_key_of(context: dg.AssetExecutionContext) -> str:
    """The run's partition key, refused by name before anything is read or written when it is not of the project's
    form: Dagster's "Add partition" and ``add_dynamic_partitions`` accept any string (``../x`` included)."""
    return check_partition_key(context.partition_key)
