"""Credentials in server URLs: the clean URL every request goes to, and the header the ``user:password@`` stands for.

Used by every stage that talks to a server (generation, the vLLM hidden-states backend, evaluation); redacting them
from free text (error messages, logs) is ``core.settings.redact_url_credentials``.
"""

from __future__ import annotations

import base64
from urllib.parse import unquote, urlsplit, urlunsplit


def split_credentials(url: str) -> tuple[str, str | None]:
    """(the URL without ``user:password@``, the ``Authorization: Basic`` value they stand for, or None).

    Every request, probe and ``/metrics`` poll goes to the clean URL with the header: a URL with credentials is
    never sent, logged or stored (an HTTP library would read ``user:pw@host`` differently, or not at all).
    """
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    clean = urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    pair = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
    return clean, f"Basic {base64.b64encode(pair.encode()).decode()}"


def display_url(url: str) -> str:
    """The URL without user:password (never let credentials reach a row or a log line)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))
