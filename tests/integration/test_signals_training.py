"""Issue 22: ``draft_model`` trained by torchrun (``EAGLE3_TRAIN_PROCS=2``, under Dagster Pipes) through the real
``dagster asset materialize``:

- SIGTERM to the CLI stops torchrun and its ranks within 30 s, the run fails, the checkpoints written stay, the lock
  is free, and a re-run resumes after the last checkpoint;
- SIGKILL of the CLI (no cleanup can run) still takes torchrun and its ranks down (torchrun's parent-death signal)
  and frees the ``draft_model`` lock.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from eagle3_assets.core import storage
from eagle3_assets.core.storage import DataLayout
from support.hidden_states_data import copy_training_inputs, training_inputs
from support.signals import (
    STOP_WITHIN_S,
    Pipeline,
    alive,
    assert_stopped,
    cleanup,
    descendants,
    log_text,
    make_pipeline,
    materialize_command,
    run,
    signal_and_wait,
    start,
    training_ranks,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RUN_CONFIG = {
    "ops": {"draft_model": {"config": {"epochs": 4, "tokens_per_batch": 1536, "max_val_batches": 4, "num_threads": 1}}}
}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[DataLayout, Path]:
    return training_inputs(tmp_path_factory.mktemp("signals-training") / "data")


def _pipeline(root: Path, prepared: tuple[DataLayout, Path]) -> tuple[Pipeline, DataLayout]:
    data, verifier = prepared
    pipeline = make_pipeline(
        root, 4, 4, "http://127.0.0.1:9/v1", EAGLE3_VERIFIER_PATH=str(verifier), EAGLE3_LAYER_IDS="1,2,3",
        EAGLE3_TRAIN_PROCS="2",
    )  # fmt: skip
    return pipeline, copy_training_inputs(data, pipeline.data_dir)


def _train_command() -> list[str]:
    return [*materialize_command("draft_model"), "--config-json", json.dumps(RUN_CONFIG)]


def _lock_is_free(layout: DataLayout) -> bool:
    try:
        with storage.exclusive_lock(layout.lock_path("draft_model"), "draft_model (test)"):
            return True
    except storage.PartitionBusyError:
        return False


def test_sigterm_stops_torchrun_and_its_ranks_and_the_next_run_resumes(
    tmp_path: Path, prepared: tuple[DataLayout, Path]
) -> None:
    pipeline, layout = _pipeline(tmp_path, prepared)
    first = layout.draft_model_dir / "checkpoints" / "epoch_0001.pt"
    with cleanup(start(pipeline, _train_command(), "train")) as proc:
        wait_until(first.exists, proc, 400, "the first checkpoint")
        ranks = training_ranks(proc.pid, with_torchrun=True)
        assert len(ranks) >= 2, ranks  # the wrapper execs torchrun, which starts the ranks (+ the launcher itself)
        stopped = signal_and_wait(proc, signal.SIGTERM)
    output = log_text(pipeline, "train")
    assert_stopped(stopped, output, "SIGTERM")
    assert _lock_is_free(layout)
    assert not (layout.draft_model_dir / "final").exists()
    assert run(pipeline, _train_command(), "resume", timeout_s=600) == 0, log_text(pipeline, "resume")[-3000:]
    assert "draft_model: resuming after epoch" in log_text(pipeline, "resume")
    assert (layout.draft_model_dir / "final" / "config.json").exists()


def test_sigkill_of_the_step_takes_torchrun_down_and_frees_the_lock(
    tmp_path: Path, prepared: tuple[DataLayout, Path]
) -> None:
    pipeline, layout = _pipeline(tmp_path, prepared)
    with cleanup(start(pipeline, _train_command(), "train")) as proc:
        wait_until(lambda: not _lock_is_free(layout), proc, 400, "rank 0 to hold the draft_model lock")
        tree = descendants(proc.pid)
        assert len(training_ranks(proc.pid, with_torchrun=True)) >= 2
        os.kill(proc.pid, signal.SIGKILL)  # no handler, no finally: only the kernel can clean up
        proc.wait(10)
        deadline = time.monotonic() + STOP_WITHIN_S
        while alive(tree) and time.monotonic() < deadline:
            time.sleep(0.25)
        left = alive(tree)
        for pid in left:  # the test's own cleanup: a torchrun that survived would train on for minutes
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes outlived the SIGKILLed step: {left}"
    assert _lock_is_free(layout)
