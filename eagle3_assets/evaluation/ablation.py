"""Regeneration ablation (issue 25): does regenerating the training conversations with the served model pay?

Three drafts of the same shape, seed and training token budget are trained on the same conversations:

* ``dataset``: the dataset's own assistant answers (``raw_prompts``' ``dataset_turns.parquet``), rendered with the
  verifier's chat template, loss on every assistant turn the dataset wrote (:mod:`ablation_data`);
* ``last-turn``: ``EAGLE3_REGENERATE=last-turn`` rows (the model answers the last user turn; earlier turns are the
  dataset's history, not in the loss);
* ``all-turns``: ``EAGLE3_REGENERATE=all-turns`` rows (the model writes every assistant turn, in order).

Each is evaluated offline and online (vLLM) on the same held-out prompts (the rows of ``raw_prompts`` after the
conversations) and HumanEval; one variant is trained again with other seeds so the seed-to-seed spread stands beside
the differences. Everything lives under ``<data>/regeneration_ablation/``: ``eval/`` (the evaluation sets answered
once by the model, in last-turn mode, and their hidden states), one folder per variant (its responses, hidden states,
vocabulary and ``draft_model_seed<N>/``), ``report.md`` and ``report.json``. The project's own stages build each part
(generation engine, ``extract_partition``, ``build_vocab_mapping``, ``train_draft``, ``evaluate_offline``,
``evaluate_online``) and each reuses what is already built: a re-run generates, extracts and trains nothing new.

Equal budgets: every draft takes the same number of optimizer steps (``token_budget // tokens_per_batch``) in the same
number of epochs of the same length, chosen so the smallest variant's epoch still holds them (a packed batch never
holds more than ``tokens_per_batch`` tokens, so an epoch has at least ``ceil(tokens / tokens_per_batch)`` batches).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from eagle3_assets.core import hashing, storage
from eagle3_assets.core.partition_keys import partition_key
from eagle3_assets.core.settings import ConfigError
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.core.verifier import SPECULATIVE_TOKENS
from eagle3_assets.evaluation.ablation_data import AblationConversation, dataset_rows, select_conversations
from eagle3_assets.evaluation.ablation_report import AblationReport, DraftRow, write_ablation_report
from eagle3_assets.evaluation.offline import evaluate_offline, load_draft
from eagle3_assets.evaluation.prompt_sets import HELD_OUT, HUMANEVAL, Prompt, fitting_prompts, humaneval_prompts
from eagle3_assets.generation import generate_partition
from eagle3_assets.generation.records import PromptToGenerate
from eagle3_assets.hidden_states.extract import extract_partition
from eagle3_assets.training import build_vocab_mapping, train_draft
from eagle3_assets.training.checkpoints import FINAL_DIR
from eagle3_assets.training.vocab import RECIPE_DRAFT_VOCAB_SIZE

if TYPE_CHECKING:  # importing these pulls in torch
    from eagle3_assets.evaluation.online_metrics import OnlineConfig
    from eagle3_assets.generation.generation_config import GenerationConfig
    from eagle3_assets.hidden_states.extract import HiddenStatesConfig
    from eagle3_assets.training.train_config import TrainConfig

logger = logging.getLogger(__name__)
Log = Callable[[str], None]

VARIANTS = ("dataset", "last-turn", "all-turns")
FOLDER = "regeneration_ablation"
EVAL_FOLDER = "eval"
COST_FILE = "cost.json"
RUN_FILE = "ablation_run.json"
ONLINE_FILE = "online.json"


@dataclass(frozen=True)
class AblationConfig:
    conversations: int = 200  # training conversations, the same for every variant
    held_out: int = 16  # held-out prompts (the raw_prompts rows after the conversations)
    humaneval: int = 16  # HumanEval problems
    token_budget: int = 200_000  # packed training tokens per draft
    tokens_per_batch: int = 2048
    seeds: tuple[int, ...] = (0, 1)  # the first trains every variant; the others train `spread_variant` again
    spread_variant: str = "all-turns"
    partition_size: int = 100  # conversations per partition (the unit a re-run reuses)
    # longer conversations are passed over: each must fit the server's context whole (~4 characters per token)
    max_conversation_chars: int = 6000
    draft_vocab_size: int = RECIPE_DRAFT_VOCAB_SIZE
    k: int = SPECULATIVE_TOKENS
    online: bool = True
    max_val_batches: int = 4
    offline_max_samples: int | None = 64

    def validate(self) -> None:
        for name in ("conversations", "held_out", "humaneval", "token_budget", "tokens_per_batch", "partition_size",
                     "max_conversation_chars", "draft_vocab_size", "k", "max_val_batches"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}={value!r}: must be a positive integer")
        if self.token_budget < self.tokens_per_batch:
            raise ConfigError(
                f"token_budget={self.token_budget!r}: below one step of tokens_per_batch={self.tokens_per_batch}; "
                "raise token_budget or lower tokens_per_batch"
            )
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or any(s < 0 for s in self.seeds):
            raise ConfigError(f"seeds={list(self.seeds)!r}: must be distinct non-negative integers, at least one")
        if self.spread_variant not in VARIANTS:
            raise ConfigError(f"spread_variant={self.spread_variant!r}: must be one of {', '.join(VARIANTS)}")

    def runs(self) -> list[tuple[str, int]]:
        """(variant, seed) of every draft trained."""
        return [(v, self.seeds[0]) for v in VARIANTS] + [(self.spread_variant, s) for s in self.seeds[1:]]


@dataclass(frozen=True)
class _SeedLayout(DataLayout):
    """A variant's layout whose draft goes to ``draft_model_seed<N>``: seeds share the data, not the draft."""

    draft_name: str = "draft_model"

    @property
    def draft_model_dir(self) -> Path:
        return self.asset_dir(self.draft_name)


