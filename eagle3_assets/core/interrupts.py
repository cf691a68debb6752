"""Running a coroutine so that a signal stops it within seconds.

SIGINT and SIGTERM (Ctrl-C, ``kill``, ``timeout``, Kubernetes, systemd) and Dagster's run termination from the UI
(which makes the run process send itself SIGINT) reach Python as a handler that runs in the main thread, between
bytecodes, and raises there (``KeyboardInterrupt``, or Dagster's ``DagsterExecutionInterruptedError`` inside a
step). An event loop running in the main thread spends its time inside the poller (``epoll_wait``, C code); under
uvloop the handler's exception never reached the coroutine, and a generating partition went on for minutes after
the signal (issue 22).

So :func:`run_interruptible` runs the loop on a helper thread and the main thread only waits for the result, waking
up every :data:`POLL_S` (the signal may have been delivered to another thread, which does not wake the main one): the
handler's exception surfaces in the main thread, the coroutine's task is cancelled on its own loop (its ``finally``
blocks close connections, files and servers), and the exception is raised again once the task has wound down, or
after :data:`CANCEL_GRACE_S` at most. A second signal cuts the grace short.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# How long an interrupted run waits for its cancelled coroutine to clean up (close connections, journal) before the
# interrupt is raised anyway. Well inside the 30 s a stop request is given (docs/reliability.md "Stopping a run").
CANCEL_GRACE_S = 10.0
POLL_S = 0.2  # how often the waiting main thread wakes up to run a pending signal handler


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed: less CPU per request."""
    try:
        # lazy: loads uvloop (heavy), which only this path needs
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is declared for every platform but Windows, which lacks it
        return None
    return uvloop.new_event_loop


def run_interruptible(coro: Coroutine[Any, Any, T], grace_s: float = CANCEL_GRACE_S) -> T:
    """Run ``coro`` on a fresh event loop in a helper thread; a signal (or any exception) raised while waiting
    cancels it. Safe to call from any thread, including one whose own event loop is running."""
    started: concurrent.futures.Future[tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]]] = (
        concurrent.futures.Future()
    )
    outcome: concurrent.futures.Future[T] = concurrent.futures.Future()

    async def tracked() -> T:
        task = asyncio.current_task()
        assert task is not None
        started.set_result((asyncio.get_running_loop(), task))
        return await coro

    def body() -> None:
        try:
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                result = runner.run(tracked())
        except BaseException as error:  # the waiting thread re-raises it, whatever it is
            outcome.set_exception(error)
        else:
            outcome.set_result(result)
        finally:
            if not started.done():  # the coroutine never started (the loop failed to open)
                started.set_exception(RuntimeError("the event loop did not start"))
                coro.close()

    # daemon: a loop that ignores its cancellation must not keep the process alive after the interrupt
    threading.Thread(target=body, name="asyncio-runner", daemon=True).start()
    try:
        return _wait(outcome)
    except BaseException:
        if not outcome.done():  # interrupted while it ran: stop it before letting the interrupt go on
            _cancel(started, outcome, grace_s)
        raise


def _wait(outcome: concurrent.futures.Future[T]) -> T:
    """``outcome.result()``, woken every :data:`POLL_S`: the kernel may deliver a process-directed signal to any
    thread (the loop's, a resolver's, a library's), and the handler then runs in the main thread only once that
    thread runs bytecode again; a wait without a timeout would sleep through it until the coroutine ended."""
    while not outcome.done():  # not result(timeout=...): a TimeoutError of the coroutine's own would look the same
        concurrent.futures.wait([outcome], timeout=POLL_S)
    return outcome.result()


def _cancel(
    started: concurrent.futures.Future[tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]]],
    outcome: concurrent.futures.Future[Any],
    grace_s: float,
) -> None:
    # BaseException: a second signal while waiting ends the wait; the first interrupt is raised by the caller
    with contextlib.suppress(BaseException):
        loop, task = started.result(timeout=grace_s)
        loop.call_soon_threadsafe(task.cancel)
        concurrent.futures.wait([outcome], timeout=grace_s)
