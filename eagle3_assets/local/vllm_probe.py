"""Talking to a running vLLM server without a client library: ``/v1/models`` (health, API key) and ``/metrics``.

API key: vLLM requires ``Authorization: Bearer KEY`` on ``/v1/*`` (not on ``/metrics`` or ``/health``) when its
process has ``VLLM_API_KEY`` in its environment or an ``--api-key`` argument. The key is never logged or put in an
error message.

Every body is read within a size limit and a whole-request deadline
(:func:`eagle3_assets.net.bounded_http.read_capped`): urllib's timeout bounds each socket operation, so a server
that answers 200 and trickles the body, or never ends it, would otherwise hold the caller forever or fill its
memory.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from eagle3_assets.net.bounded_http import read_capped

API_KEY_ENV = "VLLM_API_KEY"  # what vLLM reads; enforced on /v1/* when set


def probe_models(
    base_url: str, timeout_s: float, api_key: str | None, *, authorization: str | None = None
) -> tuple[list[str] | None, int | None]:
    """(model ids or None, HTTP status or None when nothing answered, or no whole body within ``timeout_s`` or
    the size limit) of ``GET {base_url}/models``.

    ``authorization``: a whole Authorization header value (e.g. from credentials that were in a URL), instead of
    ``api_key`` as a bearer. ``base_url`` must carry no credentials (urllib would misread ``user:pw@host``).
    """
    request = urllib.request.Request(f"{base_url.rstrip('/')}/models")
    header = authorization or (f"Bearer {api_key}" if api_key else None)
    if header:
        # Unredirected: a redirect to another host never carries the key along.
        request.add_unredirected_header("Authorization", header)
    deadline = time.monotonic() + timeout_s
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status = int(response.status)
            if status != 200:
                return None, status
            payload = json.loads(read_capped(response, "GET /models", deadline).decode("utf-8"))
    except urllib.error.HTTPError as error:
        error.close()
        return None, int(error.code)
    except (OSError, ValueError):  # URLError/timeouts are OSErrors; bad JSON is a ValueError
        return None, None
    if not isinstance(payload, dict):
        return None, 200
    return [str(item.get("id")) for item in payload.get("data", []) if isinstance(item, dict)], 200


def list_models(base_url: str, timeout_s: float = 5.0, api_key: str | None = None) -> list[str] | None:
    """Model ids served at ``base_url`` (``http://host:port/v1``), or None if it does not answer 200.

    ``api_key``: sent as ``Authorization: Bearer`` (a server started with ``VLLM_API_KEY`` answers 401 without it).
    """
    return probe_models(base_url, timeout_s, api_key)[0]


def unauthorized_message(base_url: str, api_key: str | None) -> str:
    """Why a 401 happened, without the key."""
    sent = (
        f"it refused the key that was sent (from {API_KEY_ENV} or --api-key)"
        if api_key
        else f"no key was sent (set {API_KEY_ENV} in the environment of the caller or in extra_env)"
    )
    return f"the server requires an API key: {base_url}/models answered 401 Unauthorized; {sent}"


def read_metrics(base_url: str, timeout_s: float = 10.0) -> str:
    """The server's Prometheus text (``/metrics`` lives beside ``/v1``, not under it), whole within ``timeout_s``
    (else TimeoutError) and the size limit (else :class:`~eagle3_assets.net.bounded_http.ReplyTooLarge`)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    deadline = time.monotonic() + timeout_s
    with urllib.request.urlopen(f"{root}/metrics", timeout=timeout_s) as response:
        return read_capped(response, "GET /metrics", deadline).decode("utf-8")


def metric_total(base_url_or_text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """Sum of a Prometheus counter over the series whose labels match ``labels``.

    ``base_url_or_text``: a base URL (``http://host:port/v1``, fetched) or /metrics text already read. E.g.
    ``metric_total(url, "vllm:request_success_total")`` counts finished requests of every finish reason;
    ``"vllm:spec_decode_num_accepted_tokens_total"`` / ``"vllm:spec_decode_num_drafts_total"`` give EAGLE-3's mean
    acceptance length as 1 + accepted / drafts.
    """
    text = read_metrics(base_url_or_text) if base_url_or_text.startswith(("http://", "https://")) else base_url_or_text
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$")
    total = 0.0
    for line in text.splitlines():
        match = pattern.match(line)
        if not match:
            continue
        series = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if labels and any(series.get(key) != value for key, value in labels.items()):
            continue
        total += float(match.group(2))
    return total


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])
