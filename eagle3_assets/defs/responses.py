"""``synthetic_responses``: one partition of prompts generated against vLLM, journaled and resumable."""

from typing import TYPE_CHECKING, Any

import dagster as dg
import polars as pl

from eagle3_assets.core.lineage import RESPONSES_CODE_VERSION, PartitionLineage
from eagle3_assets.core.settings import setting
from eagle3_assets.defs import plots
from eagle3_assets.defs.checks import check_result
from eagle3_assets.defs.inference import InferenceServerResource
from eagle3_assets.defs.metadata import counts_table, parquet_table
from eagle3_assets.defs.partitions import PROMPT_PARTITIONS, partition_key_of
from eagle3_assets.defs.prompts import raw_prompts
from eagle3_assets.defs.resources import DataStoreResource, SettingsConfig
from eagle3_assets.generation import generate_partition, partition_prompts
from eagle3_assets.generation.response_checks import DEFAULT_MAX_ERROR_RATE, completeness_check, error_rate_check

if TYPE_CHECKING:
    from eagle3_assets.generation import GenerationResult

COMPLETENESS = "responses_complete"
ERROR_RATE = "responses_error_rate"


class ResponsesRunConfig(SettingsConfig):
    max_error_rate: float = setting(DEFAULT_MAX_ERROR_RATE, ge=0.0, le=1.0)
    """The error-rate check fails above this share of failed samples."""


@dg.asset(
    partitions_def=PROMPT_PARTITIONS,
    deps=[raw_prompts],
    group_name="generation",
    kinds={"vllm", "openai", "parquet"},
    pool="vllm",
    code_version=RESPONSES_CODE_VERSION,
    description=(
        "The target model's own answers (reasoning and content) for one 1,000-sample partition, generated "
        "through the OpenAI-compatible API with a continuously refilled request pool. Every finished sample "
        "is appended to an in-progress journal at once; a re-run keeps the ok samples and requests only the "
        "rest. One row per prompt: ok + failed == partition size."
    ),
    check_specs=[
        # blocking: a partition that fails them fails its step, so nothing downstream runs on it
        dg.AssetCheckSpec(
            COMPLETENESS, asset="synthetic_responses", description="One row per prompt, no duplicates.", blocking=True
        ),
        dg.AssetCheckSpec(
            ERROR_RATE, asset="synthetic_responses", description="Failed share within the limit.", blocking=True
        ),
    ],
)
def synthetic_responses(
    context: dg.AssetExecutionContext,
    config: ResponsesRunConfig,
    data_store: DataStoreResource,
    inference_server: InferenceServerResource,
):
    layout = data_store.layout
    key = partition_key_of(context)
    prompts = partition_prompts(layout, key)
    if not prompts:
        raise ValueError(f"partition {key} has no prompts in {layout.prompts_path}; re-materialize raw_prompts")
    result = generate_partition(prompts, key, layout, inference_server.generation_config(), log=context.log.info)

    outcomes = {
        COMPLETENESS: completeness_check(result.path, [p.sample_id for p in prompts]),
        ERROR_RATE: error_rate_check(result.path, config.max_error_rate),
    }
    PartitionLineage(
        "synthetic_responses",
        key,
        result.data_version,
        inputs={"settings_digest": result.settings_digest},
        checks={name: outcome.passed for name, outcome in outcomes.items()},
    ).save(layout)
    if result.stale:
        context.log.warning(f"{result.stale} stored rows answered another request and were generated again")
    yield dg.MaterializeResult(
        data_version=dg.DataVersion(result.data_version),
        metadata=responses_metadata(result),
    )
    if result.truncated:
        context.log.warning(f"{result.truncated} samples hit max_tokens (finish_reason == 'length')")
    for name, outcome in outcomes.items():
        yield check_result(name, outcome)


def responses_metadata(result: "GenerationResult") -> dict[str, Any]:
    """A partition's materialization metadata: its table, row outcomes, throughput and completion lengths."""
    key = result.partition_key
    lengths = pl.read_parquet(result.path, columns=["completion_tokens", "status"]).filter(pl.col("status") == "ok")
    completion_lengths = lengths["completion_tokens"].drop_nulls().to_list()
    return {
        **parquet_table(result.path, result.total, partitioned=True),
        "stale_regenerated": result.stale,
        "stale_reasons": counts_table(result.stale_reasons, "reason"),
        "settings_digest": result.settings_digest,
        "ok": result.ok,
        "failed": result.failed,
        "truncated": result.truncated,
        # issue 25: how much of the training text the served model wrote itself
        "turns_regenerated": result.turns_regenerated,
        "model_tokens": result.model_tokens,
        "resumed": result.resumed,
        "requested": result.requested,
        "retries": result.retries,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "output_tokens_per_s": round(result.output_tokens_per_s, 1),
        "requests_per_s": round(result.requests_per_s, 2),
        "latency_p50_s": result.latency_p50_s,
        "latency_p95_s": result.latency_p95_s,
        "wall_s": round(result.wall_s, 1),
        "model": result.model or "",
        "error_rate": result.error_rate,
        "top_errors": counts_table(result.top_errors, "error"),
        "retry_reasons": counts_table(result.retry_reasons, "reason"),
        "path": dg.MetadataValue.path(str(result.path)),
        "completion_length_histogram": dg.MetadataValue.md(
            plots.histogram_markdown(completion_lengths, f"Completion length, partition {key}", "tokens")
        ),
    }
