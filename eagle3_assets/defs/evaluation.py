"""``draft_evaluation``: the trained draft's acceptance in vLLM speculative decoding and offline, vs an untrained.

The Dagster layer of ``evaluation/`` (the same concept one layer up: this asset, that room its engine).
"""

from typing import TYPE_CHECKING, Any

import dagster as dg

from eagle3_assets.core import settings
from eagle3_assets.core.settings import setting
from eagle3_assets.defs import plots
from eagle3_assets.defs.metadata import table
from eagle3_assets.defs.resources import (
    DataStoreResource,
    EvaluationServersResource,
    SettingsConfig,
    VerifierResource,
)
from eagle3_assets.evaluation.evaluate import EvaluationOptions, missing_states_extraction, run_evaluation
from eagle3_assets.evaluation.online_metrics import OnlineConfig
from eagle3_assets.evaluation.prompt_sets import HELD_OUT

if TYPE_CHECKING:
    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.evaluation.evaluation_report import EvaluationReport


class DraftEvaluationRunConfig(SettingsConfig):
    """The draft_evaluation asset's run config; ``evaluation_options`` turns it into the core's options."""

    k: int = setting(EvaluationOptions.k, gt=0)
    """num_speculative_tokens."""
    online: bool = setting(EvaluationOptions.online)
    """Serve the verifier with the drafts in vLLM; false: offline only."""
    offline: bool = setting(EvaluationOptions.offline)
    """Simulate acceptance offline from the held-out partition's hidden states."""
    prompts: int = setting(OnlineConfig.prompts, gt=0)
    """Held-out prompts sent online (the `held-out` prompt set)."""
    humaneval_prompts: int = setting(OnlineConfig.humaneval_prompts, ge=0)
    """HumanEval problems sent online (the `humaneval` prompt set); 0: all 164."""
    max_tokens: int = setting(OnlineConfig.max_tokens, gt=0)
    """max_tokens per online request."""
    concurrency: int = setting(OnlineConfig.concurrency, gt=0)
    """Requests in flight per server for each prompt set's acceptance (which does not depend on it)."""
    speed_prompts: int = setting(OnlineConfig.speed_prompts, ge=0)
    """Batch-1 speed-up on each prompt set's first N prompts, each sent to the plain verifier and to the draft one
    request at a time, alternating which goes first: the median per-prompt ratio with its 95% bootstrap interval; the
    draft pays only where the interval's lower bound is above 1.0. 0: none."""
    sampled_temperature: float = setting(OnlineConfig.sampled_temperature, ge=0)
    """The trained draft's acceptance batch again at this temperature (vLLM's rejection sampling), beside the greedy
    figure; 0: greedy only."""
    partition: str = setting("")
    """Held-out partition; empty: the last hidden_states partition whose checks passed."""
    # ~0.3-1 s per sample and draft on 2 busy cores
    offline_max_samples: int | None = setting(256, gt=0)
    """Stored samples simulated offline; empty: the whole held-out partition."""
    untrained_baseline: bool = setting(True)
    """Also measure an untrained draft of the same shape."""


def evaluation_options(
    config: DraftEvaluationRunConfig,
    servers: EvaluationServersResource,
    layout: "DataLayout",
    verifier: VerifierResource | None = None,
) -> EvaluationOptions:
    """The core's EvaluationOptions from the asset's run config, the evaluation servers and the verifier resource
    (its reasoning parser and device; None: their defaults)."""
    verifier = verifier or VerifierResource()
    online_config = settings.core_config(  # same-named fields by name (k is the options' too)
        OnlineConfig,
        config,
        prompt_sets=tuple(servers.prompt_set_list()),
        reasoning_parser=verifier.reasoning_parser,
        plain_url=servers.plain_url.strip().rstrip("/") or None,
        draft_url=servers.draft_url.strip().rstrip("/") or None,
        served_model_name=servers.served_model_name or None,
        api_key=servers.api_key(),
        log_dir=layout.evaluation_dir / "_logs",
    )
    return settings.core_config(
        EvaluationOptions,
        config,
        untrained=config.untrained_baseline,
        partition=config.partition or None,
        device=verifier.device,
        online_config=online_config,
        extraction=missing_states_extraction(verifier),
    )


