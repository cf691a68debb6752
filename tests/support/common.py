"""Helpers every test tier uses: paths, small file writers, resources, and the environment of child processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from eagle3_assets.core.storage import DataLayout

TESTS_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = TESTS_DIR.parent


def python_path() -> str:
    """PYTHONPATH for a child interpreter: the repository (``eagle3_assets``), ``tests/`` (``support``) and
    ``benchmarks/`` (the fake vLLM server, ``fake_vllm``)."""
    parts = [str(REPO_ROOT), str(TESTS_DIR), str(REPO_ROOT / "benchmarks")]
    inherited = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(parts + ([inherited] if inherited else []))


def child_env(**extra: str) -> dict[str, str]:
    """The current environment plus what a child Python process needs to import the project and ``support``."""
    return {**os.environ, "PYTHONPATH": python_path(), "PYTHONUNBUFFERED": "1", **extra}


def write_jsonl(path: Path, rows: Iterable[object]) -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(row if isinstance(row, str) else json.dumps(row))
            handle.write("\n")
    return path


def journal_lines(path: Path) -> int:
    """Complete lines of a journal (0 before it exists)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def fake_server_pipeline_env(dagster_home: Path, layout: DataLayout, prompts_path: Path, base_url: str) -> dict:
    """The EAGLE3_* environment of a whole-graph run the way `eagle3 demo` loads it: partitions of 4 prompts answered by
    the fake vLLM server at ``base_url``, hidden states and training on the tiny verifier."""
    from support.hidden_states_data import cached_tiny_verifier

    return {
        "DAGSTER_HOME": str(dagster_home),
        "EAGLE3_DATA_DIR": str(layout.root),
        "EAGLE3_PROMPTS_PATH": str(prompts_path),
        "EAGLE3_PARTITION_SIZE": "4",
        "EAGLE3_VLLM_BASE_URL": base_url,
        "EAGLE3_CONCURRENCY": "4",
        "EAGLE3_VERIFIER_PATH": str(cached_tiny_verifier()),
        "EAGLE3_LAYER_IDS": "1,2,3",
        # the fake server's token ids come from a 4,096-word vocabulary, the tiny verifier's has 1,024 tokens
        "EAGLE3_RETURN_TOKEN_IDS": "false",
    }


def make_resources(layout: DataLayout, prompts_path: Path, partition_size: int = 1000, **extra: object) -> dict:
    from eagle3_assets.defs.resources import DataStoreResource, PromptDatasetResource

    return {
        "data_store": DataStoreResource(data_dir=str(layout.root)),
        "prompt_dataset": PromptDatasetResource(path=str(prompts_path), partition_size=partition_size),
        **extra,
    }


def materialize_responses(key: str, instance: Any, resources: dict, **options: Any) -> Any:
    """``synthetic_responses`` of partition ``key`` (with ``raw_prompts`` as its upstream) through ``dg.materialize``;
    ``options`` are dg.materialize's (``raise_on_error``, ``run_config``)."""
    import dagster as dg

    from eagle3_assets.defs.prompts import raw_prompts
    from eagle3_assets.defs.responses import synthetic_responses

    return dg.materialize(
        [raw_prompts, synthetic_responses],
        selection=[synthetic_responses],
        partition_key=key,
        instance=instance,
        resources=resources,
        **options,
    )


def error_chain(error: BaseException) -> str:
    """All messages of an exception and its causes (Dagster wraps user errors)."""
    parts, seen = [], set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:  # contexts can form a cycle
        seen.add(id(current))
        parts.append(str(current))
        current = current.__cause__ or current.__context__
    return "\n".join(parts)


@contextlib.contextmanager
def reaped(child: subprocess.Popen[Any]) -> Iterator[subprocess.Popen[Any]]:
    """``child``, killed and waited for (its stdout closed) however the block ends: no process outlives a test."""
    try:
        yield child
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()


def sigkill_when(
    child: subprocess.Popen[Any], reached: Callable[[], bool], timeout_s: float, interval_s: float
) -> None:
    """SIGKILL ``child`` as soon as ``reached()``; fails with its output if it ends first or never gets there."""
    deadline = time.monotonic() + timeout_s
    while not reached():
        assert child.poll() is None, child.communicate()[0]
        assert time.monotonic() < deadline, "the child never got going"
        time.sleep(interval_s)
    child.send_signal(signal.SIGKILL)
    child.wait(10)


def send_body(handler: BaseHTTPRequestHandler, body: bytes, content_type: str | None = None) -> None:
    """A 200 with ``body`` from a ``http.server`` handler (the stub servers of the tests)."""
    handler.send_response(200)
    if content_type is not None:
        handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def send_json(handler: BaseHTTPRequestHandler, payload: Any) -> None:
    send_body(handler, json.dumps(payload).encode(), "application/json")


@contextmanager
def stub_http_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """``handler`` served from a thread on a free local port; yields its OpenAI-style base URL (``.../v1``)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
