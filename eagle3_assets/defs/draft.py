"""``vocab_mapping`` and ``draft_model``: the draft vocabulary and the trained EAGLE-3 draft."""

import json
import re
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg

from eagle3_assets.core import settings
from eagle3_assets.core.lineage import held_out_key, partitions_passing_checks
from eagle3_assets.core.settings import setting
from eagle3_assets.core.verifier import resolve_layer_ids, verifier_shape
from eagle3_assets.defs import metadata, plots
from eagle3_assets.defs.hidden_states import hidden_states
from eagle3_assets.defs.resources import DataStoreResource, SettingsConfig, VerifierResource
from eagle3_assets.net.ports import find_free_port
from eagle3_assets.training import TrainResult, build_vocab_mapping, train_draft
from eagle3_assets.training.checkpoints import CHECKPOINT_DIR
from eagle3_assets.training.launch import TrainSpec, failure_message, torchrun_command, worker_env
from eagle3_assets.training.train_config import LOSS_ON, OPTIMIZERS, TrainConfig
from eagle3_assets.training.vocab import DRAFT_VOCAB_SIZE

if TYPE_CHECKING:
    from eagle3_assets.training import TrainResult


def hidden_state_partitions(data_store: DataStoreResource) -> list[str]:

    # Only partitions whose checks passed (and whose responses did) train the draft; see docs/reliability.md.
    keys, excluded = partitions_passing_checks(
        data_store.layout, sorted(data_store.layout.partition_files("hidden_states"))
    )
    for key, why in excluded.items():
        dg.get_dagster_logger().warning(f"hidden_states partition {key} left out of training: {why}")
    if not keys:
        why = f" ({len(excluded)} left out: {dict(list(excluded.items())[:3])})" if excluded else ""
        raise FileNotFoundError(
            f"no usable hidden_states partitions under {data_store.layout.asset_dir('hidden_states')}{why}: "
            "materialize them (and their synthetic_responses) until their checks pass"
        )
    return keys


def split_partitions(keys: list[str], val_partition: str) -> tuple[list[str], str]:
    """(training keys, validation key): the chosen one, or by the one hold-out rule (``lineage.held_out_key``)."""
    if len(keys) < 2:
        raise ValueError(
            f"draft training needs at least 2 hidden_states partitions (one is held out for validation), found {keys}"
        )
    val = held_out_key(keys, val_partition) or ""
    if val not in keys:
        raise ValueError(f"val_partition={val_partition!r} is not a materialized hidden_states partition ({keys})")
    return [k for k in keys if k != val], val


class HeldOutRunConfig(SettingsConfig):
    """The run config of the assets that hold one partition out (vocab_mapping, draft_model): declared once, picked
    by the one rule (``split_partitions``), so the vocabulary never counts the partition the draft validates on."""

    val_partition: str = setting("")
    """Held-out partition (not trained on, not counted in the vocabulary); empty: the last hidden_states partition
    whose checks passed."""


class VocabMappingRunConfig(HeldOutRunConfig):
    draft_vocab_size: int = setting(DRAFT_VOCAB_SIZE, gt=0)
    """Draft vocabulary size (capped at the verifier's)."""


@dg.asset(
    deps=[hidden_states],
    group_name="draft",
    kinds={"pytorch", "numpy"},
    description=(
        "The draft vocabulary: the most frequent assistant tokens of the training partitions (loss-masked "
        "frequencies), mapped with speculators' build_vocab_mappings_from_distribution (d2t, t2d)."
    ),
)
def vocab_mapping(
    config: VocabMappingRunConfig, data_store: DataStoreResource, verifier: VerifierResource
) -> dg.MaterializeResult:
    verifier_config = json.loads((verifier.resolved_path() / "config.json").read_text())
    train_keys, val_key = split_partitions(hidden_state_partitions(data_store), config.val_partition)
    result = build_vocab_mapping(
        data_store.layout, train_keys, config.draft_vocab_size, target_vocab_size=int(verifier_config["vocab_size"])
    )
    return dg.MaterializeResult(
        metadata={
            **metadata.same_named(
                result, "draft_vocab_size", "requested_draft_vocab_size", "target_vocab_size", "capped"
            ),
            "distinct_assistant_tokens": result.distinct_tokens,
            "assistant_tokens": result.loss_tokens,
            "coverage": dg.MetadataValue.float(round(result.coverage, 6)),
            "partitions": dg.MetadataValue.json(result.partitions),
            "held_out_partition": val_key,
            metadata.ROW_COUNT: dg.MetadataValue.int(result.draft_vocab_size),  # rows of d2t: one per draft token
            "notes": dg.MetadataValue.json(result.notes),
            "path": dg.MetadataValue.path(str(result.mapping_path.parent)),
        }
    )