def evaluation_table(report: "EvaluationReport") -> dg.TableMetadataValue:
    """One sortable row per (draft, method): acceptance length, acceptance per position, speed."""
    positions = [f"acc_at_{j + 1}" for j in range(report.k)]
    columns = [
        ("prompt_set", "string", "held-out (the held-out partition) or humaneval (HumanEval's problems)"),
        ("draft", "string", "trained or untrained"),
        ("method", "string", "online (vLLM speculative decoding) or offline (simulated from hidden states)"),
        ("drafts", "int", "Proposals of k tokens measured."),
        ("failed", "int", "Online: requests with no reply (timeout, trickled or oversized body, error), in no figure."),
        ("mean_acceptance_length", "float", "1 + accepted tokens per draft, in [1, k+1]."),
        *[(n, "float", f"Drafts whose first {j + 1} tokens were accepted, share.") for j, n in enumerate(positions)],
        ("tokens_per_second", "float", "Online: output tokens/s with this draft, batch 1 (its paired requests)."),
        (
            "speedup",
            "float",
            "Online: median per-prompt tokens/s ratio over the plain verifier's (paired requests); empty where a "
            "speed request failed.",
        ),
        ("speedup_low", "float", "Online: the speed-up's 95% bootstrap interval, lower bound (prompts resampled)."),
        ("speedup_high", "float", "Online: the speed-up's 95% bootstrap interval, upper bound."),
        (
            "speedup_verdict",
            "string",
            "Online: pays (the interval above 1.0), does not pay (below), inconclusive (holds 1.0), withheld (a speed "
            "request failed).",
        ),
        ("speed_requests_failed", "int", "Online: failed speed requests, this draft's and the plain verifier's."),
    ]
    records = []
    for s in report.stats:
        record = {
            "prompt_set": s.prompt_set,
            "draft": s.label,
            "method": s.method,
            "drafts": s.drafts,
            "failed": s.failed if s.method == "online" else None,
            "mean_acceptance_length": round(s.mean_acceptance_length, 4),
            **{name: round(rate, 4) for name, rate in zip(positions, s.acceptance_rate_per_position, strict=False)},
            "tokens_per_second": round(s.tokens_per_second, 2) if s.tokens_per_second is not None else None,
            "speedup": None,
            "speedup_low": None,
            "speedup_high": None,
            "speedup_verdict": report.verdict(s.label, s.prompt_set) if s.method == "online" else None,
            "speed_requests_failed": report.speed_failed(s.label, s.prompt_set) if s.method == "online" else None,
        }
        if s.method == "online" and (interval := report.speedup_interval(s.label, s.prompt_set)) is not None:
            for name, value in zip(("speedup", "speedup_low", "speedup_high"), interval, strict=True):
                record[name] = round(value, 3) if value is not None else None
        records.append(record)
    return table(records, columns)


