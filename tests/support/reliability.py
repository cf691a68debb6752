"""Helpers shared by the reliability tests (issue 8). No tests here; the ``test_reliability_*`` files use them."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from eagle3_assets.generation import GenerationConfig, PromptToGenerate
from fake_vllm import FakeConfig, FakeServerProcess, config_to_args, prompt_key
from support.common import child_env, journal_lines, reaped  # noqa: F401 (journal_lines: tests import it from here)


def make_prompts(n: int, tag: str = "r") -> list[PromptToGenerate]:
    return [
        PromptToGenerate(f"{tag}-{i:05d}", [{"role": "user", "content": f"{tag} reliability question {i}"}])
        for i in range(n)
    ]


def key_of(prompt: PromptToGenerate) -> str:
    """The fake server's key for a prompt (its per-prompt request counters are keyed by it)."""
    return prompt_key([dict(m) for m in prompt.messages])


def fast_config(*urls: str, **settings: object) -> GenerationConfig:
    """A config for ``urls`` that retries, syncs its journal and reports quickly (the fault tests' short backoff and
    intervals), with ``settings`` over those."""
    fast: dict[str, object] = dict(
        backoff_base_s=0.05, backoff_max_s=0.5, fsync_interval_s=0.2, progress_interval_s=1.0
    )
    return GenerationConfig(base_urls=list(urls), **{**fast, **settings})  # type: ignore[arg-type]


def quick_config(*urls: str, **overrides: object) -> GenerationConfig:
    """Short timeouts and backoff so fault tests finish in seconds."""
    values: dict[str, object] = dict(
        concurrency=16,
        max_tokens=2000,
        request_timeout_s=5.0,
        connect_timeout_s=2.0,
        idle_timeout_s=2.0,
        bench_after_failures=1000,
    )
    return fast_config(*urls, **{**values, **overrides})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def closed_port_url() -> str:
    """A base URL on which nothing listens: connection refused at once."""
    return f"http://127.0.0.1:{free_port()}/v1"


class RestartableServer(FakeServerProcess):
    """The fake vLLM server as a subprocess on a FIXED port, so it can crash and come back at the same URL."""

    def __init__(self, config: FakeConfig, port: int | None = None) -> None:
        super().__init__(config)
        self.port = port or free_port()

    def start(self) -> RestartableServer:
        cmd = [sys.executable, "-m", "fake_vllm", "--host", "127.0.0.1", "--port", str(self.port)]
        deadline = time.monotonic() + 15
        while True:  # the port can stay busy for a moment after a crash
            self.proc = subprocess.Popen(
                cmd + config_to_args(self.config),
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=child_env(),
            )
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()
            if line.startswith("READY "):
                return self
            self.proc.wait()
            self.proc.stdout.close()
            if time.monotonic() > deadline:
                raise RuntimeError(f"fake server did not start on port {self.port}: {line!r}")
            time.sleep(0.2)

    def crash(self) -> None:
        """SIGKILL: every open connection is reset, like a crashed vLLM."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()


@contextmanager
def restartable_server(config: FakeConfig) -> Iterator[RestartableServer]:
    server = RestartableServer(config).start()
    try:
        yield server
    finally:
        server.crash()


def wait_for(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def sigkill_child_when(script: Path, args: list[str], reached: Any, timeout_s: float, delay_s: float = 0.0) -> None:
    """Run ``script`` (which prints START when it begins work), SIGKILL it once ``reached()`` is true, and assert
    that the kill is what ended it (a script that should outlive its work sleeps after it).

    ``delay_s`` shifts the kill a little past the threshold, so kills land at varied points of the write path.
    """
    child = subprocess.Popen(
        [sys.executable, str(script), *args],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=script.parent,
    )
    with reaped(child):
        assert child.stdout is not None and child.stdout.readline().strip() == "START"
        deadline = time.monotonic() + timeout_s
        while not reached() and child.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        time.sleep(delay_s)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        # A child that ended before the kill (finished, crashed) tests no kill point at all.
        output = child.stdout.read()[-2000:]
        assert child.returncode == -signal.SIGKILL, (
            f"{script.name} exited with {child.returncode}, not by SIGKILL: {output}"
        )


def block_before_rename(argv_index: int) -> str:
    """Child-script prologue: when ``sys.argv[argv_index:argv_index + 2]`` is given as (name prefix, marker path),
    the child touches the marker and stops for good just before renaming a temporary file whose name starts with the
    prefix into place, so the parent can SIGKILL it with the temporary written but not renamed."""
    return textwrap.dedent(
        f"""
        import os, sys, time
        if len(sys.argv) > {argv_index}:
            block, marker = sys.argv[{argv_index}:{argv_index + 2}]
            real_replace = os.replace

            def replace(src, dst, *args, **kwargs):
                if os.path.basename(src).startswith(block):
                    open(marker, "w").close()
                    time.sleep(3600)
                return real_replace(src, dst, *args, **kwargs)

            os.replace = replace
        """
    )


def block_inside_parquet_write(argv_index: int) -> str:
    """Child-script prologue: when ``sys.argv[argv_index]`` is ``--block-parquet``, the child stops for good in the
    middle of writing a Parquet temporary file (half of its bytes on disk) and touches the marker path
    ``sys.argv[argv_index + 1]``, so the parent can SIGKILL it inside the write."""
    return textwrap.dedent(
        f"""
        import os, sys, time
        if len(sys.argv) > {argv_index + 1} and sys.argv[{argv_index}] == "--block-parquet":
            import polars as _pl
            _marker = sys.argv[{argv_index + 1}]
            _real_write_parquet = _pl.DataFrame.write_parquet

            def _write_parquet(self, file, *args, **kwargs):
                _real_write_parquet(self, file, *args, **kwargs)
                if ".parquet.tmp-" in os.path.basename(str(file)):
                    os.truncate(file, os.path.getsize(file) // 2)
                    open(_marker, "w").close()
                    time.sleep(3600)

            _pl.DataFrame.write_parquet = _write_parquet
        """
    )