class DraftModelRunConfig(HeldOutRunConfig):
    """The draft_model asset's run config; ``train_config`` turns it into the core's TrainConfig."""

    epochs: int = setting(TrainConfig.epochs, gt=0)
    """Training epochs."""
    lr: float = setting(TrainConfig.lr, gt=0.0)
    """Learning rate (AdamW's; with `optimizer=muon`, the AdamW group's)."""
    optimizer: str = setting(TrainConfig.optimizer, check=settings.one_of(*OPTIMIZERS))
    """`adamw`, or `muon` (speculators' current default: Muon on the draft's 2-D weight matrices, AdamW on norms,
    biases and the LM head)."""
    muon_lr: float | None = setting(TrainConfig.muon_lr, gt=0.0)
    """`optimizer=muon`: the Muon group's learning rate; empty: `lr`."""
    tokens_per_batch: int = setting(TrainConfig.tokens_per_batch, gt=0)
    """Packed tokens per step."""
    ttt_steps: int = setting(TrainConfig.ttt_steps, gt=0)
    """Training-time-test steps (draft positions trained)."""
    num_layers: int = setting(TrainConfig.num_layers, gt=0)
    """Draft decoder layers."""
    max_steps_per_epoch: int | None = setting(TrainConfig.max_steps_per_epoch, gt=0)
    """Cap on steps per epoch; empty: none."""
    max_val_batches: int | None = setting(TrainConfig.max_val_batches, gt=0)
    """Validation batches per evaluation; empty: the whole held-out partition."""
    init: str = setting(TrainConfig.init, check=settings.one_of("token_copy", "speculators"))
    """`token_copy` (the draft starts by carrying the new token forward) or `speculators`."""
    loss_on: str = setting(TrainConfig.loss_on, check=settings.one_of(*LOSS_ON))
    """Positions the training loss covers: `assistant` (the answers) or `all` (prompts too; the target is the verifier's
    own distribution everywhere, validation stays on the answers)."""
    num_threads: int | None = setting(TrainConfig.num_threads, gt=0)
    """Torch threads on CPU; empty: all cores but one."""
    hidden_states_source: str = setting(
        TrainConfig.hidden_states_source, check=settings.one_of("stored", "online", "hybrid")
    )
    """`stored` (the partitions' files), `online` (each batch's states computed while training by
    EAGLE3_HIDDEN_STATES_BACKEND, nothing stored; every epoch re-extracts) or `hybrid` (stored files, the rest
    online)."""
    prefetch_batches: int = setting(TrainConfig.prefetch_batches, gt=0)
    """Online: batches each loader worker keeps ready (bounds states in memory and on disk)."""


def configured_layer_ids(verifier: VerifierResource) -> tuple[int, ...] | None:
    """The aux layer ids the hidden_states asset extracts with now (EAGLE3_LAYER_IDS, else EAGLE-3's default for
    this verifier): training refuses partitions extracted at others. None without a verifier path."""
    if not verifier.path.strip():
        return None
    layers = verifier_shape(verifier.resolved_path()).num_layers
    return tuple(resolve_layer_ids(verifier.layer_id_list(), layers))


def train_config(config: DraftModelRunConfig, verifier: VerifierResource) -> TrainConfig:
    """The core's TrainConfig from the asset's run config (same-named fields) and the verifier resource."""
    return settings.core_config(
        TrainConfig,
        config,
        layer_ids=configured_layer_ids(verifier),
        checked_partitions_only=True,  # chosen by hidden_state_partitions: re-judged on the versions pinned
        device=verifier.device,
        precision=verifier.precision,
        procs=verifier.train_procs,
        online_backend=verifier.hidden_states_backend,
        online_urls=tuple(verifier.hidden_states_urls()),
        online_storage=verifier.hidden_states_storage or None,
        online_outage_budget_s=verifier.hidden_states_outage_budget_s,
    )


def _train_under_pipes(
    context: dg.AssetExecutionContext,
    data_store: DataStoreResource,
    train_keys: list[str],
    val_key: str,
    verifier_path: Path,
    train_config: "TrainConfig",
) -> "TrainResult":
    """``train_config.procs`` torchrun ranks under Dagster Pipes: rank 0's logs and per-epoch metrics stream into
    this run; a failed rank fails the run with the message of :func:`~eagle3_assets.training.launch.failure_message`."""
    layout = data_store.layout
    with tempfile.TemporaryDirectory(prefix="eagle3-train-") as work:
        spec = TrainSpec(
            str(layout.root), train_keys, val_key, str(verifier_path), asdict(train_config), f"{work}/result.json"
        )
        spec_path = spec.write(Path(work) / "train_spec.json")
        command = torchrun_command(spec_path, train_config.procs, find_free_port())
        context.log.info(f"draft_model: {train_config.procs} training processes: {' '.join(command)}")
        try:
            invocation = dg.PipesSubprocessClient().run(command=command, context=context, env=worker_env())
        except Exception as error:
            # Pipes' DagsterPipesExecutionError is not public API: recognise torchrun's exit by its message
            code = _exit_code(str(error))
            if code is None:
                raise
            ckpt_dir = layout.draft_model_dir / CHECKPOINT_DIR
            raise dg.Failure(failure_message(code, ckpt_dir, train_config.procs)) from error
        for message in invocation.get_custom_messages():
            context.log.debug(f"epoch metrics: {message}")
        return TrainResult.from_json(json.loads(Path(spec.result_path).read_text(encoding="utf-8")))


