"""The request pool: C requests always in flight, classified retries with backoff, a record per sample.

Why a continuously refilled pool and not batches: a batch waits for its slowest request while the server
sits mostly idle; with heavy-tailed lengths (lognormal sigma 0.8) that wastes most of the capacity. Here a
slot is refilled the moment a request ends, and a sample waiting out its backoff holds no slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.core.settings import ConfigError
from eagle3_assets.generation.capacity import CapacityMonitor, PartitionLine
from eagle3_assets.generation.errors import (
    AUTH_STATUS,
    AuthRejected,
    OutageError,
    RequestFailed,
    auth_failure_text,
    classify,
)
from eagle3_assets.generation.generation_config import GenerationConfig
from eagle3_assets.generation.records import (
    STATUS_FAILED,
    STATUS_OK,
    PromptToGenerate,
    check_row,
    normalize_messages,
)
from eagle3_assets.generation.replies import Completion, build_body
from eagle3_assets.generation.transport import Transport
from eagle3_assets.net.credentials import display_url
from eagle3_assets.net.endpoints import Endpoint, EndpointPool

Log = Callable[[str], None]


def backoff_delay(
    attempt: int, config: GenerationConfig, retry_after_s: float | None = None, rng: random.Random | None = None
) -> float:
    """Exponential backoff with 'equal jitter': half fixed, half random, capped; honours Retry-After."""
    ceiling = min(config.backoff_max_s, config.backoff_base_s * 2 ** (attempt - 1))
    delay = ceiling / 2 + (rng or random).uniform(0, ceiling / 2)
    if retry_after_s is not None and retry_after_s > 0:
        delay = max(delay, min(retry_after_s, config.backoff_max_s))
    return delay


@dataclass
class EngineStats:
    total: int = 0  # samples this run had to generate
    finished: int = 0
    ok: int = 0
    failed: int = 0
    truncated: int = 0
    requests: int = 0  # HTTP attempts
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None  # set when the pool has drained
    errors: Counter[str] = field(default_factory=Counter)  # terminal error texts (first 200 chars)
    retry_reasons: Counter[str] = field(default_factory=Counter)

    @property
    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started


@dataclass(eq=False)
class _Item:
    prompt: PromptToGenerate
    messages: list[dict[str, str]]
    attempts: int = 0
    body: bytes | None = None  # serialized on the first attempt, reused by retries


class Engine:
    """Runs one set of prompts to completion; ``on_finished`` receives each terminal record once."""

    def __init__(
        self,
        config: GenerationConfig,
        model: str,
        transports: Mapping[str, Transport],
        on_finished: Callable[[dict[str, Any]], None],
        *,
        partition_key: str,
        log: Log,
        progress_prefix: str = "",
        already_done: int = 0,
        rng: random.Random | None = None,
        unhealthy: Mapping[str, str] | None = None,
        line_dir: Path | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.transports = transports
        self.on_finished = on_finished
        self.partition_key = partition_key
        self.log = log
        self.progress_prefix = progress_prefix
        self.already_done = already_done
        self.rng = rng or random.Random()
        self.pool = EndpointPool(
            config.base_urls, config.endpoint_cap, config.bench_after_failures, config.bench_s, log=log
        )
        for endpoint in self.pool.endpoints:
            if unhealthy and endpoint.url in unhealthy:
                self.pool.bench(endpoint, f"preflight failed ({unhealthy[endpoint.url]})")
        self.params = config.sampling_params()
        self.request_fields = config.request_fields()
        # extra sampling fields go straight into the JSON body (vLLM reads top_k, min_p, ... there)
        self.sampling_json = json.dumps(self.params, sort_keys=True)
        self._display_urls = {url: display_url(url) for url in config.base_urls}  # once, not per record
        self.stats = EngineStats()
        self._ready: deque[_Item] = deque()
        self._in_flight = 0
        self._waiting = 0
        self._wake = asyncio.Event()
        # Sets each endpoint's cap from the server's own load (shared with other partitions and clients);
        # line_dir (shared by this pipeline's runs) orders its partitions by key.
        line = PartitionLine(line_dir, partition_key) if line_dir is not None else None
        self.capacity = CapacityMonitor(
            config, self.pool.endpoints, self._wake.set, log, line=line, has_samples=self._has_samples
        )
        self._fatal: BaseException | None = None
        self._last_outage: str | None = None  # the last outage failure, for the error that ends a down deployment
        self._tasks: set[asyncio.Task[None]] = set()
        self._timers: set[asyncio.TimerHandle] = set()

    # ------------------------------------------------------------------------------------------ run

    def _has_samples(self) -> bool:
        """Samples not yet sent (or backing off to be sent again): this engine still wants room."""
        return bool(self._ready or self._waiting)

    async def run(self, prompts: Sequence[PromptToGenerate]) -> EngineStats:
        self.stats = EngineStats(total=len(prompts))
        self._ready = deque(_Item(p, normalize_messages(p.messages)) for p in prompts)
        progress = asyncio.get_running_loop().create_task(self._progress_loop())
        try:
            await self.capacity.start()
            await self._dispatch()
            self.stats.ended = time.monotonic()
        finally:
            await self.capacity.close()
            progress.cancel()
            for timer in self._timers:
                timer.cancel()
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            with contextlib.suppress(asyncio.CancelledError):
                await progress
        self.log(self.progress_line(final=True))
        return self.stats

    def enqueue(self, prompt: PromptToGenerate) -> None:
        """Add a sample while the pool runs (a conversation's next turn, from ``on_finished``): it is sent as soon
        as a slot frees, so a conversation never waits for the other conversations' turns."""
        self._ready.append(_Item(prompt, normalize_messages(prompt.messages)))
        self.stats.total += 1
        self._wake.set()

    async def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while self._ready or self._in_flight or self._waiting:
            if self._fatal is not None:
                raise self._fatal
            if self.pool.down_for() > self.config.outage_budget_s:
                raise self._outage_error()
            self._wake.clear()
            # Re-read each round: the capacity monitor moves the caps as the servers' load changes.
            limit = self.capacity.run_limit()
            while self._ready and self._in_flight < limit:
                endpoint = self.pool.acquire()
                if endpoint is None:
                    break
                item = self._ready.popleft()
                self._in_flight += 1
                task = loop.create_task(self._attempt(item, endpoint))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            timeout = None
            if self._ready and self._in_flight < limit:
                timeout = self.pool.next_change_in()  # every endpoint is full or benched
            if self.pool.down_since is not None:  # wake in time to end the run when the outage budget runs out
                left = max(0.0, self.config.outage_budget_s - self.pool.down_for()) + 0.01
                timeout = left if timeout is None else min(timeout, left)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
        if self._fatal is not None:
            raise self._fatal

    async def _attempt(self, item: _Item, endpoint: Endpoint) -> None:
        try:
            item.attempts += 1
            self.stats.requests += 1
            started = time.monotonic()
            try:  # every way out of this try gives the endpoint back exactly once
                if item.body is None:
                    item.body = build_body(self.model, item.messages, self.request_fields, self.config.stream)
                completion = await self.transports[endpoint.url].complete(
                    item.body, stream=self.config.stream, deadline_s=self.config.request_timeout_s
                )
            except asyncio.CancelledError:
                self.pool.release(endpoint, server_failure=False)
                raise
            except Exception as error:  # RequestFailed, or a bug (not the server's failure): classified either way
                failure = classify(error)
                # only an outage benches: a malformed reply or a 4xx came from a server that is up
                self.pool.release(endpoint, server_failure=isinstance(error, RequestFailed) and failure.outage)
                self._after_failure(item, endpoint, failure, time.monotonic() - started)
            else:
                self.pool.release(endpoint, server_failure=False)
                self._finish(item, endpoint, time.monotonic() - started, completion=completion)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a bug in this sample's bookkeeping: it fails this sample, never the pool
            detail = f"{type(error).__name__}: {error}"
            self._fail_sample(item, endpoint, f"internal error while handling this sample: {detail}")
        finally:
            # whatever happened above: a slot that is never given back would hang the run
            self._in_flight -= 1
            self._wake.set()

    def _after_failure(self, item: _Item, endpoint: Endpoint, failure: RequestFailed, latency: float) -> None:
        message = self.config.redact(failure.message)
        if failure.status in AUTH_STATUS:
            # A refused key refuses every later request too: stop the run rather than fail each sample on its
            # first attempt. This sample and those not yet requested stay unwritten, so they are simply to do.
            where = self._display_urls.get(endpoint.url) or display_url(endpoint.url)
            failure = RequestFailed(message, False, failure.status)
            left = self.stats.total - self.stats.finished
            self._stop(AuthRejected(auth_failure_text(failure, where, left=left, finished=self.stats.finished)))
            return
        if failure.outage:
            self._last_outage = f"{self._display_urls.get(endpoint.url) or display_url(endpoint.url)}: {message}"
        if failure.retryable and item.attempts < self.config.max_attempts:
            self.stats.retries += 1
            self.stats.retry_reasons[message.split(":", 1)[0][:80]] += 1
            delay = backoff_delay(item.attempts, self.config, failure.retry_after_s, self.rng)
            self._waiting += 1
            handle = asyncio.get_running_loop().call_later(delay, self._requeue, item)
            self._timers.add(handle)
            return
        item.body = None
        if failure.retryable:
            message = f"gave up after {item.attempts} attempts; last error: {message}"
        self._finish(item, endpoint, latency, error=message)

    def _outage_error(self) -> OutageError:
        urls = ", ".join(self._display_urls.values())
        left = self.stats.total - self.stats.finished
        return OutageError(
            f"every endpoint ({urls}) has been down for {self.pool.down_for():.0f} s, beyond the outage budget of "
            f"{self.config.outage_budget_s:g} s (EAGLE3_OUTAGE_BUDGET_S): the run stopped. Last error: "
            f"{self._last_outage or 'none recorded'}. Is the server running? {self.stats.finished} samples finished "
            f"and are kept; {left} are left to do: run the partition again once the server answers."
        )

    def _stop(self, error: BaseException) -> None:
        """End the run with ``error`` (the first one wins); the dispatcher raises it."""
        if self._fatal is None:
            self._fatal = error
        self._wake.set()

    def _requeue(self, item: _Item) -> None:
        now = asyncio.get_running_loop().time()
        self._timers = {t for t in self._timers if t.when() > now}
        self._waiting -= 1
        self._ready.appendleft(item)  # retries first: they are the oldest samples, finish them soonest
        self._wake.set()

    def _finish(
        self,
        item: _Item,
        endpoint: Endpoint,
        latency: float,
        *,
        completion: Completion | None = None,
        error: str | None = None,
    ) -> None:
        """Journal the sample's terminal record, then count it.

        A record the journal refuses (it cannot be serialized...) fails the sample with that error: a failed
        record is written instead. A journal that cannot be written (an OSError: a full disk, a lost mount...)
        stops the run, as does a failed record it refuses: no row would be safe there.
        """
        item.body = None
        record = self._record(item, endpoint, latency, completion, error)
        check_row(record)  # a TypeError naming the field fails the sample (in _attempt), never the journal
        # counted before the journal write, so that nothing can fail between writing a record and counting it
        tokens = (completion.prompt_tokens or 0, completion.completion_tokens or 0) if completion else (0, 0)
        try:
            self.on_finished(record)
        except Exception as exc:
            if completion is None or isinstance(exc, OSError):
                self._stop(exc)
            else:
                self._fail_sample(item, endpoint, f"the reply could not be journaled: {type(exc).__name__}: {exc}")
            return
        except BaseException as exc:
            self._stop(exc)
            return
        stats = self.stats
        stats.finished += 1
        if completion is not None:
            stats.ok += 1
            if completion.finish_reason == "length":
                stats.truncated += 1
            stats.prompt_tokens += tokens[0]
            stats.completion_tokens += tokens[1]
        else:
            stats.failed += 1
            stats.errors[(error or "")[:200]] += 1

    def _fail_sample(self, item: _Item, endpoint: Endpoint, error: str) -> None:
        """Fail ``item`` with ``error`` after something went wrong between its reply and its record."""
        error = self.config.redact(error)
        self.log(f"{self.progress_prefix}sample {item.prompt.sample_id}: {error}")
        try:
            self._finish(item, endpoint, 0.0, error=error)
        except Exception as exc:  # not even a failed record could be built: the run cannot account for it
            self._stop(exc)

    def _record(
        self, item: _Item, endpoint: Endpoint, latency: float, completion: Completion | None, error: str | None
    ) -> dict[str, Any]:
        ok = completion is not None
        return {
            "sample_id": item.prompt.sample_id,
            "partition_key": self.partition_key,
            "messages": item.messages,
            "reasoning": completion.reasoning if ok else None,
            "content": completion.content if ok else None,
            "finish_reason": completion.finish_reason if ok else None,
            "prompt_tokens": completion.prompt_tokens if ok else None,
            "completion_tokens": completion.completion_tokens if ok else None,
            "prompt_token_ids": completion.prompt_token_ids if ok else None,
            "completion_token_ids": completion.completion_token_ids if ok else None,
            "latency_s": round(latency, 4),
            "endpoint": self._display_urls.get(endpoint.url) or display_url(endpoint.url),
            "attempts": item.attempts,
            "model": (completion.model if ok else None) or self.model,
            "sampling_params": self.sampling_json,
            "status": STATUS_OK if ok else STATUS_FAILED,
            "error": error,
            "finished_at": time.time(),
        }

    # ------------------------------------------------------------------------------------- progress

    def progress_line(self, final: bool = False) -> str:
        s = self.stats
        elapsed = max(s.elapsed, 1e-9)
        req_s = s.finished / elapsed
        tok_s = s.completion_tokens / elapsed
        remaining = s.total - s.finished
        eta = f"{remaining / req_s:,.0f}s" if req_s > 0 else "?"
        total = s.total + self.already_done
        head = "finished" if final else "progress"
        return (
            f"{self.progress_prefix}{head}: {s.finished + self.already_done}/{total} done "
            f"(resumed {self.already_done}, ok {s.ok}, failed {s.failed}, truncated {s.truncated}) | "
            f"{req_s:.2f} req/s, {tok_s:,.0f} output tok/s | in flight {self._in_flight}, "
            f"backing off {self._waiting}, retries {s.retries} | "
            + (f"wall {elapsed:,.1f}s" if final else f"ETA {eta}")
        )

    async def _progress_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.progress_interval_s)
            self.log(self.progress_line())


