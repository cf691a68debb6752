"""Reply bodies are bounded in time and in size outside the generation transport too (issue 31, clause 5).

A server or proxy that answers 200 and then never ends the body fails that request, instead of holding the caller
or the machine's memory, for every other HTTP client of the project:

- the online evaluation's requests (``evaluation.online.generate``, the openai SDK): a trickled body fails by the
  request timeout, an endless one at the reply limit of ``max_tokens``; each failed request is counted as failed
  (in the set's stats, in no acceptance or speed), and a batch with none answered stops the evaluation naming why;
- the ``vllm`` hidden-states backend (the openai SDK through speculators): either fails the request, retried per
  the backend's policy (a timeout as an outage, an oversized body as a retry that never benches the server), then
  the sample fails naming why;
- the capacity monitor's ``/metrics`` poll (aiohttp): no reading this round, the configured cap kept;
- the probes of ``local.vllm_probe`` (urllib): no model list (``probe_models``), an error (``read_metrics``).

The lying servers are real processes speaking HTTP: the fake vLLM (``benchmarks/fake_vllm.py``, chat completions)
and the fake extraction server (``tests/support/fake_extraction.py``: completions, ``/v1/models``, ``/metrics``).
A trickled body is read in this process (the wall time is what counts); an endless one in a child process whose
peak resident memory (VmHWM) is its own (``tests/support/bounded_bodies.py``). Before the fix the trickles held
each client until the server gave up (``NEVER_ENDING_S``) and the endless bodies grew the child past
``KILL_GROWTH_MB``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fake_vllm import FakeConfig, FakeServerProcess
from support.bounded_bodies import CLIENTS, run_in_child
from support.fake_extraction import ExtractionServerProcess
from support.never_ending import GROWTH_LIMIT_MB, KILL_GROWTH_MB, NEVER_ENDING_S, TRICKLE_INTERVAL_S, never_ending

TIMEOUT_S = 2.0  # each client's request timeout (its whole-request deadline)
ATTEMPTS = 2  # the extraction backend's attempts per sample
# slack over a request's timeout for its wall time: a child's or a backend's start, a retry's bench
SLACK_S = 3.0

pytestmark = pytest.mark.timeout(120, method="thread")

# each client with its settings: a short timeout, few attempts, a short bench
CLIENT_SETTINGS: dict[str, dict[str, Any]] = {
    "evaluation": {"request_timeout_s": TIMEOUT_S, "max_tokens": 64},
    "extraction": {"timeout_s": TIMEOUT_S, "max_attempts": ATTEMPTS, "bench_s": 0.1},
    "capacity": {"connect_timeout_s": TIMEOUT_S},
    "probe": {"timeout_s": TIMEOUT_S},
}
# a client's wall time at most: the extraction sample is tried ATTEMPTS times, each to its deadline; the probe
# test sends two requests (probe_models, read_metrics)
WALL_LIMIT_S = {"extraction": ATTEMPTS * TIMEOUT_S + SLACK_S, "probe": 2 * TIMEOUT_S + SLACK_S}
STORAGE = "storage"  # the extraction server's connector folder, under the test's tmp_path


def _settings(client: str, tmp_path: Path) -> dict[str, Any]:
    if client == "extraction":  # the backend reads (and deletes) connector files only under its storage mount
        return {**CLIENT_SETTINGS[client], "storage_path": str(tmp_path / STORAGE)}
    return CLIENT_SETTINGS[client]


@pytest.fixture
def lying_server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A server whose every 200 body never ends (``request.param``: the client it serves, the fault); yields its
    base URL."""
    client, fault = request.param
    if client == "evaluation":  # chat completions: the fake vLLM
        with FakeServerProcess(never_ending(fault)) as server:
            yield server.base_url
        return
    storage = tmp_path / STORAGE
    storage.mkdir()
    with ExtractionServerProcess(
        storage, tmp_path / "server.log", mode=fault, trickle_interval_s=TRICKLE_INTERVAL_S, hang_s=NEVER_ENDING_S
    ) as server:
        yield server.base_url


def _lying(fault: str) -> pytest.MarkDecorator:
    return pytest.mark.parametrize(
        ("client", "lying_server"),
        [(client, (client, fault)) for client in CLIENT_SETTINGS],
        indirect=["lying_server"],
        ids=list(CLIENT_SETTINGS),
    )


