"""draft_model in N processes (torchrun, DDP over gloo on the CPU): the same loss curve as one process with the same
global batch, and a killed rank that fails the whole job cleanly (no process left) with a resume from the last
checkpoint.

Tolerance: one process packs batches of ``tokens_per_batch`` tokens; two pack ``tokens_per_batch // 2`` each from
the same samples (speculators' sampler splits each global batch over the ranks), so the samples are grouped a
little differently, the per-rank mean losses are averaged with equal weights, and the float sums run in another
order. Measured on the tiny verifier (this test's data and config): per-epoch train losses within 2.9%, validation
losses within 4.0% of each other, the untrained validation loss identical; the test allows 10% relative per epoch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.training import TrainConfig, train_draft
from eagle3_assets.training.launch import (
    TrainingFailed,
    TrainSpec,
    run_training_processes,
    torchrun_command,
    worker_env,
)
from support.hidden_states_data import TRAINING_KEYS, copy_training_inputs, training_inputs
from support.signals import training_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

KEYS = TRAINING_KEYS
LOSS_TOLERANCE = 0.10
CONFIG = TrainConfig(epochs=3, tokens_per_batch=1536, lr=3e-3, warmup_ratio=0.0, num_threads=1, max_val_batches=4)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[DataLayout, Path]:
    return training_inputs(tmp_path_factory.mktemp("procs") / "data")


def _spec(layout: DataLayout, verifier: Path, config: TrainConfig, work: Path) -> TrainSpec:
    from dataclasses import asdict

    return TrainSpec(str(layout.root), KEYS[:2], KEYS[2], str(verifier), asdict(config), str(work / "result.json"))


def test_two_processes_match_one_process_with_the_same_global_batch(
    data: tuple[DataLayout, Path], tmp_path: Path
) -> None:
    from eagle3_assets.speculators_adapter import eagle3_classes

    layout, verifier = data
    one = train_draft(copy_training_inputs(layout, tmp_path / "one"), KEYS[:2], KEYS[2], verifier, CONFIG)
    two_layout = copy_training_inputs(layout, tmp_path / "two")
    two = run_training_processes(_spec(two_layout, verifier, CONFIG, tmp_path), 2, tmp_path)
    assert (one.ranks, two.ranks) == (1, 2)
    assert two.steps == one.steps and two.epochs == one.epochs == 3
    assert abs(two.val_loss_untrained - one.val_loss_untrained) <= 1e-5 * one.val_loss_untrained  # same init
    for name in ("train_loss", "val_loss"):
        for epoch, (a, b) in enumerate(zip(getattr(one, name), getattr(two, name), strict=True)):
            assert abs(a - b) <= LOSS_TOLERANCE * a, (name, epoch, getattr(one, name), getattr(two, name))
    assert two.val_loss[-1] < 0.7 * two.val_loss_untrained
    draft = eagle3_classes().SpeculatorModel.from_pretrained(str(two.final_dir))
    assert type(draft).__name__ == "Eagle3DraftModel" and draft.draft_vocab_size == 256


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_killing_one_rank_fails_the_job_leaves_no_process_and_the_next_run_resumes(
    data: tuple[DataLayout, Path], tmp_path: Path
) -> None:
    from eagle3_assets.net.ports import find_free_port
    from eagle3_assets.training.launch import failure_message

    layout, verifier = data
    layout = copy_training_inputs(layout, tmp_path / "data")
    config = TrainConfig(**{**CONFIG.__dict__, "epochs": 6})
    spec_path = _spec(layout, verifier, config, tmp_path).write(tmp_path / "spec.json")
    torchrun = subprocess.Popen(torchrun_command(spec_path, 2, find_free_port()), env=worker_env())
    ckpt_dir = layout.draft_model_dir / "checkpoints"
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and torchrun.poll() is None and not (ckpt_dir / "epoch_0001.pt").exists():
            time.sleep(0.05)
        assert torchrun.poll() is None, "training ended before a rank could be killed"
        workers = _children(torchrun.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)  # rank 1 (or 0: either must take the whole job down)
        code = torchrun.wait(timeout=120)
    finally:
        if torchrun.poll() is None:
            torchrun.kill()
            torchrun.wait()
    assert code != 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(pid) for pid in workers):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers), "a training rank outlived the failed job"
    assert not (layout.draft_model_dir / "final").exists()
    done = sorted(p.name for p in ckpt_dir.glob("epoch_*.pt"))
    last = int(done[-1].split("_")[1].split(".")[0])
    message = failure_message(code, ckpt_dir, 2)
    assert "failed" in message and f"resumes after {done[-1]}" in message

    resumed = run_training_processes(_spec(layout, verifier, config, tmp_path), 2, tmp_path)
    assert resumed.resumed_from_epoch == last and resumed.epochs == 6 and resumed.ranks == 2
    assert resumed.epochs_run == 6 - (last + 1)


def test_a_failing_rank_raises_training_failed(data: tuple[DataLayout, Path], tmp_path: Path) -> None:
    layout, verifier = data
    layout = copy_training_inputs(layout, tmp_path / "data")
    spec = _spec(layout, verifier, CONFIG, tmp_path)
    bad = TrainSpec(**{**spec.__dict__, "val_key": "99999"})  # no such partition: every rank raises
    with pytest.raises(TrainingFailed, match="no checkpoint was written: the next run starts over"):
        run_training_processes(bad, 2, tmp_path)


def test_draft_model_asset_trains_in_two_processes_under_pipes(data: tuple[DataLayout, Path], tmp_path: Path) -> None:
    """EAGLE3_TRAIN_PROCS=2 (the verifier resource's train_procs): torchrun under Dagster Pipes, rank 0's epoch
    lines in the run's logs, and the materialization says 2 ranks."""
    import dagster as dg

    from eagle3_assets.defs.draft import draft_model
    from eagle3_assets.defs.resources import DataStoreResource, VerifierResource

    layout, verifier = data
    layout = copy_training_inputs(layout, tmp_path / "data")
    resources = {
        "data_store": DataStoreResource(data_dir=str(layout.root)),
        "verifier": VerifierResource(path=str(verifier), layer_ids="1,2,3", train_procs=2),
    }
    run_config = {
        "ops": {
            "draft_model": {"config": {"epochs": 2, "tokens_per_batch": 1536, "max_val_batches": 4, "num_threads": 1}}
        }
    }
    with dg.instance_for_test() as instance:
        result = dg.materialize([draft_model], resources=resources, run_config=run_config, instance=instance)
        assert result.success
        metadata = result.asset_materializations_for_node("draft_model")[0].metadata
        assert metadata["ranks"].value == 2 and metadata["epochs"].value == 2
        logs = [e.message for e in instance.all_logs(result.run_id) if e.message]
        assert any("draft_model epoch 2/2" in message for message in logs)  # streamed from rank 0 through Pipes
    assert (layout.draft_model_dir / "final" / "config.json").exists()


def test_a_killed_rank_fails_the_dagster_run_naming_the_resume_point(
    data: tuple[DataLayout, Path], tmp_path: Path
) -> None:
    """SIGKILL one rank of a 2-process draft_model run: the run fails with a message that says a rank died and where
    the next run resumes, and no training process is left."""
    import threading

    import dagster as dg

    from eagle3_assets.defs.draft import draft_model
    from eagle3_assets.defs.resources import DataStoreResource, VerifierResource

    layout, verifier = data
    layout = copy_training_inputs(layout, tmp_path / "data")
    resources = {
        "data_store": DataStoreResource(data_dir=str(layout.root)),
        "verifier": VerifierResource(path=str(verifier), layer_ids="1,2,3", train_procs=2),
    }
    config = {"epochs": 6, "tokens_per_batch": 1536, "max_val_batches": 4, "num_threads": 1}
    outcome: dict = {}

    def materialize() -> None:
        with dg.instance_for_test() as instance:
            result = dg.materialize(
                [draft_model], resources=resources, run_config={"ops": {"draft_model": {"config": config}}},
                instance=instance, raise_on_error=False,
            )  # fmt: skip
            failure = result.failure_data_for_node("draft_model")
            outcome["success"] = result.success
            outcome["message"] = failure.error.to_string() if failure and failure.error else ""

    runner = threading.Thread(target=materialize)
    runner.start()
    ckpt = layout.draft_model_dir / "checkpoints" / "epoch_0000.pt"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and runner.is_alive() and not ckpt.exists():
        time.sleep(0.05)
    workers = _ranks()
    assert len(workers) == 2, workers
    os.kill(workers[0], signal.SIGKILL)
    runner.join(timeout=300)
    assert not runner.is_alive()
    assert outcome["success"] is False
    assert "draft_model training with 2 processes failed" in outcome["message"], outcome["message"]
    assert "the next run resumes after epoch_" in outcome["message"], outcome["message"]
    time.sleep(1)
    assert not [pid for pid in workers if _alive(pid)] and not _ranks(), "a training rank outlived the failed run"


def _ranks() -> list[int]:
    """Live torchrun workers of this project started by this test process's children."""
    return sorted(training_ranks(os.getpid()))
