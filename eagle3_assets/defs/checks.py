"""Turning the core modules' check outcomes (passed, description, metadata) into Dagster check results."""

import dagster as dg

from eagle3_assets.core.check_outcome import CheckOutcome


def check_result(check_name: str, outcome: CheckOutcome) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        check_name=check_name,
        passed=outcome.passed,
        description=outcome.description,
        # Dagster's metadata values are scalars; lists and dicts (e.g. example ids) travel as JSON.
        metadata={
            k: dg.MetadataValue.json(v) if isinstance(v, (dict, list)) else v for k, v in outcome.metadata.items()
        },
    )