@dataclass
class _Variant:
    name: str
    layout: DataLayout
    keys: list[str]
    rows: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    capped_tokens: int = 0  # sum of min(sample, tokens_per_batch): what one epoch packs
    cost: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Stages:
    """How each stage is configured (the project's own settings for each)."""

    verifier: Path
    generation: GenerationConfig | None
    hidden: HiddenStatesConfig
    train: TrainConfig
    online: OnlineConfig | None
    log: Log


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _read(path: Path) -> dict[str, Any]:
    try:
        data = storage.read_json(path)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _add_cost(variant: _Variant, stage: str, key: str, tokens: int, seconds: float) -> None:
    entry = variant.cost.setdefault(stage, {}).setdefault(key, {"tokens": 0, "seconds": 0.0})
    entry["tokens"] += int(tokens)
    entry["seconds"] = round(entry["seconds"] + float(seconds), 2)
    storage.write_json_atomic(variant.cost, variant.layout.root / COST_FILE)


def _total(variant: _Variant, stage: str, what: str) -> float:
    return sum(entry[what] for entry in variant.cost.get(stage, {}).values())


def _generate(
    layout: DataLayout, key: str, prompts: Sequence[PromptToGenerate], mode: str, stages: _Stages
) -> tuple[int, float]:
    """(completion tokens generated, seconds) for one partition in ``mode``; (0, 0) when it was all on disk."""
    if stages.generation is None:
        raise ConfigError(
            "the regeneration ablation needs an inference server for its generated variants and evaluation sets "
            "(EAGLE3_VLLM_URL or a local vLLM)"
        )
    config = dataclasses.replace(stages.generation, regenerate=mode)
    result = generate_partition(prompts, key, layout, config, log=stages.log)
    if result.ok == 0:
        raise RuntimeError(f"{layout.root} partition {key}: every {mode} request failed ({result.top_errors})")
    return (result.new_completion_tokens, result.wall_s) if result.requested else (0, 0.0)


