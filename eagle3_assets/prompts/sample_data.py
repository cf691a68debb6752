"""The shipped sample dataset: varied prompts made here, so the demo needs no dataset hub.

``python -m eagle3_assets.prompts.sample_data OUT.jsonl`` rebuilds ``eagle3_assets/data/sample_prompts.jsonl``
byte for byte (seeded). It mixes math, code, chat, reasoning and multi-turn prompts in all three row
shapes the loader reads (OpenAI ``messages``, ShareGPT ``conversations``, plain ``prompt``).

``fabricate_responses`` writes a ``synthetic_responses`` partition of made-up answers, so the later stages
(hidden states, training) can be measured without a server: the benchmarks and the GPU check run on it.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
from collections.abc import Callable
from pathlib import Path

from eagle3_assets.core.settings import SAMPLE_PROMPTS_PATH
from eagle3_assets.core.storage import DataLayout, write_parquet_atomic
from eagle3_assets.prompts.conversations import normalize_row

DEFAULT_COUNT = 3000
DEFAULT_SEED = 0


@functools.cache
def _vocabulary() -> dict[str, list[str]]:
    """The words the prompts are made of (data, kept beside the sample they build): read once, on first use, not at
    import (the CLI imports this module for every command)."""
    return json.loads((SAMPLE_PROMPTS_PATH.parent / "sample_vocabulary.json").read_text("utf-8"))


def _words(slot: str) -> list[str]:
    return _vocabulary()[slot]


def _math(rng: random.Random) -> str:
    kind = rng.randrange(5)
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    if kind == 0:
        return f"What is {a} * {b} + {c}? Show your work."
    if kind == 1:
        return f"Solve for x: {c}x + {a} = {b + a * c}."
    if kind == 2:
        name = rng.choice(_words("names"))
        item = rng.choice(_words("items"))
        return f"{name} has {a} {item} and gives away {min(a, b)} of them, then buys {c} more. How many {item} now?"
    if kind == 3:
        return f"What is the sum of all integers from 1 to {a * c}?"
    return f"A rectangle has a perimeter of {2 * (a + b)} and one side of length {a}. What is its area?"


def _code(rng: random.Random) -> str:
    lang, task = rng.choice(_words("langs")), rng.choice(_words("tasks"))
    style = rng.choice(["", " Include tests.", " Explain its time complexity.", " Keep it under 20 lines."])
    return f"Write a {lang} function that {task}.{style}"


def _chat(rng: random.Random) -> str:
    template = rng.choice(_words("chat"))
    a, b = rng.sample(_words("foods"), 2)
    return template.format(
        adj=rng.choice(_words("adj")),
        pet=rng.choice(_words("pets")),
        a=a,
        b=b,
        topic=rng.choice(_words("topics")),
        day=rng.choice(_words("days")),
        city=rng.choice(_words("cities")),
    )


def _reasoning(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        x, y = rng.sample(_words("names"), 2)
        return f"{x} is taller than {y}. {y} is taller than Kim. Is Kim taller than {x}? Explain your reasoning."
    if kind == 1:
        n = rng.randint(3, 9)
        return (
            f"If {n} machines make {n} widgets in {n} minutes, "
            f"how long do {n * 20} machines take to make {n * 20} widgets?"
        )
    if kind == 2:
        topic, audience = rng.choice(_words("topics")), rng.choice(_words("audiences"))
        return f"Explain {topic} to {audience}, reasoning about what they already know."
    a = rng.randint(10, 60)
    return (
        f"A train leaves at 9:00 going {a} km/h; another leaves at 10:00 going {a + 20} km/h "
        "on the same track. When does the second catch up?"
    )


_MAKERS: list[tuple[str, Callable[[random.Random], str]]] = [
    ("math", _math),
    ("code", _code),
    ("chat", _chat),
    ("reasoning", _reasoning),
]


def _row(index: int, rng: random.Random) -> dict[str, object]:
    category, make = _MAKERS[index % len(_MAKERS)]
    shape = rng.random()
    multi_turn = index % 7 == 3
    sample_id = f"sample-{index:05d}-{category}"
    if multi_turn:
        first, follow_up = (
            make(rng),
            rng.choice(_words("follow_ups")),
        )
        turns = [("user", first), ("assistant", "Here is a first answer: " + first.lower()[:80]), ("user", follow_up)]
    else:
        turns = [("user", make(rng))]
    if shape < 0.5:
        messages = [{"role": r, "content": t} for r, t in turns]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": rng.choice(_words("systems"))})
        return {"id": sample_id, "messages": messages}
    if shape < 0.8 or multi_turn:
        names = {"user": "human", "assistant": "gpt"}
        return {"id": sample_id, "conversations": [{"from": names[r], "value": t} for r, t in turns]}
    return {"prompt": turns[0][1]} if rng.random() < 0.3 else {"id": sample_id, "prompt": turns[0][1]}


def make_sample_rows(count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED) -> list[dict[str, object]]:
    rng = random.Random(seed)
    rows, seen = [], set()
    index = 0
    while len(rows) < count:
        row = _row(index, rng)
        index += 1
        key = normalize_row(row)[2]
        if key in seen:  # the shipped sample has no duplicates; the loader's dedupe is tested separately
            continue
        seen.add(key)
        rows.append(row)
    return rows


def write_sample(path: Path, count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for row in make_sample_rows(count, seed):
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def fabricate_responses(
    layout: DataLayout,
    partition_key: str,
    n: int,
    seed: int = DEFAULT_SEED,
    failed_every: int = 0,
    min_words: int = 30,
    max_words: int = 80,
) -> Path:
    """Write a ``synthetic_responses`` partition with the production columns; every ``failed_every``-th failed."""
    # lazy: loads polars (heavy), which only this path needs
    import polars as pl

    rng = random.Random(f"{partition_key}-{seed}")

    def words(k: int) -> str:
        return " ".join(rng.choice(_words("response_words")) for _ in range(k))

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
    path = layout.responses_path(partition_key)
    write_parquet_atomic(pl.DataFrame(rows, schema=schema), path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, default=DEFAULT_COUNT)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_sample(args.out, args.count, args.seed)


if __name__ == "__main__":
    main()
