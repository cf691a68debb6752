"""Server capacity shared by every client: admission from the server's own load gauges.

Each partition run is a separate process with its own engine, and several of them (plus anyone else) may talk
to the same vLLM server. Instead of each run sending a fixed number of requests, every engine reads the server's
load from its ``/metrics`` (``vllm:num_requests_running`` + ``vllm:num_requests_waiting``) a few times a second
and computes how many requests *it* may have in flight there, so that the server as a whole stays at its
target: full, without a waiting queue. docs/architecture.md ("Server capacity") explains why this mechanism.

The rule, per server, at each poll (``own`` = this engine's requests in flight there):

- ``others = max(0, running + waiting - own)``: the load that is not ours (other partitions, other clients).
  ``own`` comes from local accounting, which is exact and current; the gauges lag it by the requests still on
  the wire, so counting ourselves from ``own`` rather than from the gauges never double-books those.
- ``free = target - max(others, others at the previous poll) - own``: room another client left is claimed
  once it has lasted one poll interval (a request another engine just got back is a gap of milliseconds
  before that engine refills it; claiming it would overfill the server). Room (``free >= 0``): the cap
  becomes ``own + free``, or ``own + free/2`` when the room is *contested*: on our first claim, or when
  ``others`` grew since the previous one (someone else is claiming too). Halving makes two engines that
  see the same room fill it together instead of twice.
- Overfull (``free < 0``): the cap becomes ``own * target / (own + others)``, every adaptive client shedding in
  proportion to its share, so together they land on the target in one step whatever their number.

Between polls the cap is fixed and the engine refills its own finished requests at once (those slots are known
to be free), so one engine alone keeps the server at the target with no lag; only slots freed by *other*
clients wait for the next poll. An engine that holds slots keeps them (it refills before anyone else can see
the room), so a partition started while another is running takes over as that one drains: partitions land in
the order they started, and the server stays full across the boundary.

Among this pipeline's own partitions, :class:`PartitionLine` adds key order: only the lowest partition key
with samples left takes new room, so partitions waiting for the same draining one do not split it evenly.

A server without ``/metrics`` (404, or no vLLM gauges in it) gets today's fixed cap for the whole run.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_assets.generation.generation_config import GenerationConfig
from eagle3_assets.generation.transport import _read_body, aiohttp_session
from eagle3_assets.net.bounded_http import PAGE_LIMIT_BYTES
from eagle3_assets.net.credentials import display_url
from eagle3_assets.net.endpoints import Endpoint

FIRST_REPOLL_S = 0.05

# Gauges above this are no reading: no vLLM server runs or queues a million requests; a page that says so (a
# co-tenant's queue that never drains, a broken exporter) would otherwise hold this run's cap at 0 forever.
MAX_GAUGE = 1_000_000.0

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
# Token counters the engine advances at every step it reports: they tell a poll that a step has passed since the last.
STEP_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
# A claim is counted in the gauges once the engine has reported this many steps after it: the first step reported
# may have been scheduled before the claimed requests arrived, the second was scheduled after the first ended.
CLAIM_SETTLE_STEPS = 2
# ...or after this many polls at most (a claim with nothing to send moves no step): ~10 s at the default 0.25 s
CLAIM_SETTLE_MAX_POLLS = 40


@dataclass(frozen=True)
class ServerLoad:
    running: int
    waiting: int
    # prompt + generation tokens the server has processed (its step counters); None: the page has no counters
    tokens: float | None = None

    @property
    def total(self) -> int:
        return self.running + self.waiting


def parse_load(text: str) -> ServerLoad | None:
    """The two scheduler gauges of a Prometheus text page, summed over their label sets (one per model name and
    engine: a data-parallel server has several engines behind one URL); None when neither is present, or when a
    value is NaN, negative or absurd (above :data:`MAX_GAUGE`): such a page is no reading at all.

    A line scan rather than ``prometheus_client.parser``: vLLM's page has ~100 series (mostly histograms) and
    only these two matter; a full parse of it costs milliseconds of the engine's CPU per poll.
    """
    sums = {RUNNING: 0.0, WAITING: 0.0}
    seen = False
    tokens: float | None = None
    for line in text.splitlines():
        if line.startswith(STEP_COUNTERS):
            with contextlib.suppress(IndexError, ValueError):
                tokens = (tokens or 0.0) + float(line.rsplit(None, 1)[-1])
            continue
        if not line.startswith("vllm:num_requests_"):
            continue
        name, _, rest = line.partition("{")
        if not rest:  # no labels: "name value"
            name, _, rest = line.partition(" ")
            value_text = rest
        else:
            value_text = rest.rsplit("}", 1)[-1]
        if name not in sums:  # e.g. vllm:num_requests_waiting_by_reason: a breakdown, not the total
            continue
        try:
            value = float(value_text.split()[0])
        except (IndexError, ValueError):
            continue
        if not (0 <= value <= MAX_GAUGE):  # NaN, negative, infinite or absurd: the page is not a reading
            return None
        sums[name] += value
        seen = True
    if not seen or not all(0 <= total <= MAX_GAUGE for total in sums.values()):
        return None
    return ServerLoad(running=round(sums[RUNNING]), waiting=round(sums[WAITING]), tokens=tokens)


def _has_gauges(text: str) -> bool:
    return any(line.startswith((RUNNING, WAITING)) for line in text.splitlines())


def metrics_url(base_url: str) -> str:
    """``http://host:8000/v1`` -> ``http://host:8000/metrics`` (vLLM serves the metrics at the root)."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return f"{root}/metrics"


