"""Training in N processes: the torchrun command, the worker each rank runs, and a launcher without Dagster.

``draft_model`` with ``EAGLE3_TRAIN_PROCS=N > 1`` runs :func:`torchrun_command` under Dagster Pipes
(``dg.PipesSubprocessClient``): torchrun starts N workers (``python -m eagle3_assets.training.launch SPEC``), each
joins the process group (gloo on CPU, NCCL on GPUs) and calls :func:`~eagle3_assets.training.loop.train_draft`.
Rank 0 opens the Pipes channel, so its log lines and each epoch's metrics stream into the Dagster run as they
happen, and writes the :class:`~eagle3_assets.training.train_config.TrainResult` as JSON for the asset's metadata.

Failure and cleanup: torchrun runs with ``--max-restarts 0``; when one rank dies (killed, out of memory, an
exception) it stops the others and exits non-zero, and the launcher raises :class:`TrainingFailed` naming the
newest checkpoint the next run resumes from. Each worker asks the kernel to kill it if torchrun itself dies
(``PR_SET_PDEATHSIG``), so even a SIGKILLed launcher leaves no rank behind; torchrun itself is started behind
:func:`~eagle3_assets.core.process_guard.with_parent_death_signal`, so a SIGKILLed Dagster step takes torchrun down
too. The rendezvous and gloo listen on 127.0.0.1 only.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3_assets.core.process_guard import with_parent_death_signal
from eagle3_assets.core.settings import REPO_ROOT
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.net.ports import find_free_port
from eagle3_assets.training.checkpoints import CHECKPOINT_DIR, list_checkpoints
from eagle3_assets.training.loop import train_draft
from eagle3_assets.training.train_config import TrainConfig, TrainResult

RESULT_FILE = "result.json"


class TrainingFailed(RuntimeError):
    """A training rank failed; the message says which exit code and where the next run resumes."""


@dataclass(frozen=True)
class TrainSpec:
    """What every rank needs, written to a JSON file that torchrun passes to each worker."""

    data_dir: str
    train_keys: list[str]
    val_key: str
    verifier_path: str
    config: dict[str, Any]
    result_path: str

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(asdict(self), sort_keys=True), encoding="utf-8")
        return path

    @classmethod
    def read(cls, path: Path) -> TrainSpec:
        return cls(**json.loads(Path(path).read_text(encoding="utf-8")))


def torchrun_command(spec_path: Path, procs: int, port: int) -> list[str]:
    """``torchrun`` (as ``python -m torch.distributed.run``, so it is this interpreter's) for ``procs`` local ranks,
    behind the parent-death wrapper: torchrun gets SIGTERM (and stops its ranks) when the process that starts it
    dies, SIGKILL included, so a killed step leaves no training running and no ``draft_model`` lock held."""
    return with_parent_death_signal([
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", str(procs), "--max-restarts", "0",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "-m", "eagle3_assets.training.launch", str(spec_path),
    ])  # fmt: skip


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The workers' environment: this package importable, gloo on the loopback interface, one OpenMP thread pool
    per rank sized by the training config (not torchrun's default of 1 thread with a warning)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["MASTER_ADDR"] = "127.0.0.1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def failure_message(code: int, ckpt_dir: Path, procs: int) -> str:
    """Why the run failed and what the next one does, from torchrun's exit code and the checkpoints on disk."""
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    done = list_checkpoints(ckpt_dir)
    resume = (
        f"the next run resumes after {done[-1].name}" if done else "no checkpoint was written: the next run starts over"
    )
    return (
        f"draft_model training with {procs} processes failed (torchrun {how}: a rank died or raised; its "
        f"traceback is in the run's stderr log); every rank was stopped; {resume}"
    )


def run_training_processes(
    spec: TrainSpec, procs: int, work_dir: Path, env: dict[str, str] | None = None
) -> TrainResult:
    """Run the torchrun job to completion without Dagster (tests, scripts); raise :class:`TrainingFailed` on failure."""
    spec_path = spec.write(work_dir / "train_spec.json")
    process = subprocess.Popen(torchrun_command(spec_path, procs, find_free_port()), env=worker_env(env))
    try:
        code = process.wait()
    except BaseException:
        process.terminate()  # torchrun forwards SIGTERM to the ranks and waits for them
        process.wait()
        raise
    if code != 0:
        raise TrainingFailed(failure_message(code, Path(spec.data_dir) / "draft_model" / CHECKPOINT_DIR, procs))
    return TrainResult.from_json(json.loads(Path(spec.result_path).read_text(encoding="utf-8")))


def _die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this worker when torchrun (its parent) dies, however it dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the call: nobody would kill us later
            os._exit(1)


def _open_pipes(rank: int) -> Any:
    """Rank 0's Dagster Pipes channel when launched by Dagster (None otherwise, and on the other ranks)."""
    if rank != 0 or "DAGSTER_PIPES_CONTEXT" not in os.environ:
        return None
    # lazy: loads dagster_pipes (heavy), which only this path needs
    from dagster_pipes import open_dagster_pipes

    return open_dagster_pipes()


def worker_main(spec_path: Path) -> int:
    """One torchrun rank: join the group, train, and (rank 0) report to Pipes and write the result."""
    _die_with_parent()  # first: the imports below take seconds, a window in which torchrun could die unnoticed
    # lazy: loads torch (heavy), which only this path needs
    import torch
    import torch.distributed as dist

    spec = TrainSpec.read(spec_path)
    config = TrainConfig(**spec.config)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    on_gpu = torch.cuda.is_available() and config.device != "cpu"
    # NCCL needs a GPU of its own per rank; ranks sharing a GPU (or on the CPU) talk through gloo
    dist.init_process_group("nccl" if on_gpu and torch.cuda.device_count() >= world else "gloo")
    rank = dist.get_rank()
    pipes = _open_pipes(rank)
    try:
        say = pipes.log.info if pipes is not None else (lambda message: print(message, flush=True))

        def on_epoch(metrics: dict[str, Any]) -> None:
            if pipes is not None:
                pipes.report_custom_message({"epoch_metrics": metrics})

        result = train_draft(
            DataLayout.at(spec.data_dir), spec.train_keys, spec.val_key, spec.verifier_path, config, say, on_epoch
        )
        if rank == 0:
            Path(spec.result_path).write_text(json.dumps(result.to_json()), encoding="utf-8")
    finally:
        if pipes is not None:
            pipes.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(Path(sys.argv[1])))
