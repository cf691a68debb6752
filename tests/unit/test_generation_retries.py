"""Unit tests of how the generation engine reacts to a failed request.

Which failures are retryable (HTTP statuses, from the raw body and from the SDK's exception; error bodies; transport
errors; Retry-After), the jittered exponential backoff between attempts, and the endpoint pool's least-outstanding
routing, which benches a failing endpoint and probes it once when the bench ends. Moved out of
tests/unit/test_generation_units.py, which keeps config, journal and reply parsing.
"""

from __future__ import annotations

import json
import random

import httpx2
import openai
import pytest

from eagle3_assets.generation.engine import backoff_delay
from eagle3_assets.generation.errors import classify, error_message, status_failure
from eagle3_assets.generation.generation_config import GenerationConfig
from eagle3_assets.generation.transport import sdk_failure
from eagle3_assets.net.endpoints import EndpointPool

URL = "http://127.0.0.1:8000/v1"


# ------------------------------------------------------------------------------------ error classes


def _status_error(status: int, body: object) -> openai.APIStatusError:
    """The exception the stock SDK raises for an HTTP error status."""
    request = httpx2.Request("POST", URL + "/chat/completions")
    response = httpx2.Response(status, json=body, request=request)
    return openai.APIStatusError(f"Error code: {status}", response=response, body=body)


@pytest.mark.parametrize(
    ("status", "retryable"),
    [
        (400, False),
        (401, False),
        (404, False),
        (422, False),
        (408, True),
        (409, True),
        (429, True),
        (500, True),
        (502, True),
        (503, True),
    ],
)
def test_status_classification(status: int, retryable: bool) -> None:
    body = {"error": {"message": f"server says {status}"}}
    for failure in (status_failure(status, json.dumps(body).encode()), sdk_failure(_status_error(status, body))):
        assert failure.retryable is retryable and failure.status == status
        assert failure.message == f"HTTP {status}: server says {status}"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"object": "error", "message": "This model\'s maximum context length is 1"}', "This model's maximum"),
        (b'{"error": {"message": "bad key"}}', "bad key"),
        (b'{"error": "flat"}', '{"error": "flat"}'),
        (b"<html>502 Bad Gateway</html>", "<html>502 Bad Gateway</html>"),
        (b"", "(empty body)"),
    ],
)
def test_error_body_parser_keeps_the_servers_message(body: bytes, message: str) -> None:
    assert error_message(body).startswith(message)


def test_retry_after_is_read_from_the_headers() -> None:
    failure = status_failure(429, b"{}", {"retry-after": "3"})
    assert failure.retryable and failure.retry_after_s == 3.0
    assert status_failure(429, b"{}", {"retry-after": "soon"}).retry_after_s is None


def test_transport_errors_are_retryable() -> None:
    request = httpx2.Request("POST", URL)
    for error in (
        openai.APITimeoutError(request),
        openai.APIConnectionError(request=request),
        httpx2.ReadTimeout("idle"),
        httpx2.RemoteProtocolError("peer closed"),
        TimeoutError(),
        ConnectionResetError("reset"),
    ):
        assert classify(error).retryable and sdk_failure(error).retryable, error
    assert sdk_failure(openai.APITimeoutError(request)).kind == "timeout"
    assert classify(ConnectionRefusedError("refused")).kind == "connection"


def test_backoff_is_exponential_jittered_capped_and_honours_retry_after() -> None:
    config = GenerationConfig(base_urls=[URL], backoff_base_s=1.0, backoff_max_s=10.0)
    rng = random.Random(0)
    for attempt, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 10.0), (9, 10.0)]:
        delays = [backoff_delay(attempt, config, rng=rng) for _ in range(200)]
        assert min(delays) >= ceiling / 2 and max(delays) <= ceiling
        assert max(delays) - min(delays) > ceiling / 10  # jittered
    assert backoff_delay(1, config, retry_after_s=5.0, rng=rng) == 5.0
    assert backoff_delay(1, config, retry_after_s=500.0, rng=rng) == 10.0


# ------------------------------------------------------------------------------------------- routing


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_least_outstanding_routing_with_cap() -> None:
    pool = EndpointPool(["a", "b"], cap=2)
    picks = [pool.acquire() for _ in range(5)]
    assert [p.url if p else None for p in picks] == ["a", "b", "a", "b", None]
    pool.release(picks[1], server_failure=False)  # b now has fewer outstanding
    assert pool.acquire().url == "b"


def test_failing_endpoint_is_benched_then_probed_once() -> None:
    clock = _Clock()
    pool = EndpointPool(["bad", "good"], cap=10, bench_after_failures=3, bench_s=30, clock=clock)
    bad = pool.endpoints[0]
    for _ in range(3):
        endpoint = pool.acquire()
        assert endpoint is bad
        pool.release(endpoint, server_failure=True)
        # keep 'good' busier so least-outstanding would pick 'bad' again
        pool.endpoints[1].outstanding = 5
    assert bad.benched and pool.acquire().url == "good"
    assert pool.next_change_in() == pytest.approx(30)
    clock.now = 31
    pool.endpoints[1].outstanding = 5
    probe = pool.acquire()
    assert probe is bad  # one probe after the bench
    assert pool.acquire().url == "good"  # and only one at a time
    pool.release(probe, server_failure=True)  # failed probe: bench doubles
    assert bad.bench_s == 60 and pool.next_change_in() == pytest.approx(60)
    clock.now = 100
    probe = pool.acquire()
    assert probe is bad
    pool.release(probe, server_failure=False)
    assert not bad.benched and bad.consecutive_failures == 0


def test_non_retryable_request_errors_do_not_bench() -> None:
    pool = EndpointPool(["a"], cap=4, bench_after_failures=2)
    for _ in range(5):
        pool.release(pool.acquire(), server_failure=False)
    assert not pool.endpoints[0].benched