@dataclass
class ServerAdmission:
    """The admission state of one server for one engine (pure: no I/O, easy to test)."""

    target: int
    others: int | None = None  # the load not ours at the previous poll; None before the first
    managed: bool | None = None  # True: /metrics drives the cap; False: fixed cap; None: not known yet
    polls: int = 0
    peak_waiting: int = 0
    peak_load: int = 0
    # Our last claim, until the gauges count it: the engine steps still to be reported (0: settled) and the polls
    # since the claim. Until then the room it took still looks free (the gauges lag our requests by the steps still
    # running: seconds on a CPU server), and claiming it again would overfill the server at every poll.
    unsettled_steps: int = 0
    unsettled_polls: int = 0
    tokens_seen: float | None = None

    def update(self, own: int, load: ServerLoad, first: bool = True) -> int:
        """The new cap on this engine's requests in flight at the server, from its load now. ``first``: no
        lower partition key of this pipeline is waiting for room (see :class:`PartitionLine`)."""
        self.polls += 1
        self._settle(load)
        self.peak_waiting = max(self.peak_waiting, load.waiting)
        self.peak_load = max(self.peak_load, load.total)
        others = max(0, load.total - own)
        # Room left by others counts once it has lasted a poll interval: a request another engine just got
        # back is a gap of a few milliseconds before that engine refills it, not room for us.
        settled = others if self.others is None else max(others, self.others)
        free = self.target - settled - own
        if self.others is None or (free >= 0 and not first):
            # The first poll only looks (and has joined the line): engines of one pipeline that start in the
            # same instant are ordered by the line before any of them claims. Behind a lower key: keep what we
            # hold (refilled locally), leave the room to it.
            cap = own
        elif free >= 0 and self.unsettled_steps:
            cap = own  # the room our last claim took looks free until the gauges count that claim
        elif free >= 0:
            contested = self.polls == 2 or others > self.others  # our first claim may be someone else's too
            cap = own + ((free + 1) // 2 if contested else free)
            if cap > own and load.tokens is not None:
                self.unsettled_steps, self.unsettled_polls = CLAIM_SETTLE_STEPS, 0
        else:
            cap = own * self.target // (own + settled)
        self.others = others
        return cap

    def _settle(self, load: ServerLoad) -> None:
        """Count the engine steps reported since our last claim (its step counters moved since the last poll)."""
        stepped = load.tokens is not None and self.tokens_seen is not None and load.tokens != self.tokens_seen
        self.tokens_seen = load.tokens
        if self.unsettled_steps:
            self.unsettled_polls += 1
            if stepped:
                self.unsettled_steps -= 1
            if self.unsettled_polls >= CLAIM_SETTLE_MAX_POLLS:
                self.unsettled_steps = 0


class PartitionLine:
    """Key order among this pipeline's partition runs: only the lowest partition key that still has samples to
    send takes new room; the others keep what they hold and wait. (Every partition of a pipeline has the
    same targets; a lower key given a smaller one would leave the rest of the room idle until it has sent
    its samples.) One file per waiting or sending partition in
    ``directory`` (under the data dir, which every run worker shares), touched at every poll; a file not touched
    for ``stale_s`` belongs to a dead run and is ignored.

    Why: without it, two partitions waiting for the same draining one split its slots evenly, progress side by
    side and drain together, so their tails add up instead of overlapping with the next partition's start; with
    it the server sees one continuous in-order pool, and partitions land in key order.
    """

    def __init__(self, directory: Path, key: str, stale_s: float = 10.0) -> None:
        self.directory = directory
        self.key = key
        self.stale_s = stale_s
        self.path = directory / f"{key}.waiting"
        self._registered = False

    def first(self, has_samples: bool) -> bool:
        """Register (or leave) the line; True when no lower key with samples left is in it."""
        try:
            if has_samples:
                if not self._registered:
                    self.directory.mkdir(parents=True, exist_ok=True)
                self.path.touch()
                self._registered = True
            else:
                self.leave()
                return True
            now = time.time()
            for entry in os.scandir(self.directory):
                other = entry.name.removesuffix(".waiting")
                if other < self.key and entry.name.endswith(".waiting"):
                    with contextlib.suppress(FileNotFoundError):
                        if now - entry.stat().st_mtime < self.stale_s:
                            return False
        except OSError:  # an unwritable or vanished folder: no ordering, the gauges still bound the load
            return True
        return True

    def for_server(self, url: str) -> PartitionLine:
        """This partition's place in the line of one server: partitions wait only behind lower keys that want room
        on the same server (a lower key waiting on a busy server never holds a higher one off an idle one)."""
        slug = hashlib.sha256(display_url(url).encode()).hexdigest()[:16]
        return PartitionLine(self.directory / slug, self.key, self.stale_s)

    def leave(self) -> None:
        if self._registered:
            with contextlib.suppress(OSError):
                self.path.unlink(missing_ok=True)
            self._registered = False


class CapacityMonitor:
    """Polls ``/metrics`` of every endpoint and sets each endpoint's cap (``Endpoint.cap``) for the pool.

    ``on_change`` is called after every poll round so the dispatcher re-checks for room.
    """

    def __init__(
        self,
        config: GenerationConfig,
        endpoints: Sequence[Endpoint],
        on_change: Callable[[], None],
        log: Callable[[str], None],
        *,
        line: PartitionLine | None = None,
        has_samples: Callable[[], bool] = lambda: True,
    ) -> None:
        self.config = config
        self.line = line
        # one line per server (see PartitionLine.for_server)
        self.lines = {e.url: line.for_server(e.url) for e in endpoints} if line is not None else {}
        self.has_samples = has_samples
        self.endpoints = list(endpoints)
        self.on_change = on_change
        self.log = log
        self.servers = {e.url: ServerAdmission(config.server_target(e.url)) for e in self.endpoints}
        self._urls = {e.url: metrics_url(e.url) for e in self.endpoints}
        self._session: Any = None
        self._task: asyncio.Task[None] | None = None
        for endpoint in self.endpoints:
            endpoint.cap = config.server_target(endpoint.url)  # the fixed cap until /metrics says otherwise

    @property
    def any_managed(self) -> bool:
        return any(s.managed for s in self.servers.values())

    def run_limit(self) -> int:
        """Requests in flight for the whole run: the fixed ``concurrency`` unless some server is managed by
        its gauges (then the per-server caps are the limit)."""
        if self.any_managed:
            return sum(e.cap for e in self.endpoints)
        return self.config.concurrency

    async def start(self) -> None:
        """First poll (before the first request, so the first wave already respects the server's load), then
        keep polling in the background."""
        await self._poll_safely()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        for url, server in self.servers.items():
            if server.managed:
                self.log(
                    f"capacity: {display_url(url)}: target {server.target}, peak load seen {server.peak_load} "
                    f"(running + waiting, every client), peak waiting {server.peak_waiting}, {server.polls} polls"
                )
        if self._task is not None:
            self._task.cancel()
            # a poller that failed is no reason to fail a run whose rows are all journaled
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._session is not None:
            with contextlib.suppress(Exception):
                await self._session.close()
        for line in self.lines.values():
            line.leave()

    async def _loop(self) -> None:
        # The first polls in quick succession: the first only looks (and joins the line), the second claims
        # half of the room (it may be contested), the third the rest; an engine alone is then at its target
        # within ~0.1 s instead of two poll intervals.
        for _ in range(2):
            await asyncio.sleep(min(FIRST_REPOLL_S, self.config.capacity_poll_s))
            await self._poll_safely()
        while True:
            await asyncio.sleep(self.config.capacity_poll_s)
            await self._poll_safely()

    async def _poll_safely(self) -> None:
        """A poll whose failure (a bug, a page nobody foresaw) leaves the caps as they are: never the run's end."""
        try:
            await self.poll_once()
        except asyncio.CancelledError:
            raise
        except Exception as error:
            self.log(f"capacity: poll failed ({type(error).__name__}: {error}); caps unchanged")

    async def poll_once(self) -> None:
        pending = [e for e in self.endpoints if self.servers[e.url].managed is not False]
        if not pending:
            return
        pages = await asyncio.gather(*[self._fetch(e.url) for e in pending])
        has_samples = self.has_samples()
        for endpoint, page in zip(pending, pages, strict=True):
            line = self.lines.get(endpoint.url)
            self._apply(endpoint, page, line is None or line.first(has_samples))
        if self.any_managed and sum(e.cap for e in self.endpoints) < 1:
            # at least one request in flight per partition, whatever the gauges say: a co-tenant that never drains
            # (or a lower key that never sends) must not starve this run; the least loaded server gets it
            min(self.endpoints, key=lambda e: (e.benched, e.outstanding, e.index)).cap = 1
        self.on_change()

    def _apply(self, endpoint: Endpoint, page: tuple[int, str] | None, first: bool = True) -> None:
        server = self.servers[endpoint.url]
        if page is None:  # no answer this time: keep the last cap (a down server is benched by the pool)
            return
        status, text = page
        load = parse_load(text) if status == 200 else None
        if load is None and status == 200 and _has_gauges(text):
            # gauges present but NaN, negative or absurd: no reading; the configured cap until a sane page
            if endpoint.cap != server.target:
                self.log(f"capacity: {display_url(endpoint.url)} reports unusable load gauges; cap {server.target}")
            endpoint.cap, server.others = server.target, None
            return
        if load is None:
            if server.managed is None:
                server.managed = False
                why = f"HTTP {status}" if status != 200 else "no vllm:num_requests_* gauges"
                self.log(
                    f"capacity: {display_url(endpoint.url)} has no usable /metrics ({why}); "
                    f"fixed cap of {endpoint.cap} requests"
                )
            return  # a managed server whose page broke once keeps its last cap
        if server.managed is None:
            self.log(
                f"capacity: {display_url(endpoint.url)} reports its load; keeping it at {server.target} "
                "requests (running + waiting) shared with every other client"
            )
        server.managed = True
        endpoint.cap = server.update(endpoint.outstanding, load, first)

    async def _fetch(self, url: str) -> tuple[int, str] | None:
        try:
            # the whole poll, every byte of the page included, within its deadline and PAGE_LIMIT_BYTES: a page that
            # trickles or never ends is no reading, not a stalled poller or a run out of memory
            async with asyncio.timeout(self.config.connect_timeout_s):
                headers = {"Authorization": auth} if (auth := self.config.authorization(url)) else None
                get = self._client().get(self._urls[url], headers=headers, read_bufsize=PAGE_LIMIT_BYTES)
                async with get as response:
                    if response.status != 200:
                        return response.status, ""
                    page = await _read_body(response, PAGE_LIMIT_BYTES)
                    return 200, page.decode("utf-8", errors="replace")
        except Exception:  # timeout, refused, reset, too large: no information this round
            return None

    def _client(self) -> Any:
        if self._session is None:  # created on the running loop (an aiohttp session binds to it)
            timeout_s = self.config.connect_timeout_s  # the Authorization header goes per request (per server)
            self._session = aiohttp_session(limit=len(self.endpoints) + 2, connect_s=timeout_s, read_s=timeout_s)
        return self._session

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per server (display URL): managed or not, its target, polls, peak waiting and peak load seen."""
        return {
            display_url(url): {
                "managed": bool(s.managed),
                "target": s.target,
                "polls": s.polls,
                "peak_waiting": s.peak_waiting,
                "peak_load": s.peak_load,
            }
            for url, s in self.servers.items()
        }
