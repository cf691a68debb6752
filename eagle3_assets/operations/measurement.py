"""One run's measurement file: what a figure in the docs must be traceable to.

``eagle3 demo --measurements DIR`` (``make demo``, ``make demo-real``, ``make recipe``) writes
``DIR/{run}_{commit}.json`` and rewrites it after every stage, so a stopped run leaves what it measured (``complete``
false) and a resumed one adds to the same file: the commit and whether the tree had uncommitted changes, the machine
(CPU, cores, memory, GPUs), the settings the run was given, every stage's seconds and partitions, the server's
fullness while generating, the rows per partition, the training history's summary and the evaluation report. One
file per run and commit, never two runs stitched into one: a figure in the docs names the file it comes from.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.core import storage
from eagle3_assets.core.settings import REPO_ROOT
from eagle3_assets.core.storage import write_json_atomic
from eagle3_assets.evaluation.evaluation_report import REPORT_JSON
from eagle3_assets.training.checkpoints import HISTORY_FILE


def commit_of(repo: Path = REPO_ROOT) -> tuple[str, bool]:
    """(short commit, whether tracked files differ from it); ("unknown", False) outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False
    return head, bool(status.strip())


def machine() -> dict[str, Any]:
    """The machine a figure was measured on: CPU model, cores the process may use, memory, GPUs."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = None
    with contextlib.suppress(ValueError, OSError):
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    gpus: list[str] = []
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        gpus = [line.strip() for line in listing.stdout.splitlines() if line.startswith("GPU")]
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "host": platform.node(),
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": memory_gib,
        "gpus": gpus,
        "python": platform.python_version(),
    }


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@dataclass
class MeasurementFile:
    """The measurement file of one run, rewritten atomically after each :meth:`stage`."""

    directory: Path
    run: str  # demo, demo-real, recipe
    settings: dict[str, Any] = field(default_factory=dict)
    commit: str = ""
    dirty: bool = False
    record: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.commit:
            self.commit, self.dirty = commit_of()
        previous = _read_json(self.path) or {}
        now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        self.record = {
            "run": self.run,
            "commit": self.commit,
            "uncommitted_changes": self.dirty,
            "machine": machine(),
            "settings": self.settings,
            "started": previous.get("started", now),
            "attempts": [*previous.get("attempts", []), now],  # every start of this run: a resumed run adds one
            # in the order they ran, each with its attempt: a stage a resumed run re-runs (often in seconds, its work
            # already published) adds an entry beside the earlier attempt's, whose seconds are the work's
            "stages": previous.get("stages", []),
            "complete": False,
        }

    @property
    def path(self) -> Path:
        return self.directory / f"{self.run}_{self.commit}.json"

    def stage(self, name: str, partitions: str, seconds: float, **figures: Any) -> None:
        attempt = len(self.record["attempts"])
        stages = [s for s in self.record["stages"] if (s["stage"], s.get("attempt", 1)) != (name, attempt)]
        self.record["stages"] = [
            *stages,
            {"stage": name, "partitions": partitions, "seconds": round(seconds, 1), "attempt": attempt, **figures},
        ]
        self._write()

    def finish(self, data_dir: Path, evaluation_json: Path, history_json: Path, counts: Any = None) -> Path:
        """Add the run's results (rows per partition, training summary, evaluation report) and mark it complete."""
        history = _read_json(history_json) or {}
        self.record["training"] = {
            key: history.get(key)
            for key in ("train_samples", "steps", "tokens_trained", "epochs", "val_loss", "val_loss_untrained")
            if key in history
        } | {"config": history.get("config")}
        self.record["evaluation"] = _read_json(evaluation_json)
        self.record["counts"] = counts
        self.record["data_dir"] = str(data_dir)
        self.record["ended"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        self.record["seconds_total"] = round(sum(s["seconds"] for s in self.record["stages"]), 1)
        self.record["complete"] = True
        self._write()
        return self.path

    def finish_run(self, data_dir: Path) -> Path:
        """:meth:`finish` with what an ``eagle3 demo`` run left in ``data_dir``."""
        layout = storage.DataLayout.at(data_dir)
        try:
            counts = {"rows": storage.partition_row_counts(layout), "responses": storage.response_status_counts(layout)}
        except Exception as error:  # a convenience here; `eagle3 counts` names what is unreadable
            counts = {"error": str(error).splitlines()[0]}
        return self.finish(data_dir, layout.evaluation_dir / REPORT_JSON, layout.draft_model_dir / HISTORY_FILE, counts)

    def _write(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        write_json_atomic(json.loads(json.dumps(self.record, default=str)), self.path)
