"""Training settings (:class:`TrainConfig`) and what a training run reports (:class:`TrainResult`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.core.precision import AUTO, PRECISIONS
from eagle3_assets.core.settings import OUTAGE_BUDGET_S, ConfigError
from eagle3_assets.core.verifier import SPECULATIVE_TOKENS

INITS = ("token_copy", "speculators")
LOSS_ON = ("assistant", "all")
# speculators' optimizers (speculators.train.optimizers): "adamw" over every trainable weight, or "muon" (its current
# default for new runs: torch.optim.Muon on the draft's 2-D weight matrices, AdamW on norms, biases and the LM head)
OPTIMIZERS = ("adamw", "muon")


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 10
    lr: float = 1e-3  # speculators' default for AdamW
    tokens_per_batch: int = 4096  # packed tokens per step (speculators' --total-seq-len)
    ttt_steps: int = SPECULATIVE_TOKENS
    ttt_step_loss_decay: float = 1.0
    # where the training loss is taken: "assistant" (the answers' tokens, the hidden states' loss mask) or "all"
    # (prompts too: the target is the verifier's own distribution everywhere; validation stays on the answers)
    loss_on: str = "assistant"
    num_layers: int = 1
    loss_fn: str = "kl_div"
    weight_decay: float = 0.01
    optimizer: str = "adamw"  # OPTIMIZERS; the recipe's measured drafts were all trained with AdamW
    muon_lr: float | None = None  # "muon": the Muon group's learning rate; None: lr (speculators' rule)
    scheduler: str = "cosine"  # "cosine", "linear" (both with warmup) or "none"
    warmup_ratio: float = 0.02
    # speculators' resolved eagle3 defaults (vLLM's llama_eagle3 reads all three)
    norm_before_residual: bool = True
    norm_before_fc: bool = True
    norm_output: bool = True
    draft_attn_impl: str = "sdpa"  # "sdpa" or "eager" (flex attention has no CPU backward)
    # "token_copy": speculators' init, then the first draft layer starts by attending to its own position and
    # passing the new token's embedding into the residual (see `init_token_copy`); "speculators": its init as is.
    init: str = "token_copy"
    seed: int = 0
    device: str = AUTO
    precision: str = AUTO  # autocast: "auto" (bf16 on GPUs, float32 on the CPU), "float32", "bfloat16" (precision.py)
    num_threads: int | None = None  # torch intra-op threads on CPU; None: all cores but one
    save_dtype: str = "float32"  # dtype of the final weights: "float32" or "bfloat16"
    max_steps_per_epoch: int | None = None  # cap for tests and benchmarks
    # Validation batches per evaluation (the same seeded batches every epoch); None: the whole partition.
    # A 1,000-sample partition costs minutes per pass on a CPU, which dominates a short training run.
    max_val_batches: int | None = None
    keep_checkpoints: int = 2
    # A progress line (step, loss, tokens/s, time left in the epoch) at most this often: an epoch of a real dataset
    # on a CPU takes most of an hour, and the epoch's own line comes only at its end. 0: after every step.
    progress_interval_s: float = 60.0
    # training processes (torchrun ranks, DDP; gloo on CPU). tokens_per_batch stays the GLOBAL batch: each rank packs
    # tokens_per_batch // procs, so N processes take the same optimizer steps as one.
    procs: int = 1
    # Where the hidden states come from (training/online_states.py): "stored" partition files, "online" (fetched from
    # the extraction side while training, nothing stored) or "hybrid" (stored files where present, the rest fetched).
    hidden_states_source: str = "stored"
    online_backend: str = "hf"  # "hf" (the verifier in the loader's worker) or "vllm" (extraction servers)
    online_urls: tuple[str, ...] = ()  # vllm: the extraction servers; empty: an embedded CPU vLLM for the run
    online_storage: str | None = None  # vllm with URLs: this machine's mount of the servers' connector folder
    # vllm: every extraction server down this long stops the run (extraction's EAGLE3_HIDDEN_STATES_OUTAGE_BUDGET_S);
    # the servers' API key is EAGLE3_API_KEY, read by each process that fetches (never part of the config)
    online_outage_budget_s: float = OUTAGE_BUDGET_S
    online_workers: int = 1  # loader processes fetching batches (0: in the training process, no overlap)
    prefetch_batches: int = 2  # ready batches each worker may hold: the bound on states in memory and on disk
    # The aux layer ids the verifier is configured to extract now (EAGLE3_LAYER_IDS, resolved): a partition
    # extracted at other layers is refused as stale (versions.stale_hidden_states). None: not compared (the
    # partitions' own layers are trained on, as long as they agree with each other).
    layer_ids: tuple[int, ...] | None = None
    # Train only on versions whose recorded checks passed (lineage.partitions_passing_checks), judged on the
    # versions pinned: the draft_model asset chose its partitions by their checks, and a rebuild published after
    # that choice is unchecked until its own run records them. False: the caller vouches for the partitions.
    checked_partitions_only: bool = False

    def validate(self) -> None:
        positive = ("epochs", "tokens_per_batch", "ttt_steps", "num_layers", "keep_checkpoints", "procs")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r}: must be a positive integer")
        if not self.lr > 0:
            raise ConfigError(f"lr={self.lr!r}: must be a positive number")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer={self.optimizer!r}: must be one of {', '.join(OPTIMIZERS)}")
        if self.muon_lr is not None and not self.muon_lr > 0:
            raise ConfigError(f"muon_lr={self.muon_lr!r}: must be a positive number or None (the lr)")
        if self.scheduler not in {"cosine", "linear", "none"}:
            raise ConfigError(f"scheduler={self.scheduler!r}: must be cosine, linear or none")
        if self.loss_on not in LOSS_ON:
            raise ConfigError(f"loss_on={self.loss_on!r}: must be one of {', '.join(LOSS_ON)}")
        if self.init not in INITS:
            raise ConfigError(f"init={self.init!r}: must be one of {', '.join(INITS)}")
        if self.draft_attn_impl not in {"sdpa", "eager"}:
            raise ConfigError(f"draft_attn_impl={self.draft_attn_impl!r}: must be sdpa or eager")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r}: must be auto, float32 or bfloat16")
        if self.save_dtype not in {"float32", "bfloat16"}:
            raise ConfigError(f"save_dtype={self.save_dtype!r}: must be float32 or bfloat16")
        if self.max_val_batches is not None and self.max_val_batches <= 0:
            raise ConfigError(f"max_val_batches={self.max_val_batches!r}: must be positive or None")
        if self.hidden_states_source not in {"stored", "online", "hybrid"}:
            raise ConfigError(f"hidden_states_source={self.hidden_states_source!r}: must be stored, online or hybrid")
        if self.online_backend not in {"hf", "vllm"}:
            raise ConfigError(f"online_backend={self.online_backend!r}: must be hf or vllm")
        if self.online_workers < 0 or self.prefetch_batches <= 0:
            raise ConfigError(
                f"online_workers={self.online_workers!r}, prefetch_batches={self.prefetch_batches!r}: workers must be "
                ">= 0 and prefetch_batches > 0"
            )
        if not self.progress_interval_s >= 0:
            raise ConfigError(f"progress_interval_s={self.progress_interval_s!r}: must be >= 0 (0: every step)")
        if self.max_steps_per_epoch is not None and self.max_steps_per_epoch <= 0:
            raise ConfigError(f"max_steps_per_epoch={self.max_steps_per_epoch!r}: must be positive or None")

    def fingerprint_fields(self) -> dict[str, Any]:
        # epochs may grow between runs (train longer = resume); checkpoint bookkeeping never matters
        # procs: a checkpoint holds the whole (replicated) state, so a run may resume with another process count
        # where the states come from: the same states (a stored or an online run resumes the other's checkpoint)
        ignored = {"epochs", "keep_checkpoints", "device", "num_threads", "max_val_batches", "procs"}
        ignored |= {"hidden_states_source", "online_backend", "online_urls", "online_storage", "online_workers"}
        ignored |= {"online_outage_budget_s"}
        ignored |= {"prefetch_batches", "progress_interval_s"}
        # checks only: the layers trained on are in the fingerprint (the data's own), and so is the data
        ignored |= {"layer_ids", "checked_partitions_only"}
        fields = {k: v for k, v in asdict(self).items() if k not in ignored}
        # the defaults of fields added later: fingerprints (and checkpoints) of earlier releases stay valid
        for name, default in (("loss_on", "assistant"), ("optimizer", "adamw"), ("muon_lr", None)):
            if fields[name] == default:
                del fields[name]
        return fields


@dataclass
class TrainResult:
    epochs: int  # epochs completed in total (including ones from a resumed checkpoint)
    epochs_run: int  # epochs this call trained
    resumed_from_epoch: int | None  # the last epoch of the checkpoint resumed from (0-based), None when fresh
    steps: int  # optimizer steps in total
    tokens_trained: int  # packed real tokens over all steps
    train_loss: list[float]  # per epoch, mean over its steps
    val_loss: list[float]  # per epoch
    val_loss_untrained: float  # the freshly initialized draft on the same validation batches
    val_accuracy: list[list[float]]  # per epoch, per TTT step: draft argmax == verifier argmax (loss-masked)
    val_cond_accuracy: list[list[float]]  # per epoch, per TTT step, given all earlier steps were right
    val_acceptance_length: list[float]  # per epoch: 1 + sum over steps of the product of cond accuracies
    loss_curve: list[dict[str, float]]  # per step: {"step", "epoch", "loss"}
    seconds: float  # this call's wall time
    seconds_per_step: float  # this call's mean training step time, batch loading included
    cpu_seconds_per_step: float  # the same in process CPU time (steadier than wall time on a shared machine)
    final_dir: Path
    checkpoint_dir: Path
    verifier_path: Path
    layer_ids: list[int]
    draft_vocab_size: int
    train_partitions: list[str]
    val_partition: str
    notes: list[str] = field(default_factory=list)
    ranks: int = 1  # training processes of this call
    # where this call's states came from, and its time split: {"source", "fetch_s" (computing states, summed over
    # the loader's workers), "wait_s" (training waiting for a batch), "train_s" (the rest of the steps' time)}
    hidden_states: dict[str, Any] = field(default_factory=dict)
    train_samples: int = 0  # samples the training partitions hold (their stored or online rows)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (paths as strings): how a torchrun worker hands its result to the launcher."""
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainResult:
        paths = {"final_dir", "checkpoint_dir", "verifier_path"}
        return cls(**{k: Path(v) if k in paths else v for k, v in data.items()})
