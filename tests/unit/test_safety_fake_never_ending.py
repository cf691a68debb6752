"""The fake server's never-ending bodies (issue 31, clause 5, the lying server of
``tests/integration/test_safety_bounded_bodies.py``): a 200 whose body trickles a byte at a time, or never ends
however fast it is read, streamed or not. Read here from a raw socket, byte counts only (nothing kept)."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest

from fake_vllm import FakeConfig, serve_in_thread

TRICKLE_INTERVAL_S = 0.1
READ_FOR_S = 1.0


def _post(url: str, stream: bool) -> socket.socket:
    parts = urlsplit(url)
    payload: dict[str, object] = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    if stream:
        payload["stream"] = True
    body = json.dumps(payload).encode()
    sock = socket.create_connection((parts.hostname, parts.port), timeout=5)
    head = f"POST {parts.path}/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)
    return sock


def _read_for(sock: socket.socket, seconds: float) -> tuple[bytes, int, bool]:
    """(the first bytes, how many arrived in ``seconds``, whether the server closed the connection)."""
    first = b""
    received = 0
    ends = time.monotonic() + seconds
    sock.settimeout(0.05)
    while time.monotonic() < ends:
        try:
            data = sock.recv(2**20)
        except TimeoutError:
            continue
        if not data:
            return first, received, True
        if len(first) < 4096:
            first += data[: 4096 - len(first)]
        received += len(data)
    return first, received, False


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("fault", ["trickle", "endless"])
def test_a_never_ending_body_starts_with_200_and_never_ends(fault: str, stream: bool) -> None:
    fake = FakeConfig(faults={fault: 1.0}, trickle_interval_s=TRICKLE_INTERVAL_S, hang_s=30)
    with serve_in_thread(fake) as url:
        sock = _post(url, stream)
        try:
            first, received, closed = _read_for(sock, READ_FOR_S)
        finally:
            sock.close()
    assert first.startswith(b"HTTP/1.1 200 ") and not closed
    head = first.split(b"\r\n\r\n", 1)[0].lower()
    assert (b"text/event-stream" if stream else b"application/json") in head
    if fault == "trickle":
        # a byte every interval: a few bytes in all, and a reader's idle timeout above the interval never fires
        assert received - len(head) < 2 * READ_FOR_S / TRICKLE_INTERVAL_S + 1024, received
        if not stream:  # an ordinary Content-Length, far above what arrives
            assert b"content-length: 4096" in head
    else:
        assert received > 4 * 2**20, received  # as fast as it is read: megabytes within a second
        assert b"transfer-encoding: chunked" in head
