"""``interrupts.run_interruptible``: a signal handler's exception (Dagster raises one inside a step) stops the coroutine
within a fraction of a second, its ``finally`` runs, and a signal the kernel delivered to another thread is not slept
through. The CLI-level proofs are ``tests/integration/test_signals_*.py``."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from eagle3_assets.core.interrupts import run_interruptible


class Interrupted(BaseException):
    """What Dagster's handler raises (DagsterExecutionInterruptedError is a BaseException too)."""


@pytest.fixture
def raising_sigint() -> Iterator[None]:
    def handler(_signo: int, _frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _forever(events: list[str]) -> object:
    async def coro() -> None:
        events.append("started")
        try:
            await asyncio.sleep(3600)
        finally:
            events.append("cleaned up")

    return coro()


@pytest.mark.parametrize("target", ["process", "helper thread"])
def test_a_signal_cancels_the_coroutine_and_its_cleanup_runs(raising_sigint: None, target: str) -> None:
    events: list[str] = []

    def send() -> None:
        while "started" not in events:
            time.sleep(0.01)
        if target == "process":
            os.kill(os.getpid(), signal.SIGINT)
        else:  # the kernel may pick any thread for a process-directed signal: this one is not the main thread
            helper = next(t for t in threading.enumerate() if t.name == "asyncio-runner")
            signal.pthread_kill(helper.ident, signal.SIGINT)  # type: ignore[arg-type]

    threading.Thread(target=send, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(Interrupted):
        run_interruptible(_forever(events))  # type: ignore[arg-type]
    assert time.monotonic() - started < 5
    assert events == ["started", "cleaned up"]


@pytest.mark.timeout(30)
def test_results_and_errors_pass_through() -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    async def fail() -> None:
        raise ValueError("boom")

    async def times_out() -> None:
        raise TimeoutError("the coroutine's own timeout, not the wait's")

    assert run_interruptible(answer()) == 42
    with pytest.raises(ValueError, match="boom"):
        run_interruptible(fail())
    with pytest.raises(TimeoutError, match="own timeout"):
        run_interruptible(times_out())
