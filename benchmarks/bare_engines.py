"""The bare engines the project's stages are measured against: what a one-off script would do with the same library.

- :func:`bare_generation`: an ``AsyncOpenAI`` client holding ``concurrency`` chat requests in flight (a semaphore),
  nothing written: the rate the vLLM server gives a client with no bookkeeping.
- :func:`bare_forward`: transformers' ``model(input_ids, attention_mask, output_hidden_states=True)`` over the same
  token sequences in the same length-bucketed batches, nothing kept.
- :func:`bare_training`: speculators' draft, dataset, collate and packing sampler, and per step forward, backward,
  clip, AdamW step (under the same bf16 autocast where the project uses it), nothing else.

``hidden_states_throughput.py``, ``training_step.py`` (the tiny verifier) and ``engine_ratio.py`` (a real model and
its data) set the project's stages beside these.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def bare_generation(
    base_url: str, model: str, prompts: Sequence[list[dict[str, Any]]], concurrency: int, max_tokens: int
) -> tuple[int, float]:
    """(completion tokens, wall seconds) of greedy answers to every prompt, ``concurrency`` requests in flight."""
    import openai

    async def run_all() -> int:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="no-key", timeout=3600.0, max_retries=0)
        gate = asyncio.Semaphore(concurrency)

        async def one(messages: list[dict[str, Any]]) -> int:
            async with gate:
                reply = await client.chat.completions.create(
                    model=model,
                    messages=messages,
                    temperature=0.0,
                    max_tokens=max_tokens,  # type: ignore[arg-type]
                )
            return reply.usage.completion_tokens if reply.usage else 0

        try:
            return sum(await asyncio.gather(*(one(m) for m in prompts)))
        finally:
            await client.close()

    started = time.perf_counter()
    tokens = asyncio.run(run_all())
    return tokens, time.perf_counter() - started


def bare_forward(
    model: Any, ids: Sequence[Sequence[int]], batches: Sequence[Sequence[int]], threads: int | None
) -> float:
    """Tokens/s of the verifier's forward pass with every hidden state returned, over ``batches`` of ``ids``."""
    import torch

    from eagle3_assets.hidden_states.backends import torch_threads

    tokens = sum(len(ids[i]) for batch in batches for i in batch)
    device = next(model.parameters()).device
    started = time.perf_counter()
    with torch_threads(threads), torch.inference_mode():
        for batch in batches:
            longest = max(len(ids[i]) for i in batch)
            input_ids = torch.zeros((len(batch), longest), dtype=torch.long)
            mask = torch.zeros_like(input_ids)
            for row, i in enumerate(batch):
                input_ids[row, : len(ids[i])] = torch.tensor(ids[i])
                mask[row, : len(ids[i])] = 1
            model(input_ids=input_ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - started)


def bare_training(
    verifier: Path,
    dirs: Sequence[Path],
    meta: dict[str, Any],
    config: Any,
    steps: int,
    mapping: tuple[Any, Any] | None = None,
    bf16: bool = False,
) -> tuple[float, float]:
    """(wall, CPU) seconds per step of ``steps`` draft training steps on the packed batches of ``dirs``'s hidden
    states: the draft the project builds (``config``: a TrainConfig; ``mapping``: the vocab mapping's d2t, t2d)."""
    import torch

    from eagle3_assets.hidden_states.backends import torch_threads
    from eagle3_assets.training.data import make_loader, to_device
    from eagle3_assets.training.model import build_draft, trainer_kwargs

    layer_ids, hidden_size = list(meta["layer_ids"]), int(meta["hidden_size"])
    device = torch.device("cpu")
    with torch_threads(config.num_threads):
        torch.manual_seed(0)
        model = build_draft(verifier, layer_ids, config, mapping)
        model.train()
        kwargs = trainer_kwargs(config)
        dtype = torch.bfloat16 if bf16 else torch.float32
        loader = make_loader(
            list(dirs), config.tokens_per_batch, hidden_size, len(layer_ids), dtype, 0, loss_on=config.loss_on
        )
        loader.batch_sampler.set_epoch(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        done = 0
        started, cpu_started = time.perf_counter(), time.process_time()
        for batch in loader:
            if done >= steps:
                break
            autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
            with autocast:
                _tokens, loss, _metrics = model(**to_device(batch, device), **kwargs)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            done += 1
        return (time.perf_counter() - started) / done, (time.process_time() - cpu_started) / done
