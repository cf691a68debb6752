"""The Dagster side of the 1k-sample partitions.

Dynamic partitions registered by ``raw_prompts``: the set follows the dataset without a code edit or a
definitions reload, and definition load never reads the (possibly huge) dataset. Keys are only ever
added, because a sample's partition never changes (``eagle3_assets.partitions``).
"""

from __future__ import annotations

import dagster as dg

PROMPT_PARTITIONS = dg.DynamicPartitionsDefinition(name="prompt_partitions")
