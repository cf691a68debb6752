"""Issue 8, kill anywhere (draft_model): SIGKILL a training run at random points (seeded: after a random number of
optimizer steps, after a random checkpoint write, around the final save); after re-running, the final draft, its
config and the training history equal an uninterrupted run's with the same seed and data, bit for bit.

Why bit-exact is the right bar (no tolerance): ``train_draft`` seeds torch/random/numpy before building the draft;
each epoch's batches come from speculators' packing sampler seeded with ``seed`` and ``set_epoch(epoch)``; a
checkpoint (written atomically at the end of each epoch) holds the trainable weights, the AdamW and scheduler state and
the RNG state; a resume rebuilds the draft, loads that state and replays from the next epoch's first batch. On a CPU
with a fixed thread count (``num_threads=1``, here and in the child) the same float ops run in the same order, so any
difference, however small, means state was lost or replayed wrongly.

Also: every checkpoint a killed run leaves is whole (loads, equals the uninterrupted run's checkpoint of that epoch)
and the resume starts after the newest one; ``final/`` is never seen incomplete, not even while the killed run
writes it (the watcher lists it every few milliseconds); a torn checkpoint (truncated bytes, as a non-atomic copy or
a broken disk would leave) is skipped with a note and never used as a resume point; the temporary files and
folders a killed run leaves (a checkpoint or final/ not yet renamed, an old final/ moved aside) are removed by the
next run, a live writer's are kept.
tests/unit/test_training.py::test_sigkill_during_training_resumes_from_last_checkpoint proves one kill point."""

from __future__ import annotations

import json
import os
import random
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest

from eagle3_assets.core.storage import DataLayout
from support.reliability import block_before_rename, sigkill_child_when

TRAIN, VAL = ["00000"], "00001"
LAYERS = [1, 2, 3]
# 4 epochs x 5 steps of 256 packed tokens: ~0.05 s a step on an idle 2-core machine, so a run is a few seconds and
# the kill points spread over the steps, the per-epoch validation, the checkpoint writes and the final save.
# Warm-up + cosine so the scheduler state has to survive a resume too.
CONFIG: dict[str, Any] = dict(
    epochs=4,
    tokens_per_batch=256,
    lr=3e-3,
    warmup_ratio=0.25,
    max_steps_per_epoch=5,
    max_val_batches=1,
    num_threads=1,
    seed=7,
)
# (seed, where the kill lands): the seed draws the exact step / checkpoint / delay
KILLS = [(3, "steps"), (11, "checkpoint"), (29, "final-save"), (41, "final")]

CHILD = block_before_rename(7) + textwrap.dedent(
    """
    import sys, time
    from torch.optim.optimizer import register_optimizer_step_post_hook
    # the ~20 s speculators import happens before START, so the kill thresholds time only the training
    import speculators.models.eagle3, speculators.train.data, speculators.train.optimizers  # noqa: F401
    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.training import TrainConfig, train_draft

    root, verifier, steps_path, train, val, config = sys.argv[1:7]
    counter = open(steps_path, "ab", buffering=0)
    register_optimizer_step_post_hook(lambda optimizer, args, kwargs: counter.write(b"."))
    print("START", flush=True)
    train_draft(DataLayout.at(root), train.split(","), val, verifier, TrainConfig(**eval(config)))
    print("DONE", flush=True)
    time.sleep(3600)  # a kill just after the end still lands on a live process
    """
)


def _config(**overrides: Any) -> Any:
    from eagle3_assets.training import TrainConfig

    return TrainConfig(**{**CONFIG, **overrides})


def _copy_inputs(src: DataLayout, dst: Path) -> DataLayout:
    for asset in ("hidden_states", "vocab_mapping"):
        shutil.copytree(src.asset_dir(asset), dst / asset, ignore=shutil.ignore_patterns("_locks"))
    return DataLayout.at(dst)


def _checkpoint_epochs(ckpt_dir: Path) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in ckpt_dir.glob("epoch_*.pt"))


def _final_state(final_dir: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return json.loads((final_dir / "config.json").read_text()), load_file(final_dir / "model.safetensors")


def _comparable(history: dict[str, Any], *drop: str) -> dict[str, Any]:
    """The training history without ``drop`` and without the one setting the reference run changes on purpose
    (it keeps every checkpoint, to compare them epoch by epoch): neither the training nor its result depends on it."""
    out = {k: v for k, v in history.items() if k not in drop}
    if isinstance(out.get("config"), dict):
        out["config"] = {k: v for k, v in out["config"].items() if k != "keep_checkpoints"}
    return out


def _assert_same_tensors(ours: dict, theirs: dict, what: str) -> None:
    import torch

    assert sorted(ours) == sorted(theirs), what
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), f"{what}: {name} differs"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DataLayout]:
    """(verifier, hidden states of a 24-sample training and an 8-sample validation partition + vocab mapping)"""
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
    from eagle3_assets.training import build_vocab_mapping
    from support.hidden_states_data import cached_tiny_verifier, fabricate_responses

    verifier = cached_tiny_verifier()
    layout = DataLayout.at(tmp_path_factory.mktemp("draft_inputs") / "data")
    for key, n in ((TRAIN[0], 24), (VAL, 8)):
        fabricate_responses(layout, key, n, min_words=20, max_words=40)
        extract_partition(layout, key, verifier, HiddenStatesConfig(layer_ids=LAYERS))
    build_vocab_mapping(layout, TRAIN, draft_vocab_size=256, target_vocab_size=1024)
    return verifier, layout


