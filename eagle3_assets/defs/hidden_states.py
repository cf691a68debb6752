"""``hidden_states``: the verifier's auxiliary hidden states for every ok response of a partition.

The Dagster layer of ``hidden_states/`` (the same concept one layer up: this asset, that room its engine).
"""

from pathlib import Path
from typing import Any

import dagster as dg
import polars as pl

from eagle3_assets.core import settings
from eagle3_assets.core.lineage import HIDDEN_STATES_CODE_VERSION, LINEAGE_FILE, PartitionLineage, record_checks
from eagle3_assets.core.settings import setting
from eagle3_assets.defs import plots
from eagle3_assets.defs.checks import check_result
from eagle3_assets.defs.metadata import parquet_table
from eagle3_assets.defs.partitions import PROMPT_PARTITIONS, partition_key_of
from eagle3_assets.defs.resources import DataStoreResource, SettingsConfig, VerifierResource
from eagle3_assets.defs.responses import synthetic_responses
from eagle3_assets.hidden_states.extract import HiddenStatesConfig, HiddenStatesResult
from eagle3_assets.hidden_states.state_checks import version_index_path
from eagle3_assets.hidden_states.storage_format import STORAGE_DTYPES
from eagle3_assets.hidden_states.vllm_backend import VLLMBackendOptions

TOKEN_IDS = "hidden_states_token_ids_match"
FINITE = "hidden_states_finite"
ONE_PER_OK = "hidden_states_one_per_ok_response"


class HiddenStatesRunConfig(SettingsConfig):
    """The hidden_states asset's run config; ``hidden_states_config`` turns it into the core's config."""

    max_seq_len: int = setting(HiddenStatesConfig.max_seq_len, gt=1)
    """Tokens kept per sample (longer ones are cut)."""
    dtype: str = setting(HiddenStatesConfig.dtype, check=settings.one_of(*STORAGE_DTYPES))
    """Storage dtype of the hidden states: float8_e4m3fn halves bf16's bytes (one scale per token and layer)."""
    batch_tokens: int = setting(HiddenStatesConfig.batch_tokens, gt=0)
    """hf backend: padded tokens per forward pass."""
    concurrency: int = setting(VLLMBackendOptions.concurrency, gt=0)
    """vllm backend: requests in flight over the extraction servers."""
    store_budget_gib: float | None = setting(None, ge=0.0)
    """State files kept per partition, GiB: empty stores all; 0 stores none (draft_model trains online); more keeps the
    first samples (hybrid)."""


def hidden_states_config(config: HiddenStatesRunConfig, verifier: VerifierResource) -> HiddenStatesConfig:
    """The core's HiddenStatesConfig from the asset's run config (same-named fields) and the verifier resource."""
    return settings.core_config(
        HiddenStatesConfig,
        config,
        layer_ids=verifier.layer_id_list(),
        # the backend and its servers are the verifier resource's (EAGLE3_HIDDEN_STATES_*), overridable per run
        backend=verifier.hidden_states_backend,
        device=verifier.device,
        precision=verifier.precision,
        store_budget_bytes=None if config.store_budget_gib is None else int(config.store_budget_gib * 2**30),
        vllm=settings.core_config(
            VLLMBackendOptions,
            config,
            urls=tuple(verifier.hidden_states_urls()),
            storage_path=verifier.hidden_states_storage or None,
            outage_budget_s=verifier.hidden_states_outage_budget_s,
            # a remote extraction deployment sits behind the same key as the generation servers
            api_key=settings.read_api_key(),
        ),
    )


