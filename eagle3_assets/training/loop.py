"""The training loop: speculators' Trainer step in a plain torch loop that runs on a CPU, in one or N processes.

What is ours, and why: speculators' ``Trainer`` assumes an accelerator (``model.to(local_rank)``,
``torch.accelerator.synchronize``), so the loop is its step (forward with the TTT steps unrolled, backward, clip at
1.0, AdamW, scheduler) plus:

* a validation pass before training (the untrained draft's loss: the baseline the trained one must beat);
* one checkpoint per epoch and a resume after the last whole one (:mod:`eagle3_assets.training.checkpoints`);
* the final draft in speculators' format under ``draft_model_dir / "final"``.

Several processes (started by :mod:`eagle3_assets.training.launch` through torchrun): the model is wrapped in
``DistributedDataParallel`` (gloo on CPU, NCCL on GPU); speculators' packing sampler gives each rank its own
batches of ``tokens_per_batch // world`` tokens, so the global batch per optimizer step is the same as one
process's. Rank 0 alone takes the partition lock, validates (on the whole held-out partition, so the numbers
equal a one-process run's for the same weights), writes checkpoints, the final draft and the history; the other
ranks wait at barriers. Every rank starts from the same checkpoint, so the replicated state stays identical.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_assets.core import lineage
from eagle3_assets.core.precision import resolve_precision
from eagle3_assets.core.settings import redact_url_credentials
from eagle3_assets.core.storage import DataLayout, exclusive_lock, remove_dead_writers_temps
from eagle3_assets.hidden_states import versions
from eagle3_assets.hidden_states.backends import torch_threads
from eagle3_assets.speculators_adapter import build_optimizers, normalize_counted_metrics
from eagle3_assets.training import checkpoints as ckpt
from eagle3_assets.training.data import make_loader, to_device
from eagle3_assets.training.model import build_draft, resolve_device, trainer_kwargs
from eagle3_assets.training.online_states import (
    ONLINE_TIME_KEY,
    OnlineExtraction,
    online_extraction,
    serving,
    transfer_dir,
)
from eagle3_assets.training.pinning import partition_meta, pinned_partitions
from eagle3_assets.training.ranks import Ranks
from eagle3_assets.training.train_config import TrainConfig, TrainResult
from eagle3_assets.training.vocab import fingerprint_part, read_vocab_mapping

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

EpochCallback = Callable[[dict[str, Any]], None]


def train_step(
    model: Any, batch: dict[str, Any], optimizers: list[Any], schedulers: list[Any], call_kwargs: dict, autocast: Any
) -> tuple[float, dict[str, Any]]:
    """speculators Trainer's step: forward (TTT unrolled), backward, clip at 1.0, optimizer, scheduler."""
    # lazy: loads torch (heavy), which only this path needs
    import torch

    with autocast():
        _draft_tokens, loss, metrics = model(**batch, **call_kwargs)
    for opt in optimizers:
        opt.zero_grad()
    loss.backward()  # under DDP: the gradients are averaged over the ranks here
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
    # lazy: loads torch (heavy), which only this path needs
    import torch

    model.eval()
    sums: dict[str, float] = {}
    batches = 0
    with torch.no_grad():
        for batch in loader:
            if max_batches is not None and batches >= max_batches:
                break
            with autocast():
                _tokens, _loss, metrics = model(**to_device(batch, device), **call_kwargs)
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
    return {"loss": metrics.get("loss", float("nan")), "full_acc": full, "cond_acc": cond, "acceptance": accept}


@dataclass
class _Run:
    """Everything one training call works with (built by :func:`_prepare`)."""

    config: TrainConfig
    ranks: Ranks
    device: Any
    model: Any  # DDP-wrapped with several ranks
    core: Any  # the draft itself (what is evaluated and saved)
    autocast: Callable[[], Any]
    call_kwargs: dict
    train_loader: Any
    val_loader: Any
    steps_per_epoch: int
    optimizers: list
    schedulers: list
    fingerprint: str
    history: dict[str, Any]
    notes: list[str]
    say: Callable[[str], None]


