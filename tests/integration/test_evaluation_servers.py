"""draft_evaluation against servers given by URL (issue 16): the generation API key, acceptance counted from the
evaluation's own responses (vLLM's per-request ``metrics.speculative_decoding``), never from ``/metrics``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.defs.evaluation import DraftEvaluationRunConfig, evaluation_options
from eagle3_assets.defs.registry import default_resources
from eagle3_assets.defs.resources import EvaluationServersResource
from eagle3_assets.evaluation.online_metrics import OnlineConfig, Prompt, measure
from support.chat_stub import ChatHandler, chat_completion
from support.common import send_body, stub_http_server

K = 3
# Each response reports 4 verify steps of its own: 1 accepted 0, 1 accepted 1, 2 accepted 3 (drafts of 3 tokens).
OWN = {"acceptance_histogram": [1, 1, 0, 2], "num_draft_tokens": 12, "num_spec_steps": 4}


@contextmanager
def stub_server(speculative: dict | None) -> Iterator[tuple[str, list[dict]]]:
    """A chat-completions server that records each request's headers; /metrics shows counters that other
    clients of a shared server would have moved (huge, and moving), which the evaluation must not read."""
    seen: list[dict] = []
    metrics_reads = [0]

    class Handler(ChatHandler):
        def do_GET(self) -> None:
            metrics_reads[0] += 1
            send_body(self, f"vllm:spec_decode_num_drafts_total{{}} {1000 * metrics_reads[0]}.0\n".encode())

        def answer(self, request: dict) -> dict:
            seen.append({"authorization": self.headers.get("Authorization"), "path": self.path, **request})
            return chat_completion(request["model"], "hi", [1, 2, 3], "stop", speculative)

    with stub_http_server(Handler) as base_url:
        yield base_url, seen
        assert metrics_reads[0] == 0, "the evaluation read /metrics"


PROMPTS = [Prompt(f"p{i}", [{"role": "user", "content": f"q{i}"}]) for i in range(5)]


def test_acceptance_is_counted_from_own_responses_with_the_api_key() -> None:
    with stub_server(OWN) as (url, seen):
        run = measure(url, "m", PROMPTS, OnlineConfig(k=K, api_key="sk-eval-123", concurrency=2), speculative=True)
    assert run.counters == {"drafts": 20, "draft_tokens": 60, "accepted": 35, "per_position": [15, 10, 10]}
    assert len(seen) == 5 and {r["authorization"] for r in seen} == {"Bearer sk-eval-123"}
    assert all(r["temperature"] == 0 and r["path"] == "/v1/chat/completions" for r in seen)


def test_a_draft_server_without_per_request_metrics_is_refused() -> None:
    with stub_server(None) as (url, _seen), pytest.raises(RuntimeError) as raised:
        measure(url, "m", PROMPTS, OnlineConfig(k=K), speculative=True)
    text = str(raised.value)
    assert "--per-request-spec-decode-metrics summary" in text and "5 of 5 requests" in text and url in text


def test_evaluation_settings_come_from_their_own_variables_and_the_generation_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EAGLE3_API_KEY", "sk-shared")
    resources = default_resources(
        {
            "EAGLE3_EVAL_PLAIN_URL": "http://plain:8000/v1/",
            "EAGLE3_EVAL_DRAFT_URL": "https://draft:8000/v1",
            "EAGLE3_EVAL_MODEL": "target",
            "EAGLE3_VLLM_BASE_URL": "http://generation:8000/v1",
        }
    )
    servers: EvaluationServersResource = resources["evaluation_servers"]
    assert servers.api_key() == resources["inference_server"].api_key() == "sk-shared"  # EAGLE3_API_KEY, no field
    options = evaluation_options(DraftEvaluationRunConfig(), servers, DataLayout.at(tmp_path))
    online = options.online_config
    assert (online.plain_url, online.draft_url, online.served_model_name) == (
        "http://plain:8000/v1",
        "https://draft:8000/v1",
        "target",
    )
    assert online.api_key == "sk-shared" and "sk-shared" not in repr(online)
    bad = default_resources({"EAGLE3_EVAL_DRAFT_URL": "draft:8000"})["evaluation_servers"]
    assert bad.draft_url == ""  # left out at load; the run that uses it fails naming the key:
    monkeypatch.setenv("EAGLE3_EVAL_DRAFT_URL", "draft:8000")
    with pytest.raises(ValueError, match="EAGLE3_EVAL_DRAFT_URL='draft:8000': 'draft:8000' is not an http"):
        bad.setup_for_execution(None)  # type: ignore[arg-type]
