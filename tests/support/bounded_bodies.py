"""The clients outside the generation transport against a body that never ends (issue 31, clause 5):
``tests/integration/test_safety_bounded_bodies_clients.py``.

Each client's real request path is one function here returning what came of it as plain data, with ``wall_s``
the seconds its requests took (the client's set-up left out): the online
evaluation's :func:`~eagle3_assets.evaluation.online_metrics.generate`,
the ``vllm`` hidden-states backend's ``extract``, the
capacity monitor's ``/metrics`` poll and the probes of :mod:`eagle3_assets.local.vllm_probe`. A test calls one in its
own process (a trickled body: the wall time is what counts), or in a child (``python -m support.bounded_bodies
CLIENT URL SETTINGS``, :func:`run_in_child`) whose peak resident memory (VmHWM) is its own, not pytest's, as
``tests/integration/test_safety_bounded_bodies.py`` measures generation's.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.common import REPO_ROOT, child_env, reaped

PROMPTS = 4  # evaluation prompts, all in flight at once
SAMPLE = [1, 2, 3]  # the token ids of the one sample extracted


def evaluation(url: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The online evaluation's requests (``generate``): how many failed, and why."""
    from eagle3_assets.evaluation.online_metrics import OnlineConfig, Prompt, generate

    prompts = [Prompt(f"p{i}", [{"role": "user", "content": f"question {i}"}]) for i in range(PROMPTS)]
    config = OnlineConfig(concurrency=PROMPTS, **settings)
    started = time.monotonic()
    run = generate(url, "fake-model", prompts, config)
    wall_s = time.monotonic() - started
    return {"wall_s": wall_s, "total": len(run.generations), "errors": [g.error for g in run.failures]}


def extraction(url: str, settings: dict[str, Any]) -> dict[str, Any]:
    """One sample through the ``vllm`` hidden-states backend: its error (None: extracted)."""
    from eagle3_assets.hidden_states.vllm_backend import VLLMBackend, VLLMBackendOptions
    from support.hidden_states_data import cached_tiny_verifier

    options = VLLMBackendOptions(urls=(url,), model="m", concurrency=1, **settings)
    backend = VLLMBackend(cached_tiny_verifier(), [1, 2, 3], "float32", options=options, log=lambda _m: None)
    started = time.monotonic()
    error: str | None = None
    try:
        backend.extract([SAMPLE])
    except Exception as failure:
        error = f"{type(failure).__name__}: {failure}"
    finally:
        wall_s = time.monotonic() - started
        backend.close()
    return {"wall_s": wall_s, "error": error}


def capacity(url: str, settings: dict[str, Any]) -> dict[str, Any]:
    """One ``/metrics`` poll of the capacity monitor: whether it read a load, and the cap it left."""
    from eagle3_assets.generation.capacity import CapacityMonitor
    from eagle3_assets.net.endpoints import EndpointPool
    from support.reliability import quick_config

    config = quick_config(url, **settings)
    pool = EndpointPool([url], cap=config.concurrency)
    logged: list[str] = []

    async def poll() -> dict[str, Any]:
        monitor = CapacityMonitor(config, pool.endpoints, lambda: None, logged.append)
        started = time.monotonic()
        try:
            await monitor.poll_once()
        finally:
            wall_s = time.monotonic() - started
            await monitor.close()
        server = monitor.servers[url]
        cap = pool.endpoints[0].cap
        return {"wall_s": wall_s, "managed": server.managed, "cap": cap, "target": server.target, "log": logged}

    return asyncio.run(poll())