@pytest.fixture(scope="module")
def reference(inputs: tuple[Path, DataLayout], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An uninterrupted run (every checkpoint kept, to compare the killed runs' checkpoints epoch by epoch)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from eagle3_assets.training import train_draft

    verifier, source = inputs
    layout = _copy_inputs(source, tmp_path_factory.mktemp("draft_reference"))
    calls: list[int] = []
    hook = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: calls.append(1))
    try:
        result = train_draft(layout, TRAIN, VAL, verifier, _config(keep_checkpoints=100))
    finally:
        hook.remove()
    assert result.steps == CONFIG["epochs"] * CONFIG["max_steps_per_epoch"] and len(calls) >= result.steps
    out = layout.draft_model_dir
    return {
        "layout": layout,
        "optimizer_calls": len(calls),  # what the child's hook counts: one per optimizer.step()
        "final": _final_state(out / "final"),
        "final_files": sorted(p.name for p in (out / "final").iterdir()),
        "history": json.loads((out / "training_history.json").read_text()),
        "checkpoints": {e: out / "checkpoints" / f"epoch_{e:04d}.pt" for e in range(CONFIG["epochs"])},
    }


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "mode"), KILLS)
def test_sigkill_draft_model_at_a_random_point_then_resume_equals_an_uninterrupted_run(
    seed: int, mode: str, inputs: tuple[Path, DataLayout], reference: dict[str, Any], tmp_path: Path
) -> None:
    import torch

    from eagle3_assets.training import train_draft

    verifier, source = inputs
    layout = _copy_inputs(source, tmp_path / "data")
    out = layout.draft_model_dir
    ckpt_dir, final_dir = out / "checkpoints", out / "final"
    steps_path = tmp_path / "optimizer_steps"
    rng = random.Random(seed)
    total = reference["optimizer_calls"]
    if mode == "steps":  # mid-training, usually mid-epoch: the epoch is replayed from its checkpoint
        threshold = rng.randint(1, total - 1)

        def reached() -> bool:
            return steps_path.exists() and steps_path.stat().st_size >= threshold
    elif mode == "checkpoint":  # just after a checkpoint's rename, or during the next epoch's first steps
        threshold = rng.randint(0, CONFIG["epochs"] - 2)

        def reached() -> bool:
            return (ckpt_dir / f"epoch_{threshold:04d}.pt").exists()
    elif mode == "final-save":  # while final/'s temporary folder is written (save_pretrained), or at its rename

        def reached() -> bool:
            return any(out.glob(".final.tmp-*"))
    else:  # final/ in place: between its rename and the history write, or just after the end

        def reached() -> bool:
            return final_dir.exists()

    delay = {"steps": 0.3, "checkpoint": 0.3, "final-save": 0.004, "final": 0.0}[mode] * rng.random()
    seen_final: set[tuple[str, ...]] = set()

    def watch() -> bool:
        # final/ appears by a rename of a complete folder: any listing of it must be the complete one
        if final_dir.is_dir():
            seen_final.add(tuple(sorted(os.listdir(final_dir))))
        return reached()

    script = tmp_path / "child.py"
    script.write_text(CHILD)
    args = [str(layout.root), str(verifier), str(steps_path), ",".join(TRAIN), VAL, repr(CONFIG)]
    sigkill_child_when(script, args, watch, timeout_s=300, delay_s=delay)
    if final_dir.is_dir():
        seen_final.add(tuple(sorted(os.listdir(final_dir))))
    where = f"seed {seed} ({mode}), steps done {steps_path.stat().st_size if steps_path.exists() else 0}/{total}"

    # what the kill left: only whole checkpoints (each equal to the uninterrupted run's of that epoch), and final/
    # either absent or complete and already the uninterrupted run's draft
    left = _checkpoint_epochs(ckpt_dir)
    for epoch in left:
        ours = torch.load(ckpt_dir / f"epoch_{epoch:04d}.pt", map_location="cpu", weights_only=False)
        theirs = torch.load(reference["checkpoints"][epoch], map_location="cpu", weights_only=False)
        assert ours["epoch"] == epoch and ours["fingerprint"] == theirs["fingerprint"], where
        _assert_same_tensors(ours["model"], theirs["model"], f"{where}: checkpoint {epoch}")
    assert seen_final <= {tuple(reference["final_files"])}, (where, seen_final)
    if final_dir.is_dir():
        config, tensors = _final_state(final_dir)
        assert config == reference["final"][0], where
        _assert_same_tensors(tensors, reference["final"][1], f"{where}: final/ left by the killed run")
    if mode != "final":  # final/ appears ~1 ms before the history write: a kill there may come after the end
        assert not (out / "training_history.json").exists(), f"{where}: the run ended before the kill"

    result = train_draft(layout, TRAIN, VAL, verifier, _config())
    assert result.resumed_from_epoch == (left[-1] if left else None), where  # the newest whole checkpoint
    assert result.epochs == CONFIG["epochs"] and result.steps == reference["history"]["steps"], where
    assert not result.notes, (where, result.notes)

    config, tensors = _final_state(final_dir)
    assert config == reference["final"][0], where
    _assert_same_tensors(tensors, reference["final"][1], f"{where}: final draft")
    assert sorted(p.name for p in final_dir.iterdir()) == reference["final_files"], where
    history = json.loads((out / "training_history.json").read_text())
    # losses per step and epoch, accuracies, tokens: identical
    assert _comparable(history) == _comparable(reference["history"]), where
    assert _checkpoint_epochs(ckpt_dir) == [CONFIG["epochs"] - 2, CONFIG["epochs"] - 1], where  # pruned to 2


