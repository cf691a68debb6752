"""Train the EAGLE-3 draft with speculators 0.9's own pieces, in a plain torch loop that runs on a CPU.

What comes from speculators (so the saved draft is exactly what its CLI would produce and vLLM serves):
``create_transformer_layer_config`` (draft decoder shaped from the verifier), ``Eagle3DraftModel.
from_training_args`` (the model, with the verifier's embeddings / LM head / norm loaded), ``get_trainer_kwargs``
(TTT steps, loss), its offline dataset ``ArrowDataset`` + ``CollateFn`` + ``shift_batch`` + the packing sampler
``MultipackDistributedBatchSamplerV2``, ``build_optimizers`` (AdamW), ``normalize_counted_metrics``, and
``save_pretrained``.

What is ours, and why: the loop. speculators' ``Trainer`` assumes an accelerator (``model.to(local_rank)``,
``torch.accelerator.synchronize``); on CPU its default flex attention has no backward and its fused loss needs
Triton, so the draft is built with ``draft_attn_impl="sdpa"`` and ``loss_implementation="eager"``. The loop is
the Trainer's step (forward, backward, clip 1.0, optimizer, scheduler) without the distributed parts, plus:

* a validation pass before training (the untrained draft's loss: the baseline the trained one must beat);
* one checkpoint per epoch (``checkpoints/epoch_NNNN.pt``: trainable weights, optimizer, scheduler, RNG, the
  metric history), written atomically; a re-run resumes after the last whole one when the run's fingerprint
  (data, verifier, model shape, hyper-parameters except ``epochs``) matches, so raising ``epochs`` continues;
* the final draft in speculators' format under ``draft_model_dir / "final"`` (renamed into place whole), with
  the verifier's absolute path as ``name_or_path`` so ``SpeculatorModel.from_pretrained`` and vLLM find it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_assets import lineage
from eagle3_assets.settings import ConfigError
from eagle3_assets.storage import (
    DataLayout,
    atomic_path,
    ensure_free_space,
    exclusive_lock,
    remove_dead_writers_temps,
    replace_dir_atomic,
    write_json_atomic,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
FINAL_DIR = "final"
HISTORY_FILE = "training_history.json"
# Loaded again from the verifier when the model is rebuilt: not worth a copy in every checkpoint.
_VERIFIER_OWNED = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
INITS = ("token_copy", "speculators")
# token_copy gains: the self-attention logit (per head, over sqrt(head_dim)) that beats ~e^8 other positions, and
# the copied embedding's weight against the normalized residual (rms 1).
_SELF_SCORE = 18.0
_COPY_GAIN = 3.0


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 10
    lr: float = 1e-3  # speculators' default for AdamW
    tokens_per_batch: int = 4096  # packed tokens per step (speculators' --total-seq-len)
    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0
    num_layers: int = 1
    loss_fn: str = "kl_div"
    weight_decay: float = 0.01
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
    device: str = "auto"
    num_threads: int | None = None  # torch intra-op threads on CPU; None: all cores but one
    save_dtype: str = "float32"  # dtype of the final weights: "float32" or "bfloat16"
    max_steps_per_epoch: int | None = None  # cap for tests and benchmarks
    # Validation batches per evaluation (the same seeded batches every epoch); None: the whole partition.
    # A 1,000-sample partition costs minutes per pass on a CPU, which dominates a short training run.
    max_val_batches: int | None = None
    keep_checkpoints: int = 2

    def validate(self) -> None:
        positive = ("epochs", "tokens_per_batch", "ttt_steps", "num_layers", "keep_checkpoints")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r}: must be a positive integer")
        if not self.lr > 0:
            raise ConfigError(f"lr={self.lr!r}: must be a positive number")
        if self.scheduler not in {"cosine", "linear", "none"}:
            raise ConfigError(f"scheduler={self.scheduler!r}: must be cosine, linear or none")
        if self.init not in INITS:
            raise ConfigError(f"init={self.init!r}: must be one of {', '.join(INITS)}")
        if self.draft_attn_impl not in {"sdpa", "eager"}:
            raise ConfigError(f"draft_attn_impl={self.draft_attn_impl!r}: must be sdpa or eager")
        if self.save_dtype not in {"float32", "bfloat16"}:
            raise ConfigError(f"save_dtype={self.save_dtype!r}: must be float32 or bfloat16")
        if self.max_val_batches is not None and self.max_val_batches <= 0:
            raise ConfigError(f"max_val_batches={self.max_val_batches!r}: must be positive or None")
        if self.max_steps_per_epoch is not None and self.max_steps_per_epoch <= 0:
            raise ConfigError(f"max_steps_per_epoch={self.max_steps_per_epoch!r}: must be positive or None")

    def fingerprint_fields(self) -> dict[str, Any]:
        # epochs may grow between runs (train longer = resume); checkpoint bookkeeping never matters
        ignored = {"epochs", "keep_checkpoints", "device", "num_threads", "max_val_batches"}
        return {k: v for k, v in asdict(self).items() if k not in ignored}


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


# ------------------------------------------------------------------------------------------------ helpers


def _device(name: str) -> torch.device:
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def _partition_meta(layout: DataLayout, keys: Sequence[str]) -> dict[str, Any]:
    from eagle3_assets.hidden_states.extract import read_meta

    metas = {}
    for key in keys:
        if not layout.hidden_states_index_path(key).exists():
            index = layout.hidden_states_index_path(key)
            raise FileNotFoundError(f"hidden_states partition {key} is not complete (no {index})")
        metas[key] = read_meta(layout, key)
    first_key, first = next(iter(metas.items()))
    for key, meta in metas.items():
        for name in ("layer_ids", "hidden_size", "vocab_size"):
            if meta[name] != first[name]:
                raise ValueError(
                    f"hidden_states partitions disagree on {name}: {first_key} has {first[name]}, "
                    f"{key} has {meta[name]} (re-extract them with the same verifier and layer_ids)"
                )
    return first


def _loader(dirs: Sequence[Path], tokens_per_batch: int, hidden_size: int, n_aux: int, dtype: Any, seed: int) -> Any:
    """speculators' offline dataset per partition, concatenated, packed by its own sampler and collate."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from torch.utils.data import ConcatDataset, DataLoader

    datasets = [
        ArrowDataset(max_len=tokens_per_batch, datapath=str(d), on_missing="raise", hidden_states_dtype=dtype)
        for d in dirs
    ]
    lengths = [n for ds in datasets for n in ds.approx_lengths]
    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=tokens_per_batch, lengths=lengths, num_replicas=1, rank=0, seed=seed
    )
    collate = CollateFn(tokens_per_batch, hidden_size, num_target_layers=n_aux, dtype=dtype, preprocess=shift_batch)
    return DataLoader(ConcatDataset(datasets), batch_sampler=sampler, num_workers=0, collate_fn=collate)


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    import torch

    # collate adds bookkeeping (error_records, recovery metadata) that the model's **kwargs must not receive
    return {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}