def _assert_failed(client: str, outcome: dict[str, Any], why: str) -> None:
    """The request failed, and said ``why`` where the client reports it."""
    if client == "evaluation":
        assert outcome["total"] == 4 and len(outcome["errors"]) == 4, outcome  # each counted as failed
        assert all(why in error for error in outcome["errors"]), outcome
    elif client == "extraction":
        error = outcome["error"]
        assert error is not None and f"failed {ATTEMPTS} times" in error and why in error, outcome
    elif client == "capacity":
        # no reading this round: not managed by the page, the configured cap kept
        assert outcome["managed"] is None and outcome["cap"] == outcome["target"], outcome
    else:
        assert (outcome["models"], outcome["status"]) == (None, None), outcome  # no model list: nothing answered
        assert outcome["metrics_error"] is not None and why in outcome["metrics_error"], outcome


# ------------------------------------------------------------------------------------ a trickled body

TRICKLE_WHY = {
    "evaluation": f"the reply did not end within the request timeout of {TIMEOUT_S:g} s",
    "extraction": f"TimeoutError: the reply did not end within the request timeout of {TIMEOUT_S:g} s",
    "capacity": "",
    "probe": "TimeoutError",
}


@_lying("trickle")
def test_a_trickled_body_fails_by_the_request_timeout(client: str, lying_server: str, tmp_path: Path) -> None:
    outcome = CLIENTS[client](lying_server, _settings(client, tmp_path))
    # each request ends at its deadline, not when the server gives up (NEVER_ENDING_S)
    assert outcome["wall_s"] < WALL_LIMIT_S.get(client, TIMEOUT_S + SLACK_S), outcome
    _assert_failed(client, outcome, TRICKLE_WHY[client])


# ------------------------------------------------------------------------------------ an endless body

ENDLESS_WHY = {
    "evaluation": "reply too large: the body of POST /v1/chat/completions passed beyond the limit of",
    "extraction": "ReplyTooLarge: reply too large: the body of POST /v1/completions passed beyond the limit of",
    "capacity": "",
    "probe": "ReplyTooLarge: reply too large: the body of GET /metrics passed beyond the limit of",
}


@_lying("endless")
def test_an_endless_body_fails_at_its_size_limit_in_bounded_memory(
    client: str, lying_server: str, tmp_path: Path
) -> None:
    report = run_in_child(client, lying_server, _settings(client, tmp_path), KILL_GROWTH_MB)
    assert report["peak_mb"] - report["baseline_mb"] < GROWTH_LIMIT_MB, report
    assert report["wall_s"] < WALL_LIMIT_S.get(client, TIMEOUT_S + SLACK_S), report
    _assert_failed(client, report, ENDLESS_WHY[client])


# ------------------------------------------------------------------------------------ the evaluation's accounting


def test_the_evaluation_counts_failed_requests_and_stops_when_none_is_answered() -> None:
    from eagle3_assets.evaluation.online_metrics import OnlineConfig, Prompt, acceptance_stats, measure

    prompts = [Prompt(f"p{i}", [{"role": "user", "content": f"question {i}"}]) for i in range(8)]
    config = OnlineConfig(concurrency=len(prompts), request_timeout_s=TIMEOUT_S, max_tokens=16, speed_prompts=0)
    # half the requests (as the fake's seed draws them) get a body that never ends, the others an honest reply
    fake = FakeConfig(faults={"endless": 0.5}, hang_s=NEVER_ENDING_S, token_rate=5000, median_tokens=16)
    with FakeServerProcess(fake) as server:
        run = measure(server.base_url, "fake-model", prompts, config)
        endless = server.stats()["outcomes"].get("endless", 0)
    assert 0 < endless < len(prompts), endless
    stats = acceptance_stats("plain", config.k, run)
    # before: the first failed request ended the whole evaluation
    assert stats.extra["failed"] == len(run.failures) == endless and stats.extra["prompts"] == len(prompts)
    assert stats.output_tokens == sum(g.completion_tokens for g in run.generations if not g.failed) > 0

    with (
        FakeServerProcess(FakeConfig(faults={"endless": 1.0}, hang_s=NEVER_ENDING_S)) as server,
        pytest.raises(RuntimeError, match=f"every one of the {len(prompts)} evaluation requests failed; the first: "),
    ):
        measure(server.base_url, "fake-model", prompts, config)
