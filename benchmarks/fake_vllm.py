"""A fake vLLM OpenAI-compatible server for tests and benchmarks.

Run it with ``python -m fake_vllm --port 8000`` (``--port 0`` picks a free port; the first
stdout line is ``READY <port>``), or start it from Python with :class:`FakeServerProcess` (a subprocess,
so its CPU time is not charged to the client being measured) or :func:`serve_in_thread`.

What it imitates:

- ``POST /v1/chat/completions``, streaming (SSE, ``stream_options.include_usage``) and not. The chain of
  thought is in ``message.reasoning`` / ``delta.reasoning`` (``--reasoning-field reasoning_content`` gives
  the legacy shape, ``none`` leaves it out).
- Response length is deterministic: a lognormal draw keyed by the prompt (see :func:`prompt_key`) and the
  seed, capped at the request's ``max_tokens`` (then ``finish_reason == "length"``). A prompt containing
  ``[[fake_tokens=N]]`` forces N tokens. Every sequence is produced at ``token_rate`` tokens/s after
  ``ttft_s``, so latency follows length like a real server that is not saturated.
- ``return_token_ids`` (vLLM >= 0.10.2): ``prompt_token_ids`` and ``choices[].token_ids`` (in streaming, the
  prompt ids in the first chunk and each chunk's new ids), one id per fixed-width word of the text.
- ``GET /v1/models``; a 400 with vLLM's message when the prompt exceeds ``max_model_len``; a 401 when an
  API key is configured and the request lacks it.
- Fault injection, drawn per request from (seed, prompt, how many times that prompt was seen before), so a
  run is reproducible and a retried request usually succeeds: HTTP 500, 429, connection reset part-way
  through the body, hang (never answers), truncated body / stream, invalid JSON, a 200 whose body is not a
  chat completion, empty ``choices``, and a 200 whose fields have the wrong type (``content`` a list,
  ``reasoning`` an object, usage counts as strings), and a 200 whose body never ends: ``trickle`` (a byte every
  ``trickle_interval_s``, under any idle timeout) or ``endless`` (well-formed content as fast as the client reads).
- A server that goes down mid-run: with ``outage_after`` > 0, every chat request after the first
  ``outage_after`` is answered ``outage_status`` (503 by default) while ``/v1/models`` still answers.
- A key revoked mid-run: with ``revoke_after`` > 0, every chat request after the first ``revoke_after``
  is answered ``revoke_status`` (401 or 403) as if the key had been withdrawn.
- Capacity like vLLM's ``--max-num-seqs``: with ``max_num_seqs`` > 0 at most that many requests generate at
  once and the rest wait in arrival order (their tokens start when they are scheduled); ``GET /metrics``
  exports ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` in vLLM's Prometheus text format
  (``--metrics false``: a server without ``/metrics``, answering 404).
- ``GET /stats`` (requests per prompt key, outcomes, in-flight, running and waiting peaks, the integral of
  running sequences over time, first request and last response) and ``POST /stats/reset``.

The HTTP layer is a small asyncio protocol instead of a framework: in the benchmark the server shares two
cores with the client under test, so every microsecond it spends per request or per SSE chunk skews the
client's numbers.

Layout: this module is the public API (it re-exports the names below) and the process/CLI entry point;
:mod:`fake_faults` holds the configuration and fault injection, :mod:`fake_responses` the
lengths and token text, :mod:`fake_http` the HTTP layer, :mod:`fake_capacity` the
``max_num_seqs`` scheduler.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from eagle3_assets.local.vllm_server import DEFAULT_PORT

# Re-exported: tests and benchmarks import these names from fake_vllm.
from fake_faults import FAULT_KINDS, LYING_FAULTS, NEVER_ENDING_FAULTS, FakeConfig, config_to_args, draw_fault
from fake_http import FakeVLLM
from fake_responses import (
    natural_length,
    prompt_key,
    prompt_token_ids,
    prompt_tokens,
    response_length,
    token_ids,
    token_text,
)

# ------------------------------------------------------------------------------------------ running


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is optional, asyncio's loop works, slower
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _parse_bool(text: str) -> bool:
    if text.lower() in {"1", "true", "yes"}:
        return True
    if text.lower() in {"0", "false", "no"}:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true/false)")


def parse_args(argv: Sequence[str] | None = None) -> tuple[FakeConfig, str, int]:
    parser = argparse.ArgumentParser(prog="python -m fake_vllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    defaults = FakeConfig()
    for f in fields(FakeConfig):
        if f.name == "faults":
            continue
        default = getattr(defaults, f.name)
        kind: Any = type(default) if default is not None else str
        if kind is bool:
            kind = _parse_bool
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=default)
    for kind in FAULT_KINDS:
        parser.add_argument(f"--{kind.replace('_', '-')}", type=float, default=0.0, help=f"rate of {kind} faults")
    ns = parser.parse_args(argv)
    values = {f.name: getattr(ns, f.name) for f in fields(FakeConfig) if f.name != "faults"}
    faults = {kind: getattr(ns, kind) for kind in FAULT_KINDS if getattr(ns, kind) > 0}
    return FakeConfig(**values, faults=faults), ns.host, ns.port


def main(argv: Sequence[str] | None = None) -> None:
    config, host, port = parse_args(argv)
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    app = FakeVLLM(config)
    server = loop.run_until_complete(app.serve(host, port))
    bound = server.sockets[0].getsockname()[1]
    print(f"READY {bound}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.run_until_complete(stop.wait())
    server.close()
    loop.close()


def _python_path() -> str:
    here = Path(__file__).resolve().parent  # benchmarks/, beside the repository's package
    inherited = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join([str(here.parent), str(here)] + ([inherited] if inherited else []))


class FakeServerProcess:
    """The fake server in a subprocess: ``with FakeServerProcess(config) as server: server.base_url``."""

    def __init__(self, config: FakeConfig | None = None, host: str = "127.0.0.1") -> None:
        self.config = config or FakeConfig()
        self.host = host
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> FakeServerProcess:
        cmd = [sys.executable, "-m", "fake_vllm", "--host", self.host, "--port", "0"]
        self.proc = subprocess.Popen(
            cmd + config_to_args(self.config),
            stdout=subprocess.PIPE,
            text=True,
            # benchmarks/ on the path, so the child finds this module as ``fake_vllm``
            env={**os.environ, "PYTHONPATH": _python_path(), "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.stop()
            raise RuntimeError(f"fake vLLM server did not start: {line!r}")
        self.port = int(line.split()[1])
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def cpu_seconds(self) -> float:
        """User + system CPU time the server process has used so far (Linux /proc)."""
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/stat") as handle:
            parts = handle.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")

    def stats(self) -> dict[str, Any]:
        return get_json(f"{self.root_url}/stats")

    def reset_stats(self) -> None:
        post_json(f"{self.root_url}/stats/reset")

    def __enter__(self) -> FakeServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serve_in_thread(config: FakeConfig | None = None, host: str = "127.0.0.1") -> Iterator[str]:
    """The fake server on a background thread's event loop; yields its base URL (``http://h:p/v1``)."""
    app = FakeVLLM(config or FakeConfig())
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        holder["server"] = loop.run_until_complete(app.serve(host, 0))
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True, name="fake-vllm")
    thread.start()
    ready.wait(10)
    port = holder["server"].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{port}/v1"
    finally:
        loop.call_soon_threadsafe(holder["server"].close)
        for task in asyncio.all_tasks(loop):
            loop.call_soon_threadsafe(task.cancel)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def get_json(url: str) -> Any:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def post_json(url: str, payload: Any = None) -> Any:
    import urllib.request

    request = urllib.request.Request(
        url, data=json.dumps(payload or {}).encode(), method="POST", headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


__all__ = [
    "FAULT_KINDS",
    "LYING_FAULTS",
    "NEVER_ENDING_FAULTS",
    "FakeConfig",
    "FakeServerProcess",
    "FakeVLLM",
    "asdict",
    "config_to_args",
    "draw_fault",
    "get_json",
    "main",
    "natural_length",
    "parse_args",
    "post_json",
    "prompt_key",
    "prompt_token_ids",
    "prompt_tokens",
    "response_length",
    "serve_in_thread",
    "token_ids",
    "token_text",
]

if __name__ == "__main__":
    main()
