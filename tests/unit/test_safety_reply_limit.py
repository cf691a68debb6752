"""The reply size limit (issue 31, clause 5) is generous: an honest reply of ``max_tokens`` tokens, streamed one
token per SSE event under a long model name with every token id, stays far inside it, and both transports return
it; the limit only grows with what a request asks to get back (logprobs)."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest

from eagle3_assets.generation import GenerationConfig
from eagle3_assets.generation.replies import Completion, build_body
from eagle3_assets.generation.transport import make_transports
from eagle3_assets.net.reply_limits import REPLY_ALLOWANCE_BYTES, ReplyLimit, reply_limit
from fake_vllm import FakeConfig, serve_in_thread

MAX_TOKENS = 500
# a served name as long as a deep model path: every SSE event repeats it
MODEL = "org/" + "a-very-long-served-model-name-" * 4


def _raw_reply(url: str, body: bytes) -> bytes:
    request = urllib.request.Request(f"{url}/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read()


@pytest.mark.parametrize("transport", ["aiohttp", "openai"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_an_honest_reply_of_max_tokens_is_far_inside_its_limit(stream: bool, transport: str) -> None:
    # 800 tokens/s produced, a chunk every 0.1 ms: few tokens per SSE event
    fake = FakeConfig(model=MODEL, token_rate=800, stream_interval_s=0.0001, median_tokens=10 * MAX_TOKENS)
    messages = [{"role": "user", "content": f"[[fake_tokens={MAX_TOKENS}]] a long answer, please"}]
    fields = {"max_tokens": MAX_TOKENS, "return_token_ids": True}
    body = build_body(MODEL, messages, fields, stream)
    limit = reply_limit(MAX_TOKENS, stream, {})
    with serve_in_thread(fake) as url:
        raw = _raw_reply(url, body)
        config = GenerationConfig(
            base_urls=[url], model=MODEL, transport=transport, stream=stream, max_tokens=MAX_TOKENS
        )
        transports = make_transports(config)

        async def complete() -> Completion:
            try:
                return await transports[url].complete(body, stream=stream, deadline_s=30)
            finally:
                await transports[url].close()

        completion = asyncio.run(complete())
    assert completion.completion_tokens == MAX_TOKENS and completion.finish_reason == "length"
    # the heaviest stream sends each token in its own event: an event's average size (one or more tokens, as the
    # timing gave them) times the tokens bounds it whatever the chunking
    heaviest = len(raw) / raw.count(b"data: ") * MAX_TOKENS if stream else len(raw)
    # without its fixed allowance the limit still holds that reply twice over (about 3x under this long model name,
    # 20x for a plain reply)
    assert 2 * heaviest < limit.bytes_for(body) - REPLY_ALLOWANCE_BYTES, (heaviest, limit)


def test_the_limit_grows_with_the_logprobs_a_request_asks_for() -> None:
    def per_token(limit: ReplyLimit) -> float:
        return (limit.fixed - REPLY_ALLOWANCE_BYTES) / MAX_TOKENS

    plain = reply_limit(MAX_TOKENS, False, {})
    with_logprobs = reply_limit(MAX_TOKENS, False, {"logprobs": True, "top_logprobs": 20})
    with_prompt_logprobs = reply_limit(MAX_TOKENS, False, {"prompt_logprobs": 5})
    assert per_token(with_logprobs) > 10 * per_token(plain)  # 21 entries a token
    assert with_logprobs.per_request_byte == plain.per_request_byte
    assert with_prompt_logprobs.per_request_byte > 5 * plain.per_request_byte  # 6 entries a prompt token
    assert per_token(reply_limit(MAX_TOKENS, True, {})) > per_token(plain)  # a stream's framing
