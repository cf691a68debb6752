"""What the benchmarks share: this checkout's package first on ``sys.path`` (they run as scripts: what is measured
is the code beside them, not whatever is installed), the tiny verifier's shape options, and a Dagster CLI in its
own process group (the tests start theirs with it too).

A benchmark imports it before the project: ``import _common`` (its own folder is on ``sys.path``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def tiny_model_parser(
    doc: str, samples: int, hidden_size: int = 256, vocab_size: int = 4096, layers: int = 4
) -> argparse.ArgumentParser:
    """The benchmark's parser (``doc``'s first line describes it) with the tiny verifier's shape and the number
    of fabricated responses per partition."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--samples", type=int, default=samples, help="fabricated responses per partition")
    parser.add_argument("--hidden-size", type=int, default=hidden_size)
    parser.add_argument("--vocab-size", type=int, default=vocab_size)
    parser.add_argument("--layers", type=int, default=layers, help="verifier layers")
    return parser


def tiny_model(args: argparse.Namespace) -> Path:
    """The tiny verifier of the parsed shape, built once per machine (``cached_tiny_model``)."""
    from eagle3_assets.local.tiny_model import cached_tiny_model

    return cached_tiny_model(num_layers=args.layers, hidden_size=args.hidden_size, vocab_size=args.vocab_size)


def default_signals() -> None:
    # A process started from a backgrounded shell inherits SIGINT ignored, and Dagster's CLIs then never
    # stop on SIGINT: give them the default handlers back.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def dagster_process(
    args: list[str], env: dict[str, str], cwd: Path, log_path: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """A Dagster CLI (``dagster-daemon``, ``dagster-webserver``) from this venv as a subprocess in its own
    process group (its code server goes with it), stopped with SIGINT (``stop_process_group``: SIGTERM after
    30 s, then SIGKILL)."""
    exe = Path(sys.executable).with_name(args[0])
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(exe), *args[1:]],
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=default_signals,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            from eagle3_assets.local.process_group import stop_process_group

            stop_process_group(proc.pid, grace_s=30.0, process=proc)


class GpuMemory:
    """Peak used GPU memory (MiB, every GPU and process) from nvidia-smi every 0.2 s; None without nvidia-smi."""

    def __init__(self) -> None:
        self.peak: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.available = shutil.which("nvidia-smi") is not None

    def _run(self) -> None:
        while not self._stop.is_set():
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            used = sum(int(x) for x in out.stdout.split() if x.strip().isdigit())
            self.peak = max(self.peak or 0.0, float(used))
            self._stop.wait(0.2)

    def __enter__(self) -> GpuMemory:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.available:
            self._thread.join()