def build_draft(
    verifier_path: Path,
    layer_ids: list[int],
    config: TrainConfig,
    mapping: tuple[Any, Any] | None,
) -> Any:
    """A freshly initialized EAGLE-3 draft for this verifier, built the way ``speculators train`` builds it."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    from eagle3_assets.hidden_states.backends import verifier_shape

    layer_config = create_transformer_layer_config(
        verifier_name_or_path=str(verifier_path),
        num_layers=config.num_layers,
        draft_arch="llama",
        hidden_act=None,
        sliding_window=2048,
        # full attention everywhere: the plain Llama draft vLLM's llama_eagle3 serves
        full_attention_indices=list(range(config.num_layers)),
    )
    d2t, t2d = mapping if mapping is not None else (None, None)
    target_vocab = verifier_shape(verifier_path).vocab_size
    if t2d is not None and int(t2d.shape[0]) != target_vocab:
        raise ValueError(
            f"vocab_mapping was built for a {int(t2d.shape[0])}-token target vocabulary but the verifier at "
            f"{verifier_path} has {target_vocab}: rebuild vocab_mapping for this verifier"
        )
    draft_vocab_size = int(d2t.shape[0]) if d2t is not None else target_vocab
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer_config,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=str(verifier_path),
        target_layer_ids=layer_ids,
        draft_vocab_size=draft_vocab_size,
        norm_before_residual=config.norm_before_residual,
        norm_before_fc=config.norm_before_fc,
        norm_output=config.norm_output,
        ttt_steps=config.ttt_steps,
        draft_attn_impl=config.draft_attn_impl,
    )
    if config.init == "token_copy":
        init_token_copy(model)
    return model


def init_token_copy(model: Any) -> None:
    """Start the first draft layer as "carry the new token forward".

    An EAGLE-3 draft predicts token t+2 from the verifier's states at t and the embedding of token t+1, which enters
    the first layer only through attention (the residual is the verifier's states). From a random init, attention
    must first learn to pick out its own position among all earlier ones: measured on the demo's tiny verifier,
    120 steps left the draft at 10% top-1 accuracy; with this init 60 steps reach 52% (docs/local_vllm.md). Here
    each head's query and key read the same slice of the normalized embedding (so a position scores itself
    ~``_SELF_SCORE`` above the others), its value copies that slice, and the output projection writes it back, at
    ``_COPY_GAIN``, into the dimensions it came from. Every other weight keeps speculators' init; training moves all.
    """
    import torch

    layer = model.layers[0]
    attn = layer.self_attn
    hidden = int(model.hidden_size)
    head_dim = int(attn.head_dim)
    q_heads = attn.q_proj.weight.shape[0] // head_dim
    kv_heads = attn.k_proj.weight.shape[0] // head_dim
    group = q_heads // kv_heads
    beta = (_SELF_SCORE / head_dim**0.5) ** 0.5
    eye = torch.eye(head_dim)
    with torch.no_grad():
        # Inputs are cat([embeds, hidden]): columns [0, hidden) are the embedding half.
        for q_head in range(q_heads):
            kv_head = q_head // group
            cols = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
            if cols.stop > hidden:  # more head dims than the embedding has: those heads keep their random init
                continue
            rows = slice(q_head * head_dim, (q_head + 1) * head_dim)
            kv_rows = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
            # the hidden half keeps its random init: context still reaches the scores and values from step one
            attn.q_proj.weight[rows, :hidden] = 0.0
            attn.q_proj.weight[rows, cols] = beta * eye
            attn.k_proj.weight[kv_rows, :hidden] = 0.0
            attn.k_proj.weight[kv_rows, cols] = beta * eye
            attn.v_proj.weight[kv_rows, :hidden] = 0.0
            attn.v_proj.weight[kv_rows, cols] = eye
            attn.o_proj.weight[:, rows] = 0.0
            attn.o_proj.weight[cols, rows] = (_COPY_GAIN / group) * eye


def trainer_kwargs(config: TrainConfig) -> dict[str, Any]:
    from speculators.models.eagle3 import Eagle3DraftModel

    train_kwargs, _val_kwargs = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn=config.loss_fn,
        loss_implementation="eager",
        ttt_steps=config.ttt_steps,
        ttt_step_loss_decay=config.ttt_step_loss_decay,
    )
    return train_kwargs


def train_step(
    model: Any, batch: dict[str, Any], optimizers: list[Any], schedulers: list[Any], call_kwargs: dict, autocast: Any
) -> tuple[float, dict[str, Any]]:
    """speculators Trainer's step: forward (TTT unrolled), backward, clip at 1.0, optimizer, scheduler."""
    import torch

    with autocast():
        _draft_tokens, loss, metrics = model(**batch, **call_kwargs)
    for opt in optimizers:
        opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for opt in optimizers:
        opt.step()
    for sched in schedulers:
        sched.step()
    return float(loss.detach()), metrics


