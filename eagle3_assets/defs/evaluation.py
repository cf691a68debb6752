"""``draft_evaluation``: the trained draft's acceptance in vLLM speculative decoding and offline, vs an untrained."""

import dagster as dg

from eagle3_assets.defs.resources import DataStoreResource, VerifierResource


class DraftEvaluationConfig(dg.Config):
    k: int = 3  # num_speculative_tokens
    online: bool = True  # serve the verifier with the drafts in vLLM; False: offline simulation only
    offline: bool = True
    prompts: int = 32  # held-out prompts sent online
    max_tokens: int = 128
    concurrency: int = 1  # requests in flight per server (1: latency-bound decoding, where drafts pay off)
    partition: str = ""  # held-out partition; empty: the last hidden_states partition (draft_model's default)
    # stored samples simulated offline (~0.3-1 s each per draft on 2 busy cores); 0: the whole held-out partition
    offline_max_samples: int = 256
    untrained_baseline: bool = True
    # servers already running elsewhere (empty: start local CPU vLLM servers)
    plain_url: str = ""
    draft_url: str = ""
    served_model_name: str = ""


# No pool: by default the asset starts (and stops) its own local vLLM servers, one at a time, and never sends
# requests to the shared generation server that pool "vllm" protects.
@dg.asset(
    deps=[dg.AssetKey("draft_model")],
    group_name="evaluation",
    kinds={"vllm", "pytorch"},
    description=(
        "Acceptance of the trained EAGLE-3 draft where it runs: vLLM speculative decoding (method eagle3, k "
        "speculative tokens) on held-out prompts at temperature 0, read from vLLM's spec-decode counters, with "
        "tokens/s with and without the draft and a greedy-identity check; the same figures simulated offline from "
        "the held-out partition's stored hidden states; and both for an untrained draft of the same shape."
    ),
)
def draft_evaluation(
    context: dg.AssetExecutionContext,
    config: DraftEvaluationConfig,
    data_store: DataStoreResource,
    verifier: VerifierResource,
) -> dg.MaterializeResult:
    from eagle3_assets import plots
    from eagle3_assets.evaluation.evaluate import EvaluationOptions, run_evaluation
    from eagle3_assets.evaluation.online import OnlineConfig

    layout = data_store.layout
    verifier_path = verifier.resolved_path() if verifier.path.strip() else None
    options = EvaluationOptions(
        k=config.k,
        online=config.online,
        offline=config.offline,
        untrained=config.untrained_baseline,
        partition=config.partition or None,
        offline_max_samples=config.offline_max_samples or None,
        online_config=OnlineConfig(
            prompts=config.prompts,
            max_tokens=config.max_tokens,
            concurrency=config.concurrency,
            plain_url=config.plain_url or None,
            draft_url=config.draft_url or None,
            served_model_name=config.served_model_name or None,
            log_dir=layout.evaluation_dir / "_logs",
        ),
    )
    report = run_evaluation(layout, layout.draft_model_dir / "final", verifier_path, options, log=context.log.info)

    metadata: dict = {
        "table": dg.MetadataValue.md(report.markdown()),
        "k": report.k,
        "held_out_partition": report.held_out_partition or "",
        "report": dg.MetadataValue.path(str(layout.evaluation_dir / "report.json")),
    }
    for s in report.stats:
        metadata[f"{s.method}_{s.label}_mean_acceptance_length"] = dg.MetadataValue.float(
            round(s.mean_acceptance_length, 4) if s.drafts else float("nan")
        )
    for label in report.labels():
        speedup = report.speedup(label)
        if speedup is not None:
            metadata[f"speedup_{label}"] = dg.MetadataValue.float(round(speedup, 3))
        diff = report.agreement(label)
        if diff is not None:
            metadata[f"online_minus_offline_{label}"] = dg.MetadataValue.float(round(diff, 4))
    if report.online is not None:
        metadata["baseline_tokens_per_second"] = dg.MetadataValue.float(
            round(report.online.baseline_tokens_per_second, 2)
        )
        metadata["greedy_mismatches"] = dg.MetadataValue.json(report.online.mismatches)
    # a draft with no drafts measured (nothing qualified) plots as 0 rather than dropping out of the comparison
    groups = {
        f"{s.label} ({s.method})": [r if r == r else 0.0 for r in s.acceptance_rate_per_position] for s in report.stats
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
    return dg.MaterializeResult(metadata=metadata)
