"""How many bytes a reply body may have, from the request that asked for it (every stage that reads a server's reply).

Generation and the vLLM hidden-states backend cap every body they read at :func:`reply_limit`'s size, as it arrives
(``net/bounded_http.py``), so a runaway server or a lying proxy fails one request instead of filling memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# What one reply may weigh, from its request. Generous on purpose: an honest reply is far below it, so only a runaway
# server or a lying proxy (a body that never ends) reaches it; it exists so that such a body fails its request
# instead of growing the run's memory until the machine runs out.
REPLY_ALLOWANCE_BYTES = 2**20  # any reply's envelope, usage, an error body, the chat template's own tokens
TOKEN_BYTES = 256  # one completion token of a plain reply: its text JSON-escaped (up to 6 bytes a char), its id
# ... of a stream, where every token may come in its own SSE event (vLLM's is ~250 bytes with token ids and a short
# model name: id, created, model, delta, finish_reason, the "data: " and blank-line framing)
SSE_TOKEN_BYTES = 1024
PROMPT_ID_BYTES = 16  # prompt_token_ids: a token takes at least one byte of the request body, its id a short number
LOGPROB_BYTES = 256  # one logprob entry (token, logprob, bytes), when the extra sampling fields ask for logprobs


@dataclass(frozen=True)
class ReplyLimit:
    """The most bytes a reply body may have: ``fixed`` plus ``per_request_byte`` per byte of the request body
    (the prompt's token ids, and prompt logprobs if asked for, come back in the reply)."""

    fixed: int
    per_request_byte: int

    def bytes_for(self, request: bytes) -> int:
        return self.fixed + self.per_request_byte * len(request)


def _count_field(extra: Mapping[str, Any], name: str) -> int:
    value = extra.get(name)
    return value if type(value) is int and value > 0 else 0


def reply_limit(max_tokens: int, stream: bool, extra_sampling: Mapping[str, Any]) -> ReplyLimit:
    """The size limit of the replies to a run's requests, from what they ask for (see :data:`TOKEN_BYTES`)."""
    per_token = SSE_TOKEN_BYTES if stream else TOKEN_BYTES
    if extra_sampling.get("logprobs"):
        per_token += (1 + _count_field(extra_sampling, "top_logprobs")) * LOGPROB_BYTES
    per_request_byte = PROMPT_ID_BYTES
    if extra_sampling.get("prompt_logprobs") is not None:
        per_request_byte += (1 + _count_field(extra_sampling, "prompt_logprobs")) * LOGPROB_BYTES
    return ReplyLimit(REPLY_ALLOWANCE_BYTES + per_token * max_tokens, per_request_byte)
