"""Routing over several OpenAI-compatible base URLs: least outstanding requests, a cap per endpoint,
and a bench for an endpoint that keeps failing with outages (then one probe request at a time until it answers).

A bench is for an outage only (refused, reset, timed out, 5xx: ``RequestFailed.outage``); a server that answers,
even with garbage, is up. When every endpoint is benched at once the deployment is down: :meth:`EndpointPool.
down_for` says for how long, and the caller ends the run once that exceeds its outage budget instead of probing
for hours (benches are bounded by :data:`MAX_BENCH_S`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from eagle3_assets.net.credentials import display_url

MAX_BENCH_S = 300.0


@dataclass
class Endpoint:
    url: str
    index: int
    cap: int
    outstanding: int = 0
    consecutive_failures: int = 0
    benched_until: float = 0.0
    bench_s: float = 0.0  # the current bench period; 0 = healthy
    requests: int = 0
    failures: int = 0
    benched_times: int = 0
    # True while the one probe request of a benched endpoint is in flight (set by ``acquire``). Only a
    # failure of that probe extends the bench; requests already in flight when the endpoint was benched
    # fail with the same outage and must not stretch it.
    probing: bool = False

    @property
    def benched(self) -> bool:
        return self.bench_s > 0


@dataclass
class EndpointPool:
    urls: Sequence[str]
    cap: int
    bench_after_failures: int = 5
    bench_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    log: Callable[[str], None] = lambda _message: None
    endpoints: list[Endpoint] = field(init=False)
    # when every endpoint became benched (None while one is in rotation); see down_for
    down_since: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.endpoints = [Endpoint(url, i, self.cap) for i, url in enumerate(self.urls)]

    def _note_health(self) -> None:
        if all(e.benched for e in self.endpoints):
            if self.down_since is None:
                self.down_since = self.clock()
        else:
            self.down_since = None

    def down_for(self) -> float:
        """Seconds since every endpoint has been benched (0 while any is in rotation)."""
        return 0.0 if self.down_since is None else self.clock() - self.down_since

    def _available(self, endpoint: Endpoint, now: float) -> bool:
        if endpoint.benched:
            # After the bench period one probe request at a time; the rest waits for its verdict.
            return now >= endpoint.benched_until and endpoint.outstanding == 0
        return endpoint.outstanding < endpoint.cap

    def acquire(self) -> Endpoint | None:
        """The available endpoint with the fewest requests in flight (ties: lowest index), or None."""
        now = self.clock()
        best: Endpoint | None = None
        for endpoint in self.endpoints:
            if self._available(endpoint, now) and (best is None or endpoint.outstanding < best.outstanding):
                best = endpoint
        if best is not None:
            if best.benched:
                best.probing = True  # available while benched only as the single probe after the bench
            best.outstanding += 1
            best.requests += 1
        return best

    def release(self, endpoint: Endpoint, *, server_failure: bool) -> None:
        """Return a slot. ``server_failure``: an outage (timeout, connection error, 5xx); a reply that arrived,
        malformed or a 4xx, is not one: the endpoint answered."""
        try:
            self._release(endpoint, server_failure)
        finally:
            self._note_health()

    def _release(self, endpoint: Endpoint, server_failure: bool) -> None:
        endpoint.outstanding -= 1
        was_probe, endpoint.probing = endpoint.probing, False
        if not server_failure:
            if endpoint.benched:
                self.log(f"endpoint {display_url(endpoint.url)} answered its probe; back in rotation")
            endpoint.consecutive_failures = 0
            endpoint.bench_s = 0.0
            return
        endpoint.failures += 1
        endpoint.consecutive_failures += 1
        if endpoint.benched and not was_probe:
            # In flight when the endpoint was benched: part of the same outage, not a verdict on a probe.
            return
        if endpoint.benched or endpoint.consecutive_failures >= self.bench_after_failures:
            # A failed probe doubles the bench; the first bench starts at bench_s.
            endpoint.bench_s = min(MAX_BENCH_S, endpoint.bench_s * 2) if endpoint.benched else self.bench_s
            endpoint.benched_until = self.clock() + endpoint.bench_s
            endpoint.benched_times += 1
            self.log(
                f"endpoint {display_url(endpoint.url)} benched for {endpoint.bench_s:.0f}s after "
                f"{endpoint.consecutive_failures} consecutive failures"
            )

    def bench(self, endpoint: Endpoint, reason: str) -> None:
        """Bench an endpoint now (e.g. it failed the preflight); it is probed after ``bench_s``."""
        endpoint.bench_s = self.bench_s
        endpoint.benched_until = self.clock() + endpoint.bench_s
        endpoint.benched_times += 1
        self._note_health()
        self.log(f"endpoint {display_url(endpoint.url)} benched for {endpoint.bench_s:.0f}s: {reason}")

    def next_change_in(self) -> float | None:
        """Seconds until a benched endpoint may be probed (None if none is benched and idle)."""
        now = self.clock()
        waits = [max(0.0, e.benched_until - now) for e in self.endpoints if e.benched and e.outstanding == 0]
        return min(waits) if waits else None

    @property
    def outstanding(self) -> int:
        return sum(e.outstanding for e in self.endpoints)