def _exit_code(text: str) -> int | None:
    """torchrun's exit code from Pipes' error text ("External execution process failed with code N"), else None."""
    match = re.search(r"process failed with code (-?\d+)", text)
    return int(match.group(1)) if match else None


@dg.asset(
    deps=[vocab_mapping],
    group_name="draft",
    kinds={"pytorch", "safetensors"},
    description=(
        "The EAGLE-3 draft, trained with speculators' own model classes on the verifier's hidden states (stored, "
        "or computed while it trains: hidden_states_source) with training-time-test steps; checkpointed every "
        "epoch and resumed after a crash; saved in speculators' format (final/), which vLLM loads as an eagle3 "
        "speculator. EAGLE3_TRAIN_PROCS > 1 trains in that many torchrun processes (DDP) under Dagster Pipes."
    ),
)
def draft_model(
    context: dg.AssetExecutionContext,
    config: DraftModelRunConfig,
    data_store: DataStoreResource,
    verifier: VerifierResource,
) -> dg.MaterializeResult:
    train_keys, val_key = split_partitions(hidden_state_partitions(data_store), config.val_partition)
    core_config = train_config(config, verifier)
    if core_config.procs == 1:
        # one process: this one (no second interpreter paying the ~20 s speculators import)
        result = train_draft(
            data_store.layout, train_keys, val_key, verifier.resolved_path(), core_config, log=context.log.info
        )
    else:
        result = _train_under_pipes(context, data_store, train_keys, val_key, verifier.resolved_path(), core_config)
    return dg.MaterializeResult(metadata=draft_model_metadata(result))


def draft_model_metadata(result: "TrainResult") -> dict[str, Any]:
    """The draft's materialization metadata: the run's extent, losses and acceptance estimates per epoch."""
    last_accuracy = result.val_accuracy[-1] if result.val_accuracy else []
    per_epoch = metadata.table(
        (
            {"epoch": i + 1, "train_loss": train, "val_loss": val, "val_acceptance_length": acc}
            for i, (train, val, acc) in enumerate(
                zip(result.train_loss, result.val_loss, result.val_acceptance_length, strict=False)
            )
        ),
        [
            ("epoch", "int", "Epoch (1-based)."),
            ("train_loss", "float", "Mean training loss of the epoch."),
            ("val_loss", "float", "Loss on the held-out partition after the epoch."),
            ("val_acceptance_length", "float", "Acceptance length estimated from the per-step accuracies."),
        ],
    )
    return {
        "epochs": result.epochs,
        "epochs_run": result.epochs_run,
        "ranks": result.ranks,
        "resumed_from_epoch": result.resumed_from_epoch if result.resumed_from_epoch is not None else -1,
        "steps": result.steps,
        "tokens_trained": result.tokens_trained,
        "train_samples": result.train_samples,
        "val_loss": result.val_loss[-1] if result.val_loss else float("nan"),
        "val_loss_untrained": result.val_loss_untrained,
        "val_accuracy_per_ttt_step": dg.MetadataValue.json([round(a, 4) for a in last_accuracy]),
        "val_acceptance_length_estimate": result.val_acceptance_length[-1] if result.val_acceptance_length else 0,
        "seconds": round(result.seconds, 1),
        "seconds_per_step": round(result.seconds_per_step, 3),
        # where the states came from (stored files or computed online) and the time split of this run
        "hidden_states_source": result.hidden_states.get("source", "stored"),
        "hidden_states_time_s": dg.MetadataValue.json(result.hidden_states),
        "train_partitions": dg.MetadataValue.json(result.train_partitions),
        "val_partition": result.val_partition,
        "layer_ids": dg.MetadataValue.json(result.layer_ids),
        "draft_vocab_size": result.draft_vocab_size,
        "notes": dg.MetadataValue.json(result.notes),
        "path": dg.MetadataValue.path(str(result.final_dir)),
        "loss_per_epoch": per_epoch,
        "loss_curve": dg.MetadataValue.md(
            plots.lines_markdown(
                {"train": result.train_loss, "validation": result.val_loss}, "Draft loss", "epoch", "loss"
            )
        ),
    }