def _schedulers(config: TrainConfig, optimizers: list, total_steps: int) -> list:
    # lazy: loads transformers (heavy), which only this path needs
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    warmup = int(total_steps * config.warmup_ratio)
    if config.scheduler == "cosine":
        return [get_cosine_schedule_with_warmup(o, warmup, total_steps) for o in optimizers]
    if config.scheduler == "linear":
        return [get_linear_schedule_with_warmup(o, warmup, total_steps) for o in optimizers]
    return []


def _seed(seed: int) -> None:
    # lazy: loads numpy (heavy), which only this path needs
    import numpy as np

    # lazy: loads torch (heavy), which only this path needs
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _prepare(
    layout: DataLayout,
    train_keys: list[str],
    val_key: str,
    verifier_path: Path,
    meta: dict[str, Any],
    config: TrainConfig,
    ranks: Ranks,
    say: Callable[[str], None],
    dirs: Mapping[str, Path],
    online: OnlineExtraction | None = None,
) -> _Run:
    """The draft (seeded, DDP-wrapped with several ranks), loaders, optimizers, schedulers and the fingerprint."""
    # lazy: loads torch (heavy), which only this path needs
    import torch

    layer_ids, hidden_size = list(meta["layer_ids"]), int(meta["hidden_size"])
    device = resolve_device(config.device)
    on_gpu = device.type != "cpu"
    # bf16 autocast over fp32 weights, like speculators' Trainer, on GPUs or where asked for (a CPU with native bf16);
    # float32 throughout elsewhere (precision.py)
    bf16 = resolve_precision(config.precision, on_gpu) == "bfloat16"
    hs_dtype = torch.bfloat16 if bf16 else torch.float32

    def autocast() -> Any:
        return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    notes: list[str] = []
    loaded = read_vocab_mapping(layout)  # read once: the fingerprint below is of these very bytes
    if loaded is None:
        notes.append("no vocab_mapping found: the draft uses the verifier's full vocabulary")
    mapping = (loaded.d2t, loaded.t2d) if loaded is not None else None
    _seed(config.seed)
    core = build_draft(verifier_path, layer_ids, config, mapping).to(device)
    core.train()
    model = core
    if ranks.world > 1:
        model = torch.nn.parallel.DistributedDataParallel(core, device_ids=[device.index] if on_gpu else None)
    per_rank = config.tokens_per_batch // ranks.world
    loader_args = (per_rank, hidden_size, len(layer_ids), hs_dtype, config.seed)
    sources = {"online": online, "config": config}
    train_dirs = [dirs[k] for k in train_keys]  # pinned versions
    train_loader = make_loader(train_dirs, *loader_args, ranks=ranks, **sources, loss_on=config.loss_on)
    # validated under the loss mask it trains with: the validation loss and accuracies measure what is optimized
    val_loader = make_loader(
        [dirs[val_key]], config.tokens_per_batch, *loader_args[1:], **sources, loss_on=config.loss_on
    )
    steps = len(train_loader)
    if config.max_steps_per_epoch is not None:
        steps = min(steps, config.max_steps_per_epoch)
    steps = int(ranks.all_reduce(steps, "min"))  # every rank must take the same steps, or DDP waits forever
    data_samples = sum(len(ds) for ds in train_loader.dataset.datasets)
    optimizers = build_optimizers(core, config.lr, config.weight_decay, config.optimizer, config.muon_lr)
    schedulers = _schedulers(config, optimizers, config.epochs * steps)
    fingerprint = ckpt.fingerprint(
        train_keys, val_key, verifier_path, layer_ids, int(core.draft_vocab_size), config, data_samples
    )
    # content, not paths and counts: other hidden states, vocabulary or verifier weights never resume it
    fingerprint = lineage.training_fingerprint(
        fingerprint, layout, [*train_keys, val_key], verifier_path, dirs, fingerprint_part(layout, loaded)
    )
    history: dict[str, Any] = {
        **{k: [] for k in ("train_loss", "val_loss", "val_accuracy", "val_cond_accuracy", "val_acceptance_length")},
        "loss_curve": [],
        "tokens_trained": 0,
        "steps": 0,
        "train_samples": data_samples,  # samples with hidden states in the training partitions (this rank's view)
    }
    return _Run(
        config, ranks, device, model, core, autocast, trainer_kwargs(config), train_loader, val_loader, steps,
        optimizers, schedulers, fingerprint, history, notes, say,
    )  # fmt: skip


