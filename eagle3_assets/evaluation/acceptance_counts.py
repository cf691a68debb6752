"""The online evaluation's responses, acceptance counted from vLLM's per-request speculative metrics
(``metrics.speculative_decoding``), and two views of it beyond one greedy figure: by prompt length, and sampling.

vLLM reports per request a histogram of verify steps by how many draft tokens each accepted; summing those over a
batch gives the batch's acceptance, and summing them over a subset of its requests gives that subset's. So the
acceptance of short, medium and long prompts comes from the same responses as the batch's figure, with no extra
requests. Sampled acceptance (temperature > 0) is vLLM's rejection sampling: a draft token is kept with probability
min(1, p_verifier / p_draft), so a draft that matches the verifier's distribution, not only its argmax, keeps more.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.core.hashing import digest
from eagle3_assets.local import accelerator

# prompt tokens: [low, high) per bucket; None: no upper bound
PROMPT_LENGTH_BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("short", 0, 256),
    ("medium", 256, 1024),
    ("long", 1024, None),
)


@dataclass
class Generation:
    sample_id: str
    token_ids: list[int] | None
    text: str  # reasoning + "\x00" + content: the comparison falls back on it without token ids
    completion_tokens: int
    finish_reason: str | None
    speculative: dict[str, Any] | None = None  # the response's metrics.speculative_decoding, if any
    error: str | None = None  # why the request failed (no reply to count); None: it succeeded
    seconds: float | None = None  # this request's wall time, from its send to the whole reply (None: it failed)
    prompt_tokens: int | None = None  # the server's count of the rendered prompt (None: it failed)

    @property
    def failed(self) -> bool:
        return self.error is not None


@dataclass
class GenerationRun:
    generations: list[Generation]
    seconds: float  # the batch's wall time (a paired speed batch: the sum of this side's answered requests')
    counters: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tokens(self) -> int:
        return sum(g.completion_tokens for g in self.generations)

    @property
    def failures(self) -> list[Generation]:
        return [g for g in self.generations if g.failed]


def acceptance_counts(speculative: Mapping[str, Any], k: int) -> dict[str, Any]:
    """One response's ``metrics.speculative_decoding`` as counts: drafts, draft tokens, accepted, per position.

    ``acceptance_histogram[j]`` is the number of verify steps that accepted exactly j draft tokens, so the drafts
    whose first p+1 tokens were all accepted are the steps with j > p.
    """
    histogram = [int(n) for n in speculative["acceptance_histogram"]]
    if len(histogram) != k + 1:
        raise ValueError(f"acceptance_histogram has {len(histogram)} bins for num_speculative_tokens={k}")
    return {
        "drafts": sum(histogram),
        "draft_tokens": int(speculative["num_draft_tokens"]),
        "accepted": sum(j * n for j, n in enumerate(histogram)),
        "per_position": [sum(histogram[p + 1 :]) for p in range(k)],
    }


def summed_counts(responses: Iterable[Generation], k: int) -> dict[str, Any]:
    """Acceptance counts over these responses (zero for a server without a draft)."""
    total: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": [0] * k}
    for response in responses:
        if response.speculative is None:
            continue
        one = acceptance_counts(response.speculative, k)
        for name in ("drafts", "draft_tokens", "accepted"):
            total[name] += one[name]
        total["per_position"] = [a + b for a, b in zip(total["per_position"], one["per_position"], strict=True)]
    return total


def mean_acceptance_length(counts: Mapping[str, Any]) -> float | None:
    """1 + accepted tokens per draft (the tokens each verify step yields); None without a draft."""
    return 1.0 + counts["accepted"] / counts["drafts"] if counts["drafts"] else None


def summary(responses: Sequence[Generation], k: int) -> dict[str, Any]:
    """Requests, drafts, accepted tokens and the mean acceptance length of these responses."""
    counts = summed_counts(responses, k)
    return {
        "prompts": len(responses),
        "drafts": counts["drafts"],
        "accepted": counts["accepted"],
        "mean_acceptance_length": mean_acceptance_length(counts),
    }


def _within(tokens: int | None, low: int, high: int | None) -> bool:
    return tokens is not None and low <= tokens and (high is None or tokens < high)


def by_prompt_length(responses: Sequence[Generation], k: int) -> dict[str, dict[str, Any]]:
    """:func:`summary` of each :data:`PROMPT_LENGTH_BUCKETS` bucket (responses that report no prompt tokens, as a
    failed request, fall in none); a bucket with no response is left out."""
    out = {}
    for name, low, high in PROMPT_LENGTH_BUCKETS:
        members = [r for r in responses if _within(r.prompt_tokens, low, high)]
        if members:
            out[name] = {"low": low, "high": high, **summary(members, k)}
    return out


def _span(low: int, high: int | None) -> str:
    return f"{low}+" if high is None else f"{low}-{high - 1}"


def _mal(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def breakdown_line(prompt_set: str, label: str, greedy: float, extra: Mapping[str, Any]) -> str | None:
    """The report's line for one draft on one prompt set: greedy beside sampled acceptance, and by prompt length
    (None when the evaluation measured neither)."""
    parts = []
    sampled = extra.get("sampled")
    if sampled:
        parts.append(
            f"mean acceptance length {greedy:.3f} greedy, {_mal(sampled['mean_acceptance_length'])} at temperature "
            f"{sampled['temperature']:g} (vLLM's rejection sampling, {sampled['drafts']:,} drafts over "
            f"{sampled['prompts']} prompts{'' if sampled.get('seeded', True) else ', unseeded on a CPU vLLM'})"
        )
    buckets = extra.get("by_prompt_length") or {}
    if buckets:
        shown = [
            f"{name} ({_span(b['low'], b['high'])} tokens, {b['prompts']} prompts) {_mal(b['mean_acceptance_length'])}"
            for name, b in buckets.items()
        ]
        parts.append("greedy by prompt length: " + ", ".join(shown))
    return f"- {prompt_set}, {label} draft: " + "; ".join(parts) if parts else None


def seeds_requests(python: Path | None, server_given: bool) -> bool:
    """Whether the sampled batch seeds each request: not on a local CPU build of vLLM (``python``, the interpreter of
    the local servers; ``accelerator.seeds_safe``). A server given by URL is taken to be a GPU's."""
    return server_given or accelerator.seeds_safe(accelerator.vllm_build(python))


def request_seed(sample_id: str) -> int:
    """A sampled request's seed, from its sample id: the same prompt draws the same way in every run."""
    return int(digest(sample_id, 8), 16)
