"""Helpers for the signal tests (``tests/integration/test_signals_*.py``): the real ``dagster`` CLI in a subprocess
with its own DAGSTER_HOME and data dir, a signal sent to it, and the process tree it leaves. No tests here."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import default_signals
from eagle3_assets.local.process_group import alive, descendants  # the package's own tree walk, the one a stop clears
from support.common import child_env, journal_lines, send_json, stub_http_server  # noqa: F401 (journal_lines: tests import it from here)
from support.operations import make_dagster_home, pipeline_env, write_prompts

# The bound: a run stops within 30 s of the signal (the code aims at a few seconds).
STOP_WITHIN_S = 30.0
MODULE = "eagle3_assets.definitions"


@dataclass(frozen=True)
class Pipeline:
    """A DAGSTER_HOME, a data dir and a prompt file for one test, and the environment the CLI runs in."""

    root: Path
    home: Path
    data_dir: Path
    env: dict[str, str]

    def log_path(self, name: str) -> Path:
        return self.root / f"{name}.log"


def make_pipeline(root: Path, prompts: int, partition_size: int, base_url: str, **extra: str) -> Pipeline:
    home = make_dagster_home(root)
    data_dir = root / "data"
    env = {**pipeline_env(data_dir, write_prompts(root, prompts), partition_size, base_url, home), **extra}
    return Pipeline(root, home, data_dir, child_env(**env))


def dagster_command(*args: str) -> list[str]:
    """``dagster ARGS`` from this venv (the console script next to the interpreter)."""
    return [str(Path(sys.executable).with_name("dagster")), *args]


def materialize_command(select: str, partition: str | None = None) -> list[str]:
    args = ["asset", "materialize", "-m", MODULE, "--select", select]
    return dagster_command(*args, *(["--partition", partition] if partition else []))


def start(pipeline: Pipeline, command: list[str], name: str) -> subprocess.Popen[bytes]:
    """``command`` in its own session (so the test can find everything it started), output to ``name``.log."""
    with open(pipeline.log_path(name), "ab") as log:
        return subprocess.Popen(
            command,
            env=pipeline.env,
            cwd=pipeline.root,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=default_signals,
        )


def run(pipeline: Pipeline, command: list[str], name: str, timeout_s: float = 300.0) -> int:
    """Run ``command`` to its end; returns its exit code."""
    proc = start(pipeline, command, name)
    try:
        return proc.wait(timeout_s)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait(10)


def log_text(pipeline: Pipeline, name: str) -> str:
    return pipeline.log_path(name).read_text(errors="replace")


def training_ranks(pid: int, with_torchrun: bool = False) -> set[int]:
    """The live processes below ``pid`` that run ``eagle3_assets.training.launch``: the ranks, and torchrun itself
    (its command line names the module too) ``with_torchrun``."""
    found = set()
    for child in descendants(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"eagle3_assets.training.launch" in cmdline and (with_torchrun or b"torch.distributed.run" not in cmdline):
            found.add(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and everything below it (test cleanup only)."""
    for target in [*descendants(pid), pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)


