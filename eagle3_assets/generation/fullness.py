"""How full a vLLM server was while a command generated: its own ``vllm:num_requests_running`` gauge, sampled.

The generation engines keep the server at its target (``generation/capacity.py``); whether they did, across the
boundaries between partitions too, is a property of the server, not of any one engine. :class:`ServerFullness` reads
the server's ``/metrics`` page on a background thread every ``interval_s`` and reports the mean number of requests
running (and waiting) over the stretch it watched, beside the target: ``make demo-real``, the learning curve and the
engine benchmark print it, so a drained tail between partitions shows as a mean well below the target.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from dataclasses import dataclass

from eagle3_assets.generation.capacity import metrics_url, parse_load
from eagle3_assets.net.bounded_http import read_capped

POLL_INTERVAL_S = 0.5  # the gauges move at the engine's step rate; two readings a second resolve a tail of seconds
POLL_TIMEOUT_S = 2.0  # one /metrics read; a slower page is a missed reading, not a stall of the watcher


@dataclass(frozen=True)
class FullnessReport:
    """The server's mean load over ``seconds`` (``readings`` of its gauges; ``missed``: polls that got none)."""

    target: int
    seconds: float
    readings: int
    missed: int
    mean_running: float
    mean_waiting: float

    @property
    def share(self) -> float:
        """Mean requests running / target: 1.0 is a server kept full the whole time."""
        return self.mean_running / self.target if self.target else 0.0

    def line(self, what: str) -> str:
        if not self.readings:
            return f"server fullness during {what}: no reading of the server's /metrics ({self.missed} polls missed)"
        return (
            f"server fullness during {what}: {self.mean_running:.1f} of {self.target} requests running on average "
            f"({self.share:.0%}), {self.mean_waiting:.1f} waiting; {self.readings} readings over {self.seconds:.0f} s"
        )


class ServerFullness:
    """Samples one server's load gauges from :meth:`start` to :meth:`stop` (or as a context manager)."""

    def __init__(self, base_url: str, target: int, interval_s: float = POLL_INTERVAL_S) -> None:
        self.url = metrics_url(base_url)
        self.target = target
        self.interval_s = interval_s
        self._running: list[int] = []
        self._waiting: list[int] = []
        self._missed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self.report: FullnessReport | None = None

    def _read(self) -> None:
        deadline = time.monotonic() + POLL_TIMEOUT_S
        try:
            with urllib.request.urlopen(self.url, timeout=POLL_TIMEOUT_S) as response:
                load = parse_load(read_capped(response, f"GET {self.url}", deadline).decode("utf-8", "replace"))
        except (OSError, ValueError):  # a refused, slow or oversized page: one missed reading
            load = None
        if load is None:
            self._missed += 1
            return
        self._running.append(load.running)
        self._waiting.append(load.waiting)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._read()
            self._stop.wait(self.interval_s)

    def start(self) -> ServerFullness:
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="server-fullness", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> FullnessReport:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=POLL_TIMEOUT_S + self.interval_s + 1.0)
        readings = len(self._running)
        self.report = FullnessReport(
            target=self.target,
            seconds=time.monotonic() - self._started,
            readings=readings,
            missed=self._missed,
            mean_running=sum(self._running) / readings if readings else 0.0,
            mean_waiting=sum(self._waiting) / readings if readings else 0.0,
        )
        return self.report

    def __enter__(self) -> ServerFullness:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
