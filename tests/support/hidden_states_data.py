"""Small, deterministic inputs for tests and benchmarks: a tiny verifier and a fabricated responses partition.

``tiny_verifier`` is the project's own ``eagle3_assets.local.tiny_model.build_tiny_model`` (a random-weight
Llama plus a BPE tokenizer trained on local text), cached once per machine by ``cached_tiny_verifier``.
"""

from __future__ import annotations

import random
from pathlib import Path

from eagle3_assets.storage import DataLayout, write_parquet_atomic

_TEXT = (
    "the a of to and in is it that for on with as was by this be are from at or an which have not but "
    "model token draft verifier layer hidden state train loss mask batch step epoch vocab answer think "
    "prompt reason first then next because so we can see value sum two three four five six seven eight"
)
_WORDS = _TEXT.split()


def tiny_verifier(
    out_dir: Path, seed: int = 0, num_layers: int = 4, hidden_size: int = 64, vocab_size: int = 1024
) -> Path:
    """A tiny random verifier folder (model + tokenizer with a reasoning chat template); built once per folder."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    from eagle3_assets.local.tiny_model import build_tiny_model

    return Path(
        build_tiny_model(out_dir, seed=seed, num_layers=num_layers, hidden_size=hidden_size, vocab_size=vocab_size)
    )


def cached_tiny_verifier(seed: int = 0, num_layers: int = 4, hidden_size: int = 64, vocab_size: int = 1024) -> Path:
    """``tiny_verifier`` built once per machine under the temp dir (tests and benchmarks share it).

    Built into a private folder and renamed into place, so concurrent test runs never see half a model.
    """
    import os
    import shutil
    import tempfile

    cache = Path(tempfile.gettempdir()) / "eagle3-assets-cache"
    final = cache / f"tiny-verifier-s{seed}-l{num_layers}-h{hidden_size}-v{vocab_size}"
    if (final / "config.json").exists():
        return final
    staging = cache / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    tiny_verifier(staging, seed=seed, num_layers=num_layers, hidden_size=hidden_size, vocab_size=vocab_size)
    try:
        os.rename(staging, final)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return final


def fabricate_responses(
    layout: DataLayout,
    partition_key: str,
    n: int,
    seed: int = 0,
    failed_every: int = 0,
    min_words: int = 30,
    max_words: int = 80,
) -> Path:
    """Write a ``synthetic_responses`` partition with the production columns; every ``failed_every``-th failed."""
    import polars as pl

    rng = random.Random(f"{partition_key}-{seed}")

    def words(k: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(k))

    rows = []
    for i in range(n):
        failed = failed_every > 0 and i % failed_every == failed_every - 1
        messages = [{"role": "user", "content": words(rng.randint(5, 20))}]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": words(6)})
        rows.append(
            {
                "sample_id": f"{partition_key}-{i:05d}",
                "messages": messages,
                "reasoning": None if failed or i % 4 == 1 else words(rng.randint(min_words, max_words) // 2),
                "content": None if failed else words(rng.randint(min_words, max_words)),
                "status": "failed" if failed else "ok",
                "finish_reason": None if failed else ("length" if i % 7 == 3 else "stop"),
            }
        )
    schema = {
        "sample_id": pl.String,
        "messages": pl.List(pl.Struct({"role": pl.String, "content": pl.String})),
        "reasoning": pl.String,
        "content": pl.String,
        "status": pl.String,
        "finish_reason": pl.String,
    }
    frame = pl.DataFrame(rows, schema=schema)
    path = layout.responses_path(partition_key)
    write_parquet_atomic(frame, path)
    return path
