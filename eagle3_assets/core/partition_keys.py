"""The 1k-sample partition scheme: keys, bounds, and the growth rule.

A sample's partition is ``position // partition_size`` where ``position`` is its place in the dataset's
stable order. Positions are assigned once and then kept: a re-read dataset keeps every known sample at
its recorded position and appends new samples after the last one, so growing the dataset only adds
partitions and never moves a sample that may already have been generated.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

KEY_WIDTH = 5
PARTITION_SIZE = 1000  # samples per partition: the unit a failed run re-materializes alone
# Every partition key is data, never a path: digits only, at least KEY_WIDTH of them. Keys reach the project from
# outside (Dagster's "Add partition", its Python API and the CLI accept any string, slashes and dots included), and
# each one becomes a file name under the data directory, so each is checked where it becomes a path.
KEY_PATTERN = re.compile(rf"^[0-9]{{{KEY_WIDTH},}}$")


class InvalidPartitionKeyError(ValueError):
    """A partition key that is not of the project's form; the message names it and the remedy."""


def check_partition_key(key: object) -> str:
    """``key`` itself when it is a partition key of this project's form, else :class:`InvalidPartitionKeyError`."""
    if isinstance(key, str) and KEY_PATTERN.fullmatch(key):
        return key
    raise InvalidPartitionKeyError(
        f"invalid partition key {key!r}: keys are {KEY_WIDTH} or more digits (e.g. {partition_key(0)!r}), made by "
        "raw_prompts; a key added by hand (Dagster's 'Add partition' or add_dynamic_partitions) is refused and nothing "
        "is written for it: delete it from the partitions of 'prompt_partitions' and re-materialize raw_prompts"
    )


def partition_key(index: int) -> str:
    if index < 0:
        raise ValueError(f"partition index must be >= 0, got {index}")
    return f"{index:0{KEY_WIDTH}d}"


def partition_of(position: int, partition_size: int) -> str:
    return partition_key(position // partition_size)


def assign_positions(
    sample_ids: Iterable[str], previous: Mapping[str, int] | None = None
) -> tuple[list[int], int, int]:
    """Positions for ``sample_ids`` (in dataset order): known ids keep theirs, new ones go at the end.

    Returns (positions, number kept, number new). Ids of ``previous`` that are absent now simply leave
    a gap; nothing else shifts into it.
    """
    previous = previous or {}
    next_position = max(previous.values(), default=-1) + 1
    positions: list[int] = []
    kept = new = 0
    for sample_id in sample_ids:
        known = previous.get(sample_id)
        if known is not None:
            positions.append(known)
            kept += 1
        else:
            positions.append(next_position)
            next_position += 1
            new += 1
    return positions, kept, new