@dg.asset(
    partitions_def=PROMPT_PARTITIONS,
    deps=[synthetic_responses],
    group_name="hidden_states",
    kinds={"pytorch", "safetensors"},
    code_version=HIDDEN_STATES_CODE_VERSION,
    description=(
        "For every ok response of the partition: the training conversation rendered with the verifier's "
        "chat template (loss mask on assistant tokens), run through the verifier, and its auxiliary hidden "
        "states plus the last layer's output stored in speculators' offline layout. Resumable per sample. "
        "Computed by transformers in this process (backend hf) or by vLLM extraction servers (backend vllm)."
    ),
    check_specs=[
        dg.AssetCheckSpec(
            TOKEN_IDS, asset="hidden_states", blocking=True, description="Stored token_ids equal input_ids."
        ),
        dg.AssetCheckSpec(
            FINITE, asset="hidden_states", blocking=True, description="No NaN or Inf in any stored tensor."
        ),
        dg.AssetCheckSpec(
            ONE_PER_OK, asset="hidden_states", blocking=True, description="One stored sample per ok response."
        ),
    ],
)
def hidden_states(
    context: dg.AssetExecutionContext,
    config: HiddenStatesRunConfig,
    data_store: DataStoreResource,
    verifier: VerifierResource,
):
    # lazy: looked up when called, so a test can replace it
    from eagle3_assets.hidden_states import (
        check_finite,
        check_one_per_ok_response,
        check_token_ids,
        extract_partition,
        publish,
    )

    _CHECKS = {TOKEN_IDS: check_token_ids, FINITE: check_finite, ONE_PER_OK: check_one_per_ok_response}

    layout = data_store.layout
    key = partition_key_of(context)
    stage_config = hidden_states_config(config, verifier)
    result = extract_partition(layout, key, verifier.resolved_path(), stage_config, log=context.log.info)

    # One version from here on: the data version, the metadata, the checks and the outcomes recorded all describe
    # the same build, even when another run (an automation, a second launch) publishes a rebuild meanwhile.
    with publish.pinned(layout, [key]) as dirs:
        folder = dirs[key]
        recorded = PartitionLineage.load_file(folder / LINEAGE_FILE)
        yield dg.MaterializeResult(
            data_version=dg.DataVersion(recorded.data_version) if recorded else None,
            metadata=hidden_states_metadata(result, key, stage_config.backend, version_index_path(layout, key, folder)),
        )
        outcomes = {name: check(layout, key, folder) for name, check in _CHECKS.items()}
        record_checks(layout, "hidden_states", key, {name: o.passed for name, o in outcomes.items()}, folder)
    for name, outcome in outcomes.items():
        yield check_result(name, outcome)


def hidden_states_metadata(
    result: HiddenStatesResult, key: str, backend: str, index_path: Path | None = None
) -> dict[str, Any]:
    """A partition's materialization metadata: its index table, what was stored, throughput and sequence lengths.
    ``index_path``: the index of the version the run pinned (default: the current one)."""
    index_path = index_path or result.index_path
    lengths = pl.read_parquet(index_path)["seq_len"].to_list()
    return {
        # one row per stored sample in the partition's index (the tensors are in safetensors files)
        **parquet_table(index_path, result.samples, partitioned=True),
        "stored": result.stored,
        # how many samples keep a state file (all, unless built for online or hybrid training)
        "samples_with_states": result.samples_with_states,
        "skipped_existing": result.skipped_existing,
        "failed_responses_excluded": result.failed_responses_excluded,
        "truncated_at_max_seq_len": result.truncated,
        "tokens": result.tokens,
        "loss_tokens": result.loss_tokens,
        "served_token_ids": result.served_token_ids,
        "bytes": result.bytes,
        "bytes_per_token": round(result.bytes / result.tokens, 1) if result.tokens else 0,
        "tokens_per_s": round(result.tokens_per_s, 1),
        "backend": backend,
        "seconds": round(result.seconds, 1),
        "layer_ids": dg.MetadataValue.json(result.layer_ids),
        "hidden_size": result.hidden_size,
        "dtype": result.dtype,
        "path": dg.MetadataValue.path(str(result.data_dir)),
        "notes": dg.MetadataValue.json(result.notes),
        "sequence_length_histogram": dg.MetadataValue.md(
            plots.histogram_markdown(lengths, f"Sequence length, partition {key}", "tokens")
        ),
    }
