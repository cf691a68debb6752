"""Issue 22: the online evaluation's request batch (``evaluation.online.generate``, what ``draft_evaluation`` runs
against each server) stops within seconds on SIGINT, which is what SIGTERM and Dagster's run termination become
inside a Dagster step, instead of waiting for every request in flight and every one queued."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from fake_vllm import FakeConfig, FakeServerProcess
from support.common import child_env
from support.signals import STOP_WITHIN_S, alive, descendants

CHILD = textwrap.dedent(
    """
    import sys
    from eagle3_assets.evaluation.online_metrics import OnlineConfig, Prompt, generate

    prompts = [Prompt(f"e{i}", [{"role": "user", "content": f"evaluation prompt {i}"}]) for i in range(16)]
    print("STARTED", flush=True)
    generate(sys.argv[1], "fake-model", prompts, OnlineConfig(concurrency=4, max_tokens=400))
    print("FINISHED", flush=True)
    """
)


def test_an_online_evaluation_batch_stops_on_sigint(tmp_path: Path) -> None:
    # ~100 tokens at 5 tok/s: 20 s a request, 4 at a time: the batch would take ~80 s
    with FakeServerProcess(FakeConfig(token_rate=5, median_tokens=100, sigma=0.2)) as server:
        script = tmp_path / "child.py"
        script.write_text(CHILD)
        child = subprocess.Popen(
            [sys.executable, str(script), server.base_url],
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler),
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == b"STARTED"
            deadline = time.monotonic() + 30
            while server.stats().get("in_flight", 0) < 4:
                assert time.monotonic() < deadline, server.stats()
                time.sleep(0.2)
            tree = descendants(child.pid)
            started = time.monotonic()
            child.send_signal(signal.SIGINT)
            child.wait(STOP_WITHIN_S)
            seconds = time.monotonic() - started
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        output = child.stdout.read().decode(errors="replace")
    assert child.returncode != 0 and "FINISHED" not in output, output
    assert "KeyboardInterrupt" in output, output
    assert seconds < 10, f"{seconds:.1f} s to stop"
    assert not alive(tree)