# No pool: by default the asset starts (and stops) its own local vLLM servers, one at a time, and never sends
# requests to the shared generation server that pool "vllm" protects.
@dg.asset(
    deps=[dg.AssetKey("draft_model")],
    group_name="evaluation",
    kinds={"vllm", "pytorch"},
    description=(
        "Acceptance of the trained EAGLE-3 draft where it runs: vLLM speculative decoding (method eagle3, k "
        "speculative tokens) at temperature 0 on each named prompt set (EAGLE3_EVAL_PROMPT_SETS: held-out prompts, "
        "HumanEval's 164 problems), counted from the per-request speculative metrics of its own requests, with "
        "batch-1 tokens/s with and without the draft and a greedy-identity check; the same figures simulated offline "
        "from the held-out partition's hidden states (computed by EAGLE3_HIDDEN_STATES_BACKEND where the partition "
        "was built for online training and stores none); and both for an untrained draft of the same shape."
    ),
)
def draft_evaluation(
    context: dg.AssetExecutionContext,
    config: DraftEvaluationRunConfig,
    data_store: DataStoreResource,
    verifier: VerifierResource,
    evaluation_servers: EvaluationServersResource,
) -> dg.MaterializeResult:
    layout = data_store.layout
    verifier_path = verifier.resolved_path() if verifier.path.strip() else None
    options = evaluation_options(config, evaluation_servers, layout, verifier)
    report = run_evaluation(layout, layout.draft_model_dir / "final", verifier_path, options, log=context.log.info)

    return dg.MaterializeResult(metadata=evaluation_metadata(report, layout))


def evaluation_metadata(report: "EvaluationReport", layout: "DataLayout") -> dict[str, Any]:
    """The evaluation's materialization metadata: the table, acceptance and speed-up per draft, method and prompt
    set, online vs offline agreement, and acceptance per draft position."""
    metadata: dict[str, Any] = {
        "table": evaluation_table(report),
        "dagster/row_count": dg.MetadataValue.int(len(report.stats)),
        "report_markdown": dg.MetadataValue.md(report.markdown()),
        "k": report.k,
        "held_out_partition": report.held_out_partition or "",
        "report": dg.MetadataValue.path(str(layout.evaluation_dir / "report.json")),
    }
    for s in report.stats:
        where = "" if s.prompt_set == HELD_OUT else f"_{s.prompt_set}"
        metadata[f"{s.method}_{s.label}{where}_mean_acceptance_length"] = dg.MetadataValue.float(
            round(s.mean_acceptance_length, 4) if s.drafts else float("nan")
        )
        if s.method != "online":
            continue
        metadata[f"failed_requests_{s.label}{where}"] = dg.MetadataValue.int(s.failed)
        if speed_failed := report.speed_failed(s.label, s.prompt_set):
            # never a number computed over a batch whose failed requests kept their wall time
            metadata[f"speedup_{s.label}{where}"] = dg.MetadataValue.text(
                f"withheld: {speed_failed} speed requests failed"
            )
        elif (speedup := report.speedup(s.label, s.prompt_set)) is not None:
            metadata[f"speedup_{s.label}{where}"] = dg.MetadataValue.float(round(speedup, 3))
            metadata[f"speedup_verdict_{s.label}{where}"] = dg.MetadataValue.text(
                str(report.verdict(s.label, s.prompt_set))
            )
    for label in report.labels():
        diff = report.agreement(label)
        if diff is not None:
            metadata[f"online_minus_offline_{label}"] = dg.MetadataValue.float(round(diff, 4))
    for run in report.online_runs:
        where = "" if run.prompt_set == HELD_OUT else f"_{run.prompt_set}"
        metadata[f"failed_requests_plain{where}"] = dg.MetadataValue.int(run.failed)
        tps = run.baseline_tokens_per_second
        if tps == tps:
            metadata[f"baseline_tokens_per_second{where}"] = dg.MetadataValue.float(round(tps, 2))
    if report.online_runs:
        mismatches = {r.prompt_set: r.mismatches for r in report.online_runs}
        metadata["greedy_mismatches"] = dg.MetadataValue.json(mismatches)
    # a draft with no drafts measured (nothing qualified) plots as 0 rather than dropping out of the comparison
    groups = {
        f"{s.label} ({s.method}, {s.prompt_set})": [r if r == r else 0.0 for r in s.acceptance_rate_per_position]
        for s in report.stats
    }
    if groups:
        metadata["acceptance_per_position"] = dg.MetadataValue.md(
            plots.bars_markdown(
                groups,
                [f"pos {j + 1}" for j in range(report.k)],
                "Acceptance rate per draft position: trained vs untrained",
                "accepted / drafts",
            )
        )
    return metadata