def evaluate(
    model: Any,
    loader: Any,
    device: torch.device,
    call_kwargs: dict,
    ttt_steps: int,
    autocast: Any,
    max_batches: int | None = None,
) -> dict:
    """Validation metrics summed over all batches, then normalized (speculators' counted-metric convention)."""
    import torch
    from speculators.train.utils import normalize_counted_metrics

    model.eval()
    sums: dict[str, float] = {}
    batches = 0
    with torch.no_grad():
        for batch in loader:
            if max_batches is not None and batches >= max_batches:
                break
            with autocast():
                _tokens, _loss, metrics = model(**_to_device(batch, device), **call_kwargs)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            batches += 1
    model.train()
    # per-batch means for the losses (like the Trainer), token-weighted ratios for accuracies
    metrics = normalize_counted_metrics(dict(sums))
    full = [metrics.get(f"full_acc_{i}", 0.0) for i in range(ttt_steps)]
    cond = [metrics.get(f"cond_acc_{i}", 0.0) for i in range(ttt_steps)]
    accept, run = 1.0, 1.0
    for c in cond:
        run *= c
        accept += run
    return {
        "loss": metrics.get("loss", float("nan")),
        "full_acc": full,
        "cond_acc": cond,
        "acceptance": accept,
        "batches": batches,
    }