@pytest.mark.slow
def test_torn_checkpoint_is_never_a_resume_point(
    inputs: tuple[Path, DataLayout], reference: dict[str, Any], tmp_path: Path
) -> None:
    """A checkpoint cut short (the bytes of a half-done copy or write) is skipped with a note; training resumes from
    the newest whole one, and the result equals the uninterrupted run's."""
    from eagle3_assets.training import train_draft

    verifier, source = inputs
    layout = _copy_inputs(source, tmp_path / "data")
    ckpt_dir = layout.draft_model_dir / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    for epoch in (0, 1):
        shutil.copy(reference["checkpoints"][epoch], ckpt_dir)
    whole = reference["checkpoints"][2].read_bytes()
    (ckpt_dir / "epoch_0002.pt").write_bytes(whole[: len(whole) // 2])
    (ckpt_dir / "epoch_0003.pt").write_bytes(b"")  # created, never written

    result = train_draft(layout, TRAIN, VAL, verifier, _config())
    assert result.resumed_from_epoch == 1
    assert any("epoch_0003.pt" in note for note in result.notes), result.notes
    assert any("epoch_0002.pt" in note for note in result.notes), result.notes
    config, tensors = _final_state(layout.draft_model_dir / "final")
    assert config == reference["final"][0]
    _assert_same_tensors(tensors, reference["final"][1], "final draft after a torn checkpoint")
    history = json.loads((layout.draft_model_dir / "training_history.json").read_text())
    assert _comparable(history, "notes") == _comparable(reference["history"], "notes")


@pytest.mark.slow
def test_temporary_files_of_a_killed_training_run_are_removed_by_the_next_run(
    inputs: tuple[Path, DataLayout], reference: dict[str, Any], tmp_path: Path
) -> None:
    """Two kills with a temporary file written but not yet renamed (the child stops for good just before the
    rename, then is SIGKILLed): during epoch 1's checkpoint, then during the final save that replaces an earlier
    final/ (moved aside first). The next run removes each killed run's temporary file or folder; the run after them
    finishes with the uninterrupted run's draft and leaves no temporary entry behind, except a live writer's."""
    from eagle3_assets.training import train_draft

    verifier, source = inputs
    layout = _copy_inputs(source, tmp_path / "data")
    out = layout.draft_model_dir
    ckpt_dir = out / "checkpoints"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    args = [str(layout.root), str(verifier), str(tmp_path / "steps"), ",".join(TRAIN), VAL, repr(CONFIG)]

    def temps() -> list[str]:
        return sorted(str(p.relative_to(out)) for p in out.rglob(".*"))

    marker = tmp_path / "blocked-checkpoint"
    sigkill_child_when(script, [*args, ".epoch_0001.pt.tmp-", str(marker)], marker.exists, timeout_s=300)
    first = temps()
    assert len(first) == 1 and first[0].startswith("checkpoints/.epoch_0001.pt.tmp-"), first

    # an earlier training's draft is in place: the final save moves it aside (.final.old-PID) before its rename
    shutil.copytree(reference["layout"].draft_model_dir / "final", out / "final")
    marker = tmp_path / "blocked-final"
    sigkill_child_when(script, [*args, ".final.tmp-", str(marker)], marker.exists, timeout_s=300)
    second = temps()
    assert first[0] not in second, second  # the second run removed the first one's checkpoint temporary
    assert [name.split("-")[0] for name in second] == [".final.old", ".final.tmp"], second
    assert not (out / "final").exists()  # killed between moving the old draft aside and renaming the new one

    # a writer still running (pid 1 is always alive) keeps its temporary entries
    live = [ckpt_dir / ".epoch_0003.pt.tmp-1", out / ".final.tmp-1"]
    live[0].write_bytes(b"being written")
    live[1].mkdir()
    result = train_draft(layout, TRAIN, VAL, verifier, _config())
    assert result.resumed_from_epoch == CONFIG["epochs"] - 1
    _assert_same_tensors(_final_state(out / "final")[1], reference["final"][1], "final draft")
    assert temps() == sorted(str(p.relative_to(out)) for p in live), f"temporary entries left under {out}"
