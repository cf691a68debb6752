"""The fake vLLM server's capacity model: vLLM's ``--max-num-seqs`` admission and its scheduler gauges.

Kept apart from :mod:`fake_http` (the HTTP layer) and :mod:`fake_responses` (the response
model) so each stays readable; the server creates one :class:`Scheduler` and awaits ``admit()`` / calls
``release()`` around every generation.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fake_http import FakeVLLM


class Scheduler:
    """vLLM's admission in miniature: ``max_num_seqs`` sequences run, later arrivals wait first-come first-served.

    It also keeps the statistics a capacity benchmark needs: running/waiting peaks and the time integral of
    running sequences, updated at every change (so they are exact, not sampled).
    """

    def __init__(self, app: FakeVLLM) -> None:
        self.app = app
        self.running = 0
        self.waiting: deque[asyncio.Future[None]] = deque()
        self._changed = time.monotonic()

    def _account(self) -> None:
        now = time.monotonic()
        stats = self.app.stats
        stats.busy_seq_s += self.running * (now - self._changed)
        self._changed = now

    def _start(self) -> None:
        self._account()
        self.running += 1
        stats = self.app.stats
        stats.max_running = max(stats.max_running, self.running)

    async def admit(self) -> None:
        limit = self.app.config.max_num_seqs
        if not limit or (self.running < limit and not self.waiting):
            self._start()
            return
        ticket: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append(ticket)
        self.app.stats.max_waiting = max(self.app.stats.max_waiting, len(self.waiting))
        try:
            await ticket
        except asyncio.CancelledError:
            if ticket in self.waiting:
                self.waiting.remove(ticket)
            elif ticket.done() and not ticket.cancelled():
                self.release()  # scheduled in the same instant the client went away
            raise

    def release(self) -> None:
        self._account()
        self.running -= 1
        self.app.stats.last_response_at = time.time()
        limit = self.app.config.max_num_seqs
        while self.waiting and (not limit or self.running < limit):
            ticket = self.waiting.popleft()
            if not ticket.done():
                self._start()
                ticket.set_result(None)

    def metrics_text(self) -> bytes:
        """The two scheduler gauges as vLLM 0.32 writes them (labels ``engine`` and ``model_name``)."""
        labels = f'{{engine="0",model_name="{self.app.config.model}"}}'
        running, waiting = str(float(self.running)), str(float(len(self.waiting)))
        lie = self.app.config.metrics_lie
        if lie == "nan":
            running = "NaN"
        elif lie == "negative":
            running = "-50.0"
        elif lie == "huge":
            waiting = "1e9"
        return (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{labels} {running}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{labels} {waiting}\n"
        ).encode()