def _extract(layout: DataLayout, key: str, stages: _Stages) -> float:
    """Hidden states of one partition (valid stored samples kept); the seconds spent computing new ones."""
    result = extract_partition(layout, key, stages.verifier, stages.hidden, log=stages.log)
    return result.extract_seconds if result.stored else 0.0


def _copy_if_changed(source: Path, target: Path) -> None:
    if not target.exists() or hashing.file_digest(target) != hashing.file_digest(source):
        storage.write_bytes_atomic(source.read_bytes(), target)


def _build_eval_sets(
    root: Path, held: list[PromptToGenerate], config: AblationConfig, stages: _Stages
) -> tuple[DataLayout, dict[str, str]]:
    """The held-out prompts and HumanEval answered once by the model (last-turn), with their hidden states."""
    layout = DataLayout(root / EVAL_FOLDER)
    first = -(-config.conversations // config.partition_size)
    keys = {HELD_OUT: partition_key(first), HUMANEVAL: partition_key(first + 1)}
    humaneval = [PromptToGenerate(p.sample_id, p.messages) for p in humaneval_prompts(config.humaneval)]
    for name, prompts in ((HELD_OUT, held), (HUMANEVAL, humaneval)):
        _generate(layout, keys[name], prompts, "last-turn", stages)
        _extract(layout, keys[name], stages)
    return layout, keys


def _write_dataset_partition(
    layout: DataLayout, key: str, convs: Sequence[AblationConversation], stages: _Stages
) -> None:
    """The dataset variant's partition, rewritten only when its conversations or the verifier changed."""
    manifest = layout.responses_manifest_path(key)
    wanted = _digest([[c.sample_id, c.dataset] for c in convs] + [str(stages.verifier)])
    if layout.responses_path(key).exists() and _read(manifest).get("dataset_digest") == wanted:
        return
    frame, lost = dataset_rows(convs, stages.verifier, key)
    if lost:
        stages.log(f"dataset {key}: {lost} assistant turns left out of the loss (the template renders them apart)")
    storage.write_parquet_atomic(frame, layout.responses_path(key))
    storage.write_json_atomic({"dataset_digest": wanted, "rows": frame.height}, manifest)


def _build_variant(
    name: str, root: Path, convs: list[AblationConversation], eval_layout: DataLayout, held_key: str,
    config: AblationConfig, stages: _Stages,
) -> _Variant:  # fmt: skip
    """A variant's training partitions (responses, hidden states) and its copy of the held-out partition."""
    layout = DataLayout(root / name)
    size = config.partition_size
    keys = [partition_key(i) for i in range(-(-len(convs) // size))]
    variant = _Variant(name, layout, keys, cost=_read(layout.root / COST_FILE))
    for i, key in enumerate(keys):
        part = convs[i * size : (i + 1) * size]
        if name == "dataset":
            _write_dataset_partition(layout, key, part, stages)
        else:
            tokens, seconds = _generate(layout, key, [c.request() for c in part], name, stages)
            if tokens or seconds:
                _add_cost(variant, "generation", key, tokens, seconds)
        seconds = _extract(layout, key, stages)
        if seconds:
            _add_cost(variant, "extraction", key, 0, seconds)
    # validation during training: the same held-out answers for every variant
    _copy_if_changed(eval_layout.responses_path(held_key), layout.responses_path(held_key))
    _extract(layout, held_key, stages)
    for key in keys:
        index = pl.read_parquet(layout.hidden_states_index_path(key), columns=["seq_len", "n_loss_tokens"])
        variant.rows += index.height
        variant.tokens += int(index["seq_len"].sum())
        variant.loss_tokens += int(index["n_loss_tokens"].sum())
        variant.capped_tokens += int(index["seq_len"].clip(upper_bound=config.tokens_per_batch).sum())
    return variant


def training_plan(capped_tokens: Sequence[int], config: AblationConfig) -> tuple[int, int]:
    """(epochs, steps per epoch) every variant trains with: the budget's steps in epochs the smallest can fill."""
    steps = max(1, config.token_budget // config.tokens_per_batch)
    fewest_batches = max(1, min(-(-t // config.tokens_per_batch) for t in capped_tokens))
    epochs = -(-steps // fewest_batches)
    return epochs, -(-steps // epochs)


def _offline(
    draft_dir: Path, eval_layout: DataLayout, keys: dict[str, str], config: AblationConfig, stages: _Stages
) -> dict[str, float | None]:
    model = load_draft(draft_dir, stages.verifier)
    out: dict[str, float | None] = {}
    for name, key in keys.items():
        stats = evaluate_offline({"trained": model}, eval_layout, key, config.k, stages.verifier,
                                 config.offline_max_samples, stages.log, device=stages.train.device)  # fmt: skip
        out[f"offline/{name}"] = stats[0].mean_acceptance_length if stats and stats[0].drafts else None
    return out


def _train_one(
    variant: _Variant, seed: int, plan: tuple[int, int], held_key: str, eval_layout: DataLayout,
    eval_keys: dict[str, str], config: AblationConfig, stages: _Stages,
) -> DraftRow:  # fmt: skip
    """Train (or reuse) one draft and simulate its acceptance offline."""
    layout = _SeedLayout(variant.layout.root, f"draft_model_seed{seed}")
    epochs, per_epoch = plan
    sizes = {"tokens_per_batch": config.tokens_per_batch, "max_val_batches": config.max_val_batches}
    train = dataclasses.replace(stages.train, seed=seed, epochs=epochs, max_steps_per_epoch=per_epoch, **sizes)
    data = {k: hashing.file_digest(variant.layout.responses_path(k)) for k in [*variant.keys, held_key]}
    key = _digest([train.fingerprint_fields(), epochs, data, str(stages.verifier), config.draft_vocab_size,
                   config.k, config.offline_max_samples, eval_keys, config.held_out, config.humaneval])  # fmt: skip
    run_path = layout.draft_model_dir / RUN_FILE
    cached = _read(run_path)
    final = layout.draft_model_dir / FINAL_DIR
    if cached.get("key") == key and (final / "config.json").exists():
        stages.log(f"ablation {variant.name} seed {seed}: trained and evaluated before, reused")
        return DraftRow(**cached["row"])
    target = json.loads((stages.verifier / "config.json").read_text())["vocab_size"]
    build_vocab_mapping(variant.layout, variant.keys, config.draft_vocab_size, target_vocab_size=int(target))
    result = train_draft(layout, variant.keys, held_key, stages.verifier, train, log=stages.log)
    row = DraftRow(
        variant=variant.name, seed=seed, conversations=variant.rows, train_tokens_available=variant.tokens,
        loss_tokens_available=variant.loss_tokens, model_tokens=0 if variant.name == "dataset" else variant.loss_tokens,
        token_budget=config.token_budget, tokens_trained=result.tokens_trained, steps=result.steps,
        epochs=result.epochs, generation_tokens=int(_total(variant, "generation", "tokens")),
        generation_seconds=round(_total(variant, "generation", "seconds"), 1),
        extraction_seconds=round(_total(variant, "extraction", "seconds"), 1),
        training_seconds=round(result.seconds, 1), acceptance=_offline(final, eval_layout, eval_keys, config, stages),
        draft_dir=str(final),
    )  # fmt: skip
    storage.write_json_atomic({"key": key, "row": dataclasses.asdict(row)}, run_path)
    return row


def _online(rows: list[DraftRow], eval_layout: DataLayout, held: list[PromptToGenerate], root: Path,
            config: AblationConfig, stages: _Stages, notes: list[str]) -> None:  # fmt: skip
    """Every draft in vLLM on the held-out prompts and HumanEval (one plain baseline); reused while the drafts and
    settings are the same."""
    # lazy: looked up when called, so a test can replace it
    from eagle3_assets.evaluation.online_metrics import OnlineConfig, evaluate_online

    # every variant measured alike: greedy only (a sampled batch would be the first variant's alone)
    cfg = dataclasses.replace(stages.online or OnlineConfig(), k=config.k, sampled_temperature=0.0)
    sets = {
        HELD_OUT: [Prompt(p.sample_id, list(p.messages)) for p in held],
        HUMANEVAL: humaneval_prompts(config.humaneval),
    }
    for name, prompts in sets.items():
        sets[name], dropped = fitting_prompts(prompts, stages.verifier, cfg.max_model_len - cfg.max_tokens)
        if dropped:
            notes.append(f"online {name}: {len(dropped)} prompts longer than the servers' context left out")
    drafts = {row.key(): Path(row.draft_dir) for row in rows}
    key = _digest([{k: hashing.file_digest(d / "model.safetensors") for k, d in drafts.items()},
                   {k: [p.sample_id for p in v] for k, v in sets.items()}, cfg.max_tokens, cfg.k])  # fmt: skip
    cached = _read(root / ONLINE_FILE)
    if cached.get("key") != key:
        result = evaluate_online(stages.verifier, drafts, sets, cfg, stages.log)
        values = {f"{s.label}|online/{s.prompt_set}": s.mean_acceptance_length for s in result.stats}
        values = {k: v if math.isfinite(v) else None for k, v in values.items()}  # no drafts measured: None
        cached = {"key": key, "values": values}
        storage.write_json_atomic(cached, root / ONLINE_FILE)
    for row in rows:
        for name in (HELD_OUT, HUMANEVAL):
            row.acceptance[f"online/{name}"] = cached["values"].get(f"{row.key()}|online/{name}")


def run_ablation(
    layout: DataLayout,
    verifier: str | Path,
    config: AblationConfig,
    generation: GenerationConfig | None,
    hidden: HiddenStatesConfig,
    train: TrainConfig,
    online: OnlineConfig | None = None,
    log: Log | None = None,
) -> AblationReport:
    """Build what is missing, train the drafts, evaluate them and write ``report.md`` / ``report.json``."""
    config.validate()
    stages = _Stages(Path(verifier).expanduser().resolve(), generation, hidden, train, online, log or logger.info)
    root = layout.root / FOLDER
    convs, held = select_conversations(layout, config.conversations, config.held_out, config.max_conversation_chars)
    eval_layout, eval_keys = _build_eval_sets(root, held, config, stages)
    held_key = next(iter(eval_keys.values()))
    variants = [_build_variant(v, root, convs, eval_layout, held_key, config, stages) for v in VARIANTS]
    by_name = {v.name: v for v in variants}
    plan = training_plan([v.capped_tokens for v in variants], config)
    stages.log(f"ablation: every draft trains {plan[0]} epochs x {plan[1]} steps of {config.tokens_per_batch} tokens")
    rows = [_train_one(by_name[v], s, plan, held_key, eval_layout, eval_keys, config, stages) for v, s in config.runs()]
    notes = [f"conversations: the first {len(convs)} rows of raw_prompts with a dataset answer; held-out: the next "
             f"{len(held)}; every draft: {plan[0]} epochs x {plan[1]} steps"]  # fmt: skip
    if config.online:
        _online(rows, eval_layout, held, root, config, stages, notes)
    else:
        notes.append("online evaluation off (online=false)")
    report = AblationReport(
        conversations=len(convs), held_out_prompts=len(held), humaneval_prompts=config.humaneval,
        token_budget=config.token_budget, tokens_per_batch=config.tokens_per_batch, k=config.k,
        verifier=str(stages.verifier), rows=rows, notes=notes,
    )  # fmt: skip
    write_ablation_report(report, root)
    return report


def ablation_folder(layout: DataLayout) -> Path:
    return layout.root / FOLDER


__all__ = ["VARIANTS", "AblationConfig", "ablation_folder", "run_ablation", "training_plan"]
