"""``regeneration_ablation``: drafts trained on the dataset's answers, last-turn and all-turns regeneration, compared.

The Dagster layer of ``evaluation/ablation.py`` (the same concept one layer up: this asset, that module its engine).

Opt-in: in its own group, outside the demo's stages and the automation, with no automation condition; materialize it
by name (``dagster asset materialize --select regeneration_ablation``). The core is
:mod:`eagle3_assets.evaluation.ablation`.
"""

import dagster as dg

from eagle3_assets.core import settings
from eagle3_assets.core.settings import setting
from eagle3_assets.defs.hidden_states import HiddenStatesRunConfig, hidden_states_config
from eagle3_assets.defs.inference import InferenceServerResource
from eagle3_assets.defs.prompts import raw_prompts
from eagle3_assets.defs.resources import DataStoreResource, SettingsConfig, VerifierResource
from eagle3_assets.evaluation.ablation import VARIANTS, AblationConfig, ablation_folder, run_ablation
from eagle3_assets.evaluation.online_metrics import OnlineConfig
from eagle3_assets.hidden_states.extract import HiddenStatesConfig
from eagle3_assets.training import TrainConfig

GROUP = "ablation"
# assets that only run when asked for by name: the demo's stages and the automation leave them out
OPT_IN_ASSETS = ("regeneration_ablation",)
_DEFAULT = AblationConfig()


def check_seeds(key: str, value: object) -> tuple[int, ...]:
    """Comma-separated distinct non-negative integers, at least one."""
    parts = [p.strip() for p in str(value).split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts) or len(set(parts)) != len(parts):
        raise settings.fail(key, value, "must be distinct non-negative integers, comma-separated, e.g. 0,1")
    return tuple(int(p) for p in parts)


check_seeds.allowed = "comma-separated seeds, e.g. `0,1`"  # type: ignore[attr-defined]


class RegenerationAblationRunConfig(SettingsConfig):
    """The ablation's size; defaults fit a few hundred ShareGPT conversations in ~3 hours on 2 cores."""

    conversations: int = setting(_DEFAULT.conversations, gt=0)
    """Training conversations (the same for every variant)."""
    held_out: int = setting(_DEFAULT.held_out, gt=0)
    """Held-out prompts (raw_prompts rows after them)."""
    humaneval: int = setting(_DEFAULT.humaneval, gt=0)
    """HumanEval problems evaluated."""
    token_budget: int = setting(_DEFAULT.token_budget, gt=0)
    """Packed training tokens per draft."""
    tokens_per_batch: int = setting(_DEFAULT.tokens_per_batch, gt=0)
    """Packed tokens per step."""
    seeds: str = setting(",".join(map(str, _DEFAULT.seeds)), check=check_seeds)
    """Seeds: the first trains every variant, the others train spread_variant again (the spread)."""
    spread_variant: str = setting(_DEFAULT.spread_variant, check=settings.one_of(*VARIANTS))
    """Variant trained with every seed."""
    partition_size: int = setting(_DEFAULT.partition_size, gt=0)
    """Conversations per partition."""
    max_conversation_chars: int = setting(_DEFAULT.max_conversation_chars, gt=0)
    """Longer conversations are passed over (each must fit the server's context whole)."""
    draft_vocab_size: int = setting(_DEFAULT.draft_vocab_size, gt=0)
    """Draft vocabulary size."""
    num_layers: int = setting(TrainConfig.num_layers, gt=0)
    """Draft decoder layers."""
    k: int = setting(_DEFAULT.k, gt=0)
    """num_speculative_tokens (and TTT steps)."""
    online: bool = setting(_DEFAULT.online)
    """Also measure acceptance in vLLM; false: offline only."""
    max_tokens: int = setting(OnlineConfig.max_tokens, gt=0)
    """Online: max_tokens per request."""
    max_val_batches: int = setting(_DEFAULT.max_val_batches, gt=0)
    """Validation batches per epoch."""
    offline_max_samples: int = setting(_DEFAULT.offline_max_samples or 64, gt=0)
    """Stored samples simulated offline per prompt set."""
    max_seq_len: int = setting(HiddenStatesConfig.max_seq_len, gt=1)
    """Tokens kept per training sample (longer ones are cut)."""


def ablation_config(config: RegenerationAblationRunConfig) -> AblationConfig:
    return AblationConfig(
        conversations=config.conversations, held_out=config.held_out, humaneval=config.humaneval,
        token_budget=config.token_budget, tokens_per_batch=config.tokens_per_batch,
        seeds=check_seeds("seeds", config.seeds), spread_variant=config.spread_variant,
        partition_size=config.partition_size, max_conversation_chars=config.max_conversation_chars,
        draft_vocab_size=config.draft_vocab_size, k=config.k,
        online=config.online, max_val_batches=config.max_val_batches, offline_max_samples=config.offline_max_samples,
    )  # fmt: skip


@dg.asset(
    deps=[raw_prompts],
    group_name=GROUP,
    kinds={"pytorch", "vllm"},
    description=(
        "Does regeneration pay for this model? Drafts of the same shape, seed and training token budget trained on "
        "the same conversations: (a) the dataset's own answers, (b) last-turn and (c) all-turns regeneration, "
        "compared offline and online on held-out prompts and HumanEval, with the generation cost of each and a "
        "second seed's spread. Opt-in: not part of the demo or the automation."
    ),
)
def regeneration_ablation(
    context: dg.AssetExecutionContext,
    config: RegenerationAblationRunConfig,
    data_store: DataStoreResource,
    verifier: VerifierResource,
    inference_server: InferenceServerResource,
) -> dg.MaterializeResult:
    train = TrainConfig(
        ttt_steps=config.k, num_layers=config.num_layers, device=verifier.device, precision=verifier.precision
    )
    log_dir = ablation_folder(data_store.layout) / "_logs"
    # acceptance only: batch-1 speed runs would add minutes per server and are not in the report
    online = OnlineConfig(
        max_tokens=config.max_tokens, speed_prompts=0, reasoning_parser=verifier.reasoning_parser, log_dir=log_dir
    )
    report = run_ablation(
        data_store.layout,
        verifier.resolved_path(),
        ablation_config(config),
        inference_server.generation_config(),
        hidden_states_config(HiddenStatesRunConfig(max_seq_len=config.max_seq_len), verifier),
        train,
        online,
        log=context.log.info,
    )
    per_draft: dict[str, object] = {}
    for row in report.rows:
        prefix = f"{row.variant}_seed{row.seed}"
        per_draft[f"{prefix}/tokens_trained"] = row.tokens_trained
        per_draft[f"{prefix}/generation_tokens"] = row.generation_tokens
        per_draft[f"{prefix}/generation_seconds"] = row.generation_seconds
        for column, value in row.acceptance.items():
            per_draft[f"{prefix}/{column}"] = dg.MetadataValue.float(value if value is not None else float("nan"))
    return dg.MaterializeResult(
        metadata={
            "report": dg.MetadataValue.md(report.markdown()),
            "conversations": report.conversations,
            "token_budget": report.token_budget,
            "seed_spread": dg.MetadataValue.json(report.spread()),
            **per_draft,
            "path": dg.MetadataValue.path(str(ablation_folder(data_store.layout))),
        }
    )