def _fingerprint(
    train_keys: Sequence[str],
    val_key: str,
    verifier: Path,
    layer_ids: list[int],
    vocab: int,
    config: TrainConfig,
    data_samples: int,
) -> str:
    payload = {
        "train": list(train_keys),
        "val": val_key,
        "verifier": str(verifier),
        "layer_ids": layer_ids,
        "draft_vocab_size": vocab,
        "data_samples": data_samples,
        "config": config.fingerprint_fields(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _checkpoints(ckpt_dir: Path) -> list[Path]:
    return sorted(ckpt_dir.glob("epoch_*.pt"))


def _load_latest_checkpoint(ckpt_dir: Path, fingerprint: str, notes: list[str]) -> dict[str, Any] | None:
    import torch

    for path in reversed(_checkpoints(ckpt_dir)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as error:
            notes.append(f"skipped unreadable checkpoint {path.name}: {type(error).__name__}")
            continue
        if state.get("fingerprint") != fingerprint:
            notes.append(f"ignored checkpoint {path.name}: made for different data or settings; starting fresh")
            return None
        return state
    return None


def _rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def _save_final(model: Any, final_dir: Path, dtype: str) -> None:
    import copy

    import torch

    tmp = final_dir.with_name(f".{final_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    to_save = model if dtype == "float32" else copy.deepcopy(model).to(getattr(torch, dtype))
    to_save.save_pretrained(str(tmp))
    replace_dir_atomic(tmp, final_dir)  # the old final/ moved aside, the new one renamed in, the old one removed


# ------------------------------------------------------------------------------------------------ main


def train_draft(
    layout: DataLayout,
    train_keys: Sequence[str],
    val_key: str,
    verifier_path: str | Path,
    config: TrainConfig | None = None,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """Train (or resume training) the draft on ``train_keys``' hidden states, validating on ``val_key``."""
    import contextlib

    import numpy as np
    import torch
    from speculators.train.optimizers import build_optimizers
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    from eagle3_assets.hidden_states.backends import torch_threads
    from eagle3_assets.training.vocab import load_vocab_mapping

    config = config or TrainConfig()
    config.validate()
    say = log or logger.info
    started = time.perf_counter()
    train_keys = list(train_keys)
    if not train_keys:
        raise ValueError("train_draft needs at least one training partition")
    if val_key in train_keys:
        raise ValueError(f"validation partition {val_key} is also a training partition")
    verifier_path = Path(verifier_path).expanduser().resolve()
    meta = _partition_meta(layout, [*train_keys, val_key])
    layer_ids = list(meta["layer_ids"])
    hidden_size = int(meta["hidden_size"])
    device = _device(config.device)
    on_gpu = device.type != "cpu"
    # CPU: fp32 throughout (no autocast); GPU: bf16 autocast over fp32 weights, like speculators' Trainer
    hs_dtype = torch.bfloat16 if on_gpu else torch.float32

    def autocast() -> Any:
        return torch.autocast(device.type, dtype=torch.bfloat16) if on_gpu else contextlib.nullcontext()

    out_dir = layout.draft_model_dir
    ckpt_dir = out_dir / CHECKPOINT_DIR
    final_dir = out_dir / FINAL_DIR
    notes: list[str] = []

    with (
        exclusive_lock(layout.lock_path("draft_model"), "draft_model training"),
        torch_threads(config.num_threads),
    ):
        # A killed run never renames its temporaries into place (a checkpoint, final/ being saved or moved aside,
        # the history): without this sweep each kill would leak a checkpoint- or draft-sized file or folder.
        for folder in (out_dir, ckpt_dir):
            remove_dead_writers_temps(folder)
        mapping = load_vocab_mapping(layout)
        if mapping is None:
            notes.append("no vocab_mapping found: the draft uses the verifier's full vocabulary")
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        np.random.seed(config.seed)
        model = build_draft(verifier_path, layer_ids, config, mapping).to(device)
        model.train()
        draft_vocab_size = int(model.draft_vocab_size)
        call_kwargs = trainer_kwargs(config)

        train_loader = _loader(
            [layout.hidden_states_dir(k) for k in train_keys],
            config.tokens_per_batch,
            hidden_size,
            len(layer_ids),
            hs_dtype,
            config.seed,
        )
        val_loader = _loader(
            [layout.hidden_states_dir(val_key)],
            config.tokens_per_batch,
            hidden_size,
            len(layer_ids),
            hs_dtype,
            config.seed,
        )
        steps_per_epoch = len(train_loader)
        if config.max_steps_per_epoch is not None:
            steps_per_epoch = min(steps_per_epoch, config.max_steps_per_epoch)
        data_samples = sum(len(ds) for ds in train_loader.dataset.datasets)

        optimizers = build_optimizers(model, _OptimizerArgs(lr=config.lr, weight_decay=config.weight_decay))
        total_steps = config.epochs * steps_per_epoch
        warmup = int(total_steps * config.warmup_ratio)
        if config.scheduler == "cosine":
            schedulers = [get_cosine_schedule_with_warmup(o, warmup, total_steps) for o in optimizers]
        elif config.scheduler == "linear":
            schedulers = [get_linear_schedule_with_warmup(o, warmup, total_steps) for o in optimizers]
        else:
            schedulers = []

        fingerprint = _fingerprint(
            train_keys, val_key, verifier_path, layer_ids, draft_vocab_size, config, data_samples
        )
        # content, not paths and counts: other hidden states, vocabulary or verifier weights never resume it
        fingerprint = lineage.training_fingerprint(fingerprint, layout, [*train_keys, val_key], verifier_path)
        history: dict[str, Any] = {
            "train_loss": [],
            "val_loss": [],
            "val_accuracy": [],
            "val_cond_accuracy": [],
            "val_acceptance_length": [],
            "loss_curve": [],
            "tokens_trained": 0,
            "steps": 0,
        }
        start_epoch = 0
        resumed_from = None
        state = _load_latest_checkpoint(ckpt_dir, fingerprint, notes)
        if state is not None:
            missing, unexpected = model.load_state_dict(state["model"], strict=False)
            if unexpected or set(missing) - set(_VERIFIER_OWNED):
                raise RuntimeError(f"checkpoint does not fit the draft: missing {missing}, unexpected {unexpected}")
            for opt, opt_state in zip(optimizers, state["optimizers"], strict=True):
                opt.load_state_dict(opt_state)
            for sched, sched_state in zip(schedulers, state["schedulers"], strict=True):
                sched.load_state_dict(sched_state)
            _set_rng_state(state["rng"])
            history = state["history"]
            start_epoch = state["epoch"] + 1
            resumed_from = state["epoch"]
            say(f"draft_model: resuming after epoch {resumed_from + 1} of {config.epochs}")
        else:
            baseline = evaluate(
                model, val_loader, device, call_kwargs, config.ttt_steps, autocast, config.max_val_batches
            )
            history["val_loss_untrained"] = baseline["loss"]
            history["val_accuracy_untrained"] = baseline["full_acc"]
            say(f"draft_model: untrained val loss {baseline['loss']:.4f}")

        step_seconds = step_cpu_seconds = 0.0
        steps_run = 0
        for epoch in range(start_epoch, config.epochs):
            train_loader.batch_sampler.set_epoch(epoch)
            epoch_losses = []
            # a step's time includes fetching its batch (reading hidden states), the way a user waits for it
            t_prev = time.perf_counter()
            cpu_prev = time.process_time()
            for step_in_epoch, batch in enumerate(train_loader):
                if step_in_epoch >= steps_per_epoch:
                    break
                on_device = _to_device(batch, device)
                loss, _metrics = train_step(model, on_device, optimizers, schedulers, call_kwargs, autocast)
                now, cpu_now = time.perf_counter(), time.process_time()
                step_seconds += now - t_prev
                step_cpu_seconds += cpu_now - cpu_prev
                t_prev, cpu_prev = now, cpu_now
                steps_run += 1
                history["steps"] += 1
                history["tokens_trained"] += int((batch["document_ids"] != -1).sum())
                history["loss_curve"].append({"step": history["steps"], "epoch": epoch, "loss": loss})
                epoch_losses.append(loss)
            val = evaluate(model, val_loader, device, call_kwargs, config.ttt_steps, autocast, config.max_val_batches)
            history["train_loss"].append(float(np.mean(epoch_losses)) if epoch_losses else float("nan"))
            history["val_loss"].append(val["loss"])
            history["val_accuracy"].append(val["full_acc"])
            history["val_cond_accuracy"].append(val["cond_acc"])
            history["val_acceptance_length"].append(val["acceptance"])
            say(
                f"draft_model epoch {epoch + 1}/{config.epochs}: train loss {history['train_loss'][-1]:.4f}, "
                f"val loss {val['loss']:.4f}, val acc per step {[round(a, 3) for a in val['full_acc']]}"
            )
            _save_checkpoint(ckpt_dir, epoch, model, optimizers, schedulers, history, fingerprint, config)

        model.eval()
        _save_final(model, final_dir, config.save_dtype)
        write_json_atomic(
            {**history, "config": asdict(config), "fingerprint": fingerprint, "notes": notes}, out_dir / HISTORY_FILE
        )

    return TrainResult(
        epochs=len(history["val_loss"]),
        epochs_run=config.epochs - start_epoch,
        resumed_from_epoch=resumed_from,
        steps=history["steps"],
        tokens_trained=history["tokens_trained"],
        train_loss=history["train_loss"],
        val_loss=history["val_loss"],
        val_loss_untrained=history.get("val_loss_untrained", float("nan")),
        val_accuracy=history["val_accuracy"],
        val_cond_accuracy=history["val_cond_accuracy"],
        val_acceptance_length=history["val_acceptance_length"],
        loss_curve=history["loss_curve"],
        seconds=time.perf_counter() - started,
        seconds_per_step=step_seconds / steps_run if steps_run else 0.0,
        cpu_seconds_per_step=step_cpu_seconds / steps_run if steps_run else 0.0,
        final_dir=final_dir,
        checkpoint_dir=ckpt_dir,
        verifier_path=verifier_path,
        layer_ids=layer_ids,
        draft_vocab_size=draft_vocab_size,
        train_partitions=train_keys,
        val_partition=val_key,
        notes=notes,
    )


@dataclass(frozen=True)
class _OptimizerArgs:
    """The fields of speculators' TrainerConfig that ``build_optimizers`` reads for AdamW."""

    lr: float
    weight_decay: float
    optimizer: str = "adamw"


def _save_checkpoint(
    ckpt_dir: Path,
    epoch: int,
    model: Any,
    optimizers: list,
    schedulers: list,
    history: dict,
    fingerprint: str,
    config: TrainConfig,
) -> None:
    import io

    import torch

    weights = {k: v.detach().cpu() for k, v in model.state_dict().items() if k not in _VERIFIER_OWNED}
    state = {
        "epoch": epoch,
        "fingerprint": fingerprint,
        "model": weights,
        "optimizers": [o.state_dict() for o in optimizers],
        "schedulers": [s.state_dict() for s in schedulers],
        "rng": _rng_state(),
        "history": history,
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    path = ckpt_dir / f"epoch_{epoch:04d}.pt"
    ensure_free_space(ckpt_dir, len(data), "draft_model checkpoint")
    with atomic_path(path, needed_bytes=len(data)) as tmp:
        tmp.write_bytes(data)
    for old in _checkpoints(ckpt_dir)[: -config.keep_checkpoints]:
        old.unlink(missing_ok=True)