@contextmanager
def cleanup(proc: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    """Whatever the test asserts, nothing it started outlives it."""
    seen: set[int] = set()
    try:
        yield proc
    finally:
        seen |= descendants(proc.pid)
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait(10)
        for pid in alive(seen):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def wait_until(condition: Callable[[], bool], proc: subprocess.Popen[bytes], timeout_s: float, what: str) -> None:
    """Poll ``condition`` until true; fail at once if ``proc`` ended first."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the process ended (code {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.1)


@dataclass(frozen=True)
class Stopped:
    code: int | None  # None: still running after the bound (the test fails on it)
    seconds: float
    left_behind: set[int]  # descendants seen before the signal that still ran after the process ended


def signal_and_wait(proc: subprocess.Popen[bytes], sig: int, within_s: float = STOP_WITHIN_S) -> Stopped:
    """Send ``sig`` to the process (only it: like `kill`, `timeout` or systemd) and wait up to ``within_s``."""
    tree = descendants(proc.pid)
    started = time.monotonic()
    proc.send_signal(sig)
    try:
        code: int | None = proc.wait(within_s)
    except subprocess.TimeoutExpired:
        code = None
    seconds = time.monotonic() - started
    print(f"{signal.Signals(sig).name}: exited with {code} after {seconds:.1f} s")  # shown with pytest -s
    time.sleep(0.5)  # a child ended by the process's own cleanup may take a moment to be reaped
    return Stopped(code, seconds, alive(tree | descendants(proc.pid)))


def assert_stopped(stopped: Stopped, output: str, what: str) -> None:
    """The run ended, non-zero, within STOP_WITHIN_S of ``what`` (a signal) and left no process behind."""
    assert stopped.code is not None, f"still running {STOP_WITHIN_S:.0f} s after {what}:\n{output[-3000:]}"
    assert stopped.code != 0 and stopped.seconds < STOP_WITHIN_S, output[-3000:]
    assert not stopped.left_behind, f"processes left running: {stopped.left_behind}"


def stop_mid_run(
    pipeline: Pipeline, command: list[str], name: str, ready: Callable[[], bool], what: str, sig: int, timeout_s: float
) -> str:
    """Start ``command``, wait until ``ready()`` (``what``, at most ``timeout_s``), send ``sig``; assert the run
    stopped as a signalled run must (``assert_stopped``); returns its output."""
    with cleanup(start(pipeline, command, name)) as proc:
        wait_until(ready, proc, timeout_s, what)
        stopped = signal_and_wait(proc, sig)
    output = log_text(pipeline, name)
    assert_stopped(stopped, output, signal.Signals(sig).name)
    return output


@dataclass
class HangingServer:
    """What ``hanging_server`` yields: its base URL and the requests it received."""

    base_url: str = ""
    posts: int = 0


@contextmanager
def hanging_server(model: str) -> Iterator[HangingServer]:
    """An OpenAI-compatible server that lists one model and never answers a POST (a stuck extraction server):
    ``with hanging_server("name") as server: server.base_url``; ``server.posts`` counts the requests received."""
    import threading
    from http.server import BaseHTTPRequestHandler

    state = HangingServer()
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            send_json(self, {"object": "list", "data": [{"id": model, "object": "model"}]})

        def do_POST(self) -> None:
            state.posts += 1
            release.wait(600)

    with stub_http_server(Handler) as base_url:
        state.base_url = base_url
        try:
            yield state
        finally:
            release.set()  # the stuck requests end before the server shuts down


@contextmanager
def slow_generation(root: Path, prompts: int, dagster_yaml: str | None = None) -> Iterator[tuple[Pipeline, Any]]:
    """A fake server at ~7 s a response (~100 tokens at 15 tok/s; 4 in flight: ~30 s for 16 prompts) and a pipeline
    of one ``prompts``-sized partition over it (its DAGSTER_HOME's ``dagster.yaml`` replaced by ``dagster_yaml`` if
    given), raw_prompts materialized: a generating run there is still running when the test stops it."""
    from fake_vllm import FakeConfig, FakeServerProcess

    with FakeServerProcess(FakeConfig(token_rate=15, median_tokens=100, sigma=0.3)) as server:
        env = {"EAGLE3_CONCURRENCY": "4", "EAGLE3_MAX_TOKENS": "400"}
        pipeline = make_pipeline(root, prompts, prompts, server.base_url, **env)
        if dagster_yaml is not None:
            (pipeline.home / "dagster.yaml").write_text(dagster_yaml)
        assert run(pipeline, materialize_command("raw_prompts"), "raw_prompts") == 0, log_text(pipeline, "raw_prompts")
        yield pipeline, server


def assert_kept_unpublished(pipeline: Pipeline, key: str, prompts: int) -> int:
    """After a stopped generating run: the rows finished before the stop stay journaled (at least 2, not all), no
    partition file, nothing marked materialized. Returns the rows kept."""
    import dagster as dg

    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.generation.journal import read_journal

    layout = DataLayout.at(pipeline.data_dir)
    kept = len(read_journal(layout.responses_in_progress_path(key)).records)
    assert 2 <= kept < prompts
    assert not layout.responses_path(key).exists()
    with dg.DagsterInstance.from_config(str(pipeline.home)) as instance:
        assert instance.get_latest_materialization_event(dg.AssetKey("synthetic_responses")) is None
    return kept


def resume_requests_only_the_rest(pipeline: Pipeline, server: Any, key: str, prompts: int, kept: int) -> str:
    """Re-materializing ``synthetic_responses`` partition ``key`` after a stopped run asks ``server`` only for the
    ``prompts - kept`` samples not journaled and completes the partition; returns the resume's log."""
    import polars as pl

    from eagle3_assets.core.storage import DataLayout

    server.reset_stats()
    assert run(pipeline, materialize_command("synthetic_responses", key), "resume") == 0, log_text(pipeline, "resume")
    assert server.stats()["total_requests"] == prompts - kept  # the resume asked only for what was not journaled
    frame = pl.read_parquet(DataLayout.at(pipeline.data_dir).responses_path(key))
    assert frame.height == prompts and set(frame["status"]) == {"ok"}
    return log_text(pipeline, "resume")
