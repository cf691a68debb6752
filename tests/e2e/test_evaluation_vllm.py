"""draft_evaluation against the real CPU vLLM: greedy outputs with an EAGLE-3 draft equal the plain verifier's, and the
per-request speculative metrics the online evaluation counts (a server started with a draft reports them, greedy and
sampled).

The plain server is the session's shared ``vllm_server``; the speculative one needs its own start (~130 s).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from eagle3_assets.evaluation.acceptance_counts import by_prompt_length, seeds_requests
from eagle3_assets.evaluation.online_metrics import (
    OnlineConfig,
    Prompt,
    acceptance_stats,
    local_server,
    measure,
    mismatched,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

K = 3
PROMPTS = [
    "Explain how a hash map handles collisions.",
    "Write a haiku about the sea.",
    "What is 17 * 23? Show your work.",
    "Summarize the causes of the French revolution in three sentences.",
]
CHUNKED_TEXT = "Count the words in this text: " + "apple banana cherry " * 50  # ~400 tokens


def test_greedy_identity_with_and_without_a_draft(vllm_server, tiny_model_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import torch

    from eagle3_assets.training import TrainConfig
    from eagle3_assets.training.model import build_draft

    # An untrained draft (seeded) is the hardest case for identity: almost every proposal is rejected, so every
    # output token comes from the verifier's correction path.
    torch.manual_seed(0)
    draft_dir = tmp_path / "draft"
    build_draft(tiny_model_dir, [1, 2, 3], TrainConfig(ttt_steps=K), None).save_pretrained(str(draft_dir))

    prompts = [Prompt(f"p{i}", [{"role": "user", "content": text}]) for i, text in enumerate(PROMPTS)]
    config = OnlineConfig(
        k=K, max_tokens=64, concurrency=2, python=vllm_server.config.python, log_dir=tmp_path / "logs"
    )
    plain = measure(vllm_server.base_url, vllm_server.model_name, prompts, config)  # no draft: no spec metrics
    assert plain.counters["drafts"] == 0  # no speculation on the plain server
    with local_server(tiny_model_dir, config, vllm_server.model_name, draft_dir) as server:
        spec = measure(server.base_url, server.model_name, prompts, config, speculative=True)
        # sampling: vLLM's rejection sampling reports the same per-request metrics; seeded only where the server can
        seeded = seeds_requests(config.python, server_given=False)
        sampled = measure(server.base_url, server.model_name, prompts, config, True, 0.7, seeded)
        # 64 prompts at once hold far more prompt tokens than a step's 2,048, so vLLM prefills some in chunks: a
        # seeded request there killed the CPU engine ("CPU Generator does not use offset"), every request of make
        # demo's sampled batch then failing with a 500 (with seeds, this batch fails the same way: checked by hand)
        many = [Prompt(f"c{i}", [{"role": "user", "content": f"{i} " + CHUNKED_TEXT}]) for i in range(64)]
        at_once = replace(config, concurrency=64, max_tokens=8)
        chunked = measure(server.base_url, server.model_name, many, at_once, True, 0.7, seeded)

    assert all(g.token_ids for g in plain.generations + spec.generations), "vLLM returned no token ids"
    assert mismatched(plain.generations, spec.generations) == []
    stats = acceptance_stats("untrained", K, spec)
    assert stats.drafts > 0 and stats.draft_tokens == K * stats.drafts
    assert len(stats.accepted_per_position) == K
    assert sum(stats.accepted_per_position) == stats.accepted_tokens
    assert 1.0 <= stats.mean_acceptance_length < 1.5  # a random draft is accepted ~never

    assert not sampled.failures and sampled.counters["drafts"] > 0
    assert sum(g.prompt_tokens or 0 for g in chunked.generations) > 2048, "too short to be prefilled in chunks"
    assert not chunked.failures, chunked.failures
    assert all(g.prompt_tokens for g in spec.generations + sampled.generations), "vLLM returned no prompt tokens"
    buckets = by_prompt_length(spec.generations, K)
    assert sum(b["drafts"] for b in buckets.values()) == stats.drafts