def _resume_or_baseline(run: _Run, ckpt_dir: Path) -> int | None:
    """Load the newest matching checkpoint (returns its epoch), or measure the untrained draft (returns None)."""
    state = ckpt.load_latest_checkpoint(ckpt_dir, run.fingerprint, run.notes, archive=run.ranks.main)
    if state is not None:
        missing, unexpected = run.core.load_state_dict(state["model"], strict=False)
        if unexpected or set(missing) - set(ckpt.VERIFIER_OWNED):
            raise RuntimeError(f"checkpoint does not fit the draft: missing {missing}, unexpected {unexpected}")
        for opt, opt_state in zip(run.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(opt_state)
        for sched, sched_state in zip(run.schedulers, state["schedulers"], strict=True):
            sched.load_state_dict(sched_state)
        ckpt.set_rng_state(state["rng"])
        run.history = state["history"]
        run.say(f"draft_model: resuming after epoch {state['epoch'] + 1} of {run.config.epochs}")
        return int(state["epoch"])
    if run.ranks.main:
        baseline = _validate(run)
        run.history["val_loss_untrained"] = baseline["loss"]
        run.history["val_accuracy_untrained"] = baseline["full_acc"]
        run.say(f"draft_model: untrained val loss {baseline['loss']:.4f}")
    run.ranks.barrier()
    return None


def _validate(run: _Run) -> dict:
    cfg = run.config
    return evaluate(
        run.core, run.val_loader, run.device, run.call_kwargs, cfg.ttt_steps, run.autocast, cfg.max_val_batches
    )


@dataclass
class _Timing:
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    steps: int = 0
    wait_s: float = 0.0  # waiting for the loader's next batch
    fetch_s: float = 0.0  # online: computing the batches' states (in the loader's workers)


def _train_epoch(run: _Run, epoch: int, timing: _Timing) -> list[float]:
    """One epoch of optimizer steps; the loss of each step is the mean over the ranks."""
    run.train_loader.batch_sampler.set_epoch(epoch)
    losses = []
    # a step's time includes fetching its batch (reading hidden states), the way a user waits for it
    t_prev, cpu_prev = time.perf_counter(), time.process_time()
    progress = _Progress(run, epoch, t_prev)
    for step_in_epoch, batch in enumerate(run.train_loader):
        if step_in_epoch >= run.steps_per_epoch:
            break
        timing.wait_s += time.perf_counter() - t_prev
        timing.fetch_s += float(batch.get(ONLINE_TIME_KEY, 0.0))
        loss, _metrics = train_step(
            run.model, to_device(batch, run.device), run.optimizers, run.schedulers, run.call_kwargs, run.autocast
        )
        loss = run.ranks.all_reduce(loss) / run.ranks.world
        tokens = int(run.ranks.all_reduce(int((batch["document_ids"] != -1).sum())))
        now, cpu_now = time.perf_counter(), time.process_time()
        timing.seconds += now - t_prev
        timing.cpu_seconds += cpu_now - cpu_prev
        t_prev, cpu_prev = now, cpu_now
        timing.steps += 1
        run.history["steps"] += 1
        run.history["tokens_trained"] += tokens
        run.history["loss_curve"].append({"step": run.history["steps"], "epoch": epoch, "loss": loss})
        losses.append(loss)
        progress.step(step_in_epoch + 1, loss, tokens, now)
    return losses


class _Progress:
    """Rank 0's progress lines within an epoch, at most every ``config.progress_interval_s`` seconds."""

    def __init__(self, run: _Run, epoch: int, started: float) -> None:
        self.run, self.epoch, self.started, self.last, self.tokens = run, epoch, started, started, 0

    def step(self, step: int, loss: float, tokens: int, now: float) -> None:
        self.tokens += tokens
        run = self.run
        if not run.ranks.main or now - self.last < run.config.progress_interval_s:
            return
        self.last = now
        elapsed = now - self.started
        left_s = elapsed / step * (run.steps_per_epoch - step)
        run.say(
            f"draft_model epoch {self.epoch + 1}/{run.config.epochs}: step {step}/{run.steps_per_epoch}, "
            f"loss {loss:.4f}, {self.tokens / elapsed:,.0f} tokens/s, ~{left_s / 60:.0f} min left in the epoch"
        )


def _end_epoch(run: _Run, epoch: int, losses: list[float], ckpt_dir: Path, on_epoch: EpochCallback | None) -> None:
    """Rank 0: validate, record, report and checkpoint; every rank then meets at a barrier."""
    # lazy: loads numpy (heavy), which only this path needs
    import numpy as np

    if run.ranks.main:
        val = _validate(run)
        h = run.history
        h["train_loss"].append(float(np.mean(losses)) if losses else float("nan"))
        h["val_loss"].append(val["loss"])
        h["val_accuracy"].append(val["full_acc"])
        h["val_cond_accuracy"].append(val["cond_acc"])
        h["val_acceptance_length"].append(val["acceptance"])
        run.say(
            f"draft_model epoch {epoch + 1}/{run.config.epochs}: train loss {h['train_loss'][-1]:.4f}, "
            f"val loss {val['loss']:.4f}, val acc per step {[round(a, 3) for a in val['full_acc']]}"
        )
        if on_epoch is not None:
            on_epoch(
                {"epoch": epoch + 1, "train_loss": h["train_loss"][-1], "val_loss": val["loss"],
                 "val_acceptance_length": val["acceptance"], "steps": h["steps"], "ranks": run.ranks.world}
            )  # fmt: skip
        ckpt.save_checkpoint(
            ckpt_dir, epoch, run.core, run.optimizers, run.schedulers, run.history, run.fingerprint, run.config,
            run.notes.append,
        )  # fmt: skip
    run.ranks.barrier()


@contextlib.contextmanager
def _main_rank_lock(layout: DataLayout, ranks: Ranks, folders: Sequence[Path]) -> Iterator[None]:
    """Rank 0 holds the draft_model lock and sweeps a killed run's temporaries before any rank reads a checkpoint."""
    lock = exclusive_lock(layout.lock_path("draft_model"), "draft_model training") if ranks.main else None
    with lock if lock is not None else contextlib.nullcontext():
        if ranks.main:
            # A killed run never renames its temporaries into place (a checkpoint, final/ being saved or moved
            # aside, the history): without this sweep each kill would leak a checkpoint- or draft-sized file.
            for folder in folders:
                remove_dead_writers_temps(folder)
        ranks.barrier()
        yield


def current_extraction(layout: DataLayout, verifier_path: Path, config: TrainConfig) -> dict[str, Any]:
    """What hidden states trained on must have been extracted with: the content of the verifier this run trains
    against, and the configured layer ids when the caller gives them (``config.layer_ids``)."""
    current: dict[str, Any] = {
        "verifier": lineage.verifier_fingerprint(verifier_path, cache_dir=layout.asset_dir("hidden_states"))
    }
    if config.layer_ids is not None:
        current["layer_ids"] = list(config.layer_ids)
    return current


def _require_checked(layout: DataLayout, keys: Sequence[str], dirs: Mapping[str, Path]) -> None:
    """Refuse versions whose checks did not pass (or are not recorded yet): the partitions were chosen by the
    checks of the versions current then, and a rebuild may have been published since."""
    _usable, excluded = lineage.partitions_passing_checks(layout, keys, dirs)
    if excluded:
        listed = "; ".join(f"{key} ({why})" for key, why in sorted(excluded.items()))
        raise versions.StaleHiddenStatesError(
            f"draft_model training: the hidden_states version now published is not usable: {listed}. A rebuild "
            "was published after the partitions were chosen, or its checks failed: wait for its run to record "
            "its checks (or re-materialize hidden_states for it), then run draft_model again"
        )


def train_draft(
    layout: DataLayout,
    train_keys: Sequence[str],
    val_key: str,
    verifier_path: str | Path,
    config: TrainConfig | None = None,
    log: Callable[[str], None] | None = None,
    on_epoch: EpochCallback | None = None,
) -> TrainResult:
    """Train (or resume training) the draft on ``train_keys``' hidden states, validating on ``val_key``.

    In a torchrun worker (torch.distributed initialized) this is one rank of the job; see the module docstring.
    ``on_epoch`` (rank 0) receives each epoch's metrics as they are measured.
    """
    config = config or TrainConfig()
    config.validate()
    started = time.perf_counter()
    train_keys = list(train_keys)
    if not train_keys:
        raise ValueError("train_draft needs at least one training partition")
    if val_key in train_keys:
        raise ValueError(f"validation partition {val_key} is also a training partition")
    ranks = Ranks.current()
    say = (log or logger.info) if ranks.main else logger.debug
    verifier_path = Path(verifier_path).expanduser().resolve()
    out_dir = layout.draft_model_dir
    ckpt_dir, final_dir = out_dir / ckpt.CHECKPOINT_DIR, out_dir / ckpt.FINAL_DIR

    with contextlib.ExitStack() as stack:
        stack.enter_context(_main_rank_lock(layout, ranks, (out_dir, ckpt_dir)))
        dirs = stack.enter_context(pinned_partitions(layout, [*train_keys, val_key], ranks))
        # the pinned versions' lineage against what this run would extract now: never train on stale states
        current = current_extraction(layout, verifier_path, config)
        versions.require_current_hidden_states(layout, [*train_keys, val_key], current, dirs, "draft_model training")
        if config.checked_partitions_only:
            _require_checked(layout, [*train_keys, val_key], dirs)
        stack.enter_context(torch_threads(config.num_threads))
        meta = partition_meta(layout, [*train_keys, val_key], dirs)
        # online: the extraction side (an embedded server when asked for) lives as long as the run
        online = stack.enter_context(
            serving(online_extraction(config, verifier_path, meta), transfer_dir(out_dir, ranks))
        )
        run = _prepare(layout, train_keys, val_key, verifier_path, meta, config, ranks, say, dirs, online)
        resumed_from = _resume_or_baseline(run, ckpt_dir)
        start_epoch = 0 if resumed_from is None else resumed_from + 1
        timing = _Timing()
        for epoch in range(start_epoch, config.epochs):
            losses = _train_epoch(run, epoch, timing)
            _end_epoch(run, epoch, losses, ckpt_dir, on_epoch)
        if ranks.main:
            run.core.eval()
            ckpt.save_final(run.core, final_dir, config.save_dtype)
            # the extraction servers' URLs may hold a password (EAGLE3_HIDDEN_STATES_URL): never in a stored file
            shown = {**asdict(config), "online_urls": [redact_url_credentials(url) for url in config.online_urls]}
            record = {**run.history, "config": shown, "fingerprint": run.fingerprint, "notes": run.notes}
            ckpt.save_history(record, out_dir)
        ranks.barrier()
    return _result(run, resumed_from, timing, started, final_dir, ckpt_dir, verifier_path, meta, train_keys, val_key)


def _result(
    run: _Run,
    resumed_from: int | None,
    timing: _Timing,
    started: float,
    final_dir: Path,
    ckpt_dir: Path,
    verifier_path: Path,
    meta: dict[str, Any],
    train_keys: list[str],
    val_key: str,
) -> TrainResult:
    h = run.history
    return TrainResult(
        epochs=len(h["val_loss"]),
        epochs_run=run.config.epochs - (0 if resumed_from is None else resumed_from + 1),
        resumed_from_epoch=resumed_from,
        steps=h["steps"],
        tokens_trained=h["tokens_trained"],
        train_samples=int(h.get("train_samples", 0)),
        train_loss=h["train_loss"],
        val_loss=h["val_loss"],
        val_loss_untrained=h.get("val_loss_untrained", float("nan")),
        val_accuracy=h["val_accuracy"],
        val_cond_accuracy=h["val_cond_accuracy"],
        val_acceptance_length=h["val_acceptance_length"],
        loss_curve=h["loss_curve"],
        seconds=time.perf_counter() - started,
        seconds_per_step=timing.seconds / timing.steps if timing.steps else 0.0,
        cpu_seconds_per_step=timing.cpu_seconds / timing.steps if timing.steps else 0.0,
        final_dir=final_dir,
        checkpoint_dir=ckpt_dir,
        verifier_path=verifier_path,
        layer_ids=list(meta["layer_ids"]),
        draft_vocab_size=int(run.core.draft_vocab_size),
        train_partitions=train_keys,
        val_partition=val_key,
        notes=run.notes,
        ranks=run.ranks.world,
        hidden_states={
            "source": run.config.hidden_states_source, "fetch_s": round(timing.fetch_s, 2),
            "wait_s": round(timing.wait_s, 2), "train_s": round(timing.seconds - timing.wait_s, 2),
        },
    )  # fmt: skip