async def preflight(
    transports: Mapping[str, Transport],
    config: GenerationConfig,
    log: Log,
) -> tuple[str, dict[str, str]]:
    """GET /v1/models on every endpoint before the pool starts; returns the model to request and the
    endpoints that did not answer (url -> error), which start benched so the first wave avoids them.

    Why: it fails fast on a wrong API key (instead of 1,000 failed rows), finds the served model when none
    is configured, and warms each SDK client (its one-time platform probe runs in a thread; 128 first
    requests at once would each start one) so the pool starts at full speed.
    """
    last = "no endpoint answered"
    all_unreachable = False
    for attempt in range(1, config.max_attempts + 1):
        results = await asyncio.gather(*[_list_models(t, config) for t in transports.values()])
        served: list[str] = []
        unhealthy: dict[str, str] = {}
        for url, (models, failure) in zip(transports, results, strict=True):
            if failure is not None:
                unhealthy[url] = config.redact(failure.message)
                last = f"{display_url(url)}: {config.redact(failure.message)}"
                if failure.status in (401, 403):
                    raise RuntimeError(f"GET /v1/models refused, check the API key: {last}")
                log(f"preflight: {last}")
            elif models:
                served.extend(m for m in models if m not in served)
        if served:
            await _warm_connections(transports, config, unhealthy)
            if config.model is None:
                log(f"model not configured; using {served[0]!r} (served: {served})")
                return served[0], unhealthy
            if config.model not in served:
                log(f"warning: model {config.model!r} is not among the served models {served}")
            return config.model, unhealthy
        all_unreachable = all(failure is not None and failure.unreachable for _, failure in results)
        if any(failure is None for _, failure in results):
            last = "GET /v1/models lists no model"
        if attempt < config.max_attempts:
            await asyncio.sleep(backoff_delay(attempt, config))
    if config.model is not None:
        if all_unreachable:
            # Nobody is listening: starting the pool would only fail every request, with benches growing to
            # minutes, for hours. A wrong or missing server is a configuration problem; say so now.
            urls = ", ".join(display_url(url) for url in transports)
            raise ConfigError(
                f"EAGLE3_VLLM_BASE_URL: no endpoint answered GET /v1/models after {config.max_attempts} attempts "
                f"({urls}); is the vLLM server running? last error: {last}"
            )
        log(f"preflight failed ({last}); starting anyway, failing requests are retried")
        return config.model, {}
    raise RuntimeError(f"could not find the served model via GET /v1/models: {last}")


async def _warm_connections(
    transports: Mapping[str, Transport], config: GenerationConfig, unhealthy: Mapping[str, str]
) -> None:
    """Open each healthy endpoint's keep-alive connections before the pool starts (cheap GETs of /v1/models).

    Why: the first wave of C requests would otherwise pay C TCP handshakes and connection setups at the same
    instant on one event loop, delaying every first response by a few hundred ms.
    """
    healthy = [t for url, t in transports.items() if url not in unhealthy]
    if not healthy:
        return
    per_endpoint = min(config.endpoint_cap, -(-config.concurrency // len(healthy)))
    with contextlib.suppress(Exception):
        async with asyncio.timeout(config.connect_timeout_s + 30):
            await asyncio.gather(*[t.warm(per_endpoint) for t in healthy])


async def _list_models(transport: Transport, config: GenerationConfig) -> tuple[list[str], RequestFailed | None]:
    try:
        async with asyncio.timeout(config.connect_timeout_s + 30):
            return await transport.list_models(), None
    except Exception as error:  # classified; the caller decides
        return [], classify(error)