def probe(url: str, settings: dict[str, Any]) -> dict[str, Any]:
    """``probe_models`` (what the extraction backend and ``eagle3 vllm`` ask first) and ``read_metrics``."""
    from eagle3_assets.local.vllm_probe import probe_models, read_metrics

    timeout_s = settings["timeout_s"]
    started = time.monotonic()
    models, status = probe_models(url, timeout_s, None)
    try:
        read_metrics(url, timeout_s)
        metrics_error = None
    except Exception as error:
        metrics_error = f"{type(error).__name__}: {error}"
    wall_s = time.monotonic() - started
    return {"wall_s": wall_s, "models": models, "status": status, "metrics_error": metrics_error}


CLIENTS: dict[str, Callable[[str, dict[str, Any]], dict[str, Any]]] = {
    "evaluation": evaluation,
    "extraction": extraction,
    "capacity": capacity,
    "probe": probe,
}


def memory_mb(field: str, pid: int | str = "self") -> float:
    """A ``/proc/PID/status`` memory field (VmRSS, VmHWM) in MB; 0 once the process is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # it just ended
        return 0.0
    found = re.search(rf"{field}:\s+(\d+)", status)
    return int(found[1]) / 1024 if found else 0.0


class GrewTooMuch(AssertionError):
    """The child's resident memory grew past the kill limit: it was killed."""


def run_in_child(
    client: str, url: str, settings: dict[str, Any], kill_growth_mb: float, limit_s: float = 90.0
) -> dict[str, Any]:
    """``client``'s request in a child process; its report: the outcome, ``baseline_mb`` (resident memory once
    everything is imported), ``peak_mb`` (VmHWM at the end) and ``wall_s``. The child is killed, and
    :class:`GrewTooMuch` raised, once it grows past ``kill_growth_mb`` (an unbounded body takes gigabytes)."""
    argv = [sys.executable, "-m", "support.bounded_bodies", client, url, json.dumps(settings)]
    return child_report_watching_memory(argv, f"the {client} process", kill_growth_mb, limit_s)


def child_report_watching_memory(argv: list[str], what: str, kill_growth_mb: float, limit_s: float) -> dict[str, Any]:
    """Run ``argv`` (a child that prints ``BASELINE <MB>`` once loaded, then its JSON report as its last line),
    killing it, and raising :class:`GrewTooMuch`, once its resident memory grows past ``kill_growth_mb``."""
    child = subprocess.Popen(
        argv, cwd=REPO_ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    with reaped(child):
        assert child.stdout is not None
        first = child.stdout.readline()
        assert first.startswith("BASELINE "), first + child.stdout.read()
        baseline = float(first.split()[1])
        ends = time.monotonic() + limit_s
        while child.poll() is None and time.monotonic() < ends:
            grown = memory_mb("VmRSS", child.pid) - baseline
            if grown > kill_growth_mb:
                child.kill()
                raise GrewTooMuch(f"{what} grew by {grown:.0f} MB (over {kill_growth_mb} MB): killed")
            time.sleep(0.01)
        output = child.stdout.read()
        assert child.wait(timeout=5) == 0, output
    return json.loads(output.strip().splitlines()[-1])


def _load_client(client: str) -> None:
    """What ``client`` imports and builds before its request, so that the growth measured is the request's alone."""
    import httpx2  # noqa: F401
    import openai  # noqa: F401

    import eagle3_assets.generation.transport

    if client == "evaluation":
        import eagle3_assets.evaluation.online_metrics
    elif client == "extraction":
        import torch  # noqa: F401

        from eagle3_assets.speculators_adapter import hidden_states_client
        from support.hidden_states_data import cached_tiny_verifier

        hidden_states_client()
        cached_tiny_verifier()
    elif client == "capacity":
        import eagle3_assets.generation.capacity
        import support.reliability  # noqa: F401
    else:
        import eagle3_assets.local.vllm_probe  # noqa: F401


def main() -> None:
    client, url, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    _load_client(client)
    baseline = memory_mb("VmRSS")
    print("BASELINE", baseline, flush=True)
    outcome = CLIENTS[client](url, settings)
    report = {"baseline_mb": baseline, "peak_mb": memory_mb("VmHWM"), **outcome}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
