"""A stub chat-completions server for the online-evaluation tests: a request handler to serve with
``support.common.stub_http_server``, answering each POST with what the test's :meth:`ChatHandler.answer` returns."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any

from support.common import send_json


def chat_completion(
    model: str, content: str, token_ids: list[int], finish_reason: str, speculative: dict | None = None
) -> dict[str, Any]:
    """A chat.completion reply as vLLM writes it: one choice with its token ids, the usage of a 3-token prompt and,
    where ``speculative`` is given, vLLM's per-request ``metrics.speculative_decoding``."""
    reply: dict[str, Any] = {
        "id": "x",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": finish_reason,
                "token_ids": token_ids,
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": len(token_ids), "total_tokens": 3 + len(token_ids)},
    }
    if speculative is not None:
        reply["metrics"] = {"speculative_decoding": speculative}
    return reply


class ChatHandler(BaseHTTPRequestHandler):
    """Silent; each POST's JSON body goes to :meth:`answer`, whose reply is sent as a 200 (None: it replied itself)."""

    def log_message(self, *_args: object) -> None:
        pass

    def answer(self, request: dict[str, Any]) -> dict[str, Any] | None:
        raise NotImplementedError

    def do_POST(self) -> None:
        reply = self.answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        if reply is not None:
            send_json(self, reply)
