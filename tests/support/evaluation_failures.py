"""A draft server for the online evaluation's failure tests (``tests/integration/test_safety_evaluation_failures.py``):
the fake vLLM's honest replies, each given the per-request speculative metrics (``metrics.speculative_decoding``)
vLLM adds with ``--per-request-spec-decode-metrics summary``, which the evaluation requires of a draft server and
the fake vLLM does not send.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

from support.common import send_json, stub_http_server


def speculative_metrics(k: int) -> dict[str, object]:
    """Two verify steps per request: one accepted every draft token, one none (mean acceptance length 1 + k/2)."""
    return {"acceptance_histogram": [1] + [0] * (k - 1) + [1], "num_draft_tokens": 2 * k, "num_spec_steps": 2}


@contextmanager
def speculative_proxy(upstream_base_url: str, k: int) -> Iterator[str]:
    """A server in front of ``upstream_base_url`` (``.../v1``) answering what it answers plus the speculative
    metrics of :func:`speculative_metrics`; yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_args: object) -> None:  # quiet: the test's output is the report
            pass

        def _forward(self, body: bytes | None) -> dict[str, object]:
            path = self.path.removeprefix("/v1")
            request = urllib.request.Request(
                upstream_base_url + path, data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=30) as reply:
                return json.loads(reply.read())

        def do_GET(self) -> None:
            send_json(self, self._forward(None))

        def do_POST(self) -> None:
            payload = self._forward(self.rfile.read(int(self.headers["Content-Length"])))
            payload["metrics"] = {"speculative_decoding": speculative_metrics(k)}
            send_json(self, payload)

    with stub_http_server(Handler) as url:
        yield url
