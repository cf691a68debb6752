"""Online acceptance: the draft in vLLM's EAGLE-3 speculative decoding, counted from the evaluation's own requests.

The same held-out prompts go, at temperature 0, to the plain verifier and to the verifier with each draft
(``--speculative-config {"method": "eagle3", "model": DRAFT, "num_speculative_tokens": k}``), one server at a
time so their tokens/s are measured on an otherwise identical machine. Acceptance is summed from the per-request
speculative metrics each response carries (``metrics.speculative_decoding``: vLLM's
``--per-request-spec-decode-metrics summary``), never from the server-wide ``/metrics`` counters, which every other
client of a shared server moves too. The servers the evaluation starts itself get that flag; a server given by URL
must have it, or the evaluation stops saying so. Requests carry the API key of the generation setting. Greedy outputs
with a draft must equal the plain verifier's token for token: speculative decoding is lossless at temperature 0, so
any difference is a bug (in the draft's config, the engine, or the comparison) and is reported per prompt.

Requests go out ``concurrency`` at a time (default 1: speculative decoding pays off when decoding is latency-bound,
and one sequence at a time makes tokens/s comparable between runs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.evaluation.report import AcceptanceStats
from eagle3_assets.generation.config import display_url
from eagle3_assets.storage import DataLayout

logger = logging.getLogger(__name__)

# vLLM's flag for per-request acceptance in each response body (``summary``: the histogram, no per-step arrays)
PER_REQUEST_METRICS_ARGS = ("--per-request-spec-decode-metrics", "summary")


@dataclass(frozen=True)
class Prompt:
    sample_id: str
    messages: list[dict[str, str]]


@dataclass
class Generation:
    sample_id: str
    token_ids: list[int] | None
    text: str  # reasoning + "\x00" + content: the comparison falls back on it without token ids
    completion_tokens: int
    finish_reason: str | None
    speculative: dict[str, Any] | None = None  # the response's metrics.speculative_decoding, if any


@dataclass
class GenerationRun:
    generations: list[Generation]
    seconds: float
    counters: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tokens(self) -> int:
        return sum(g.completion_tokens for g in self.generations)


@dataclass
class OnlineConfig:
    k: int = 3
    prompts: int = 32
    max_tokens: int = 128
    concurrency: int = 1
    max_model_len: int = 1024
    request_timeout_s: float = 600.0
    python: Path | None = None  # the vLLM interpreter (default: $EAGLE3_VLLM_PYTHON or .venv-vllm)
    log_dir: Path | None = None
    # servers already running (e.g. a GPU box): the plain verifier, and a verifier serving the trained draft
    plain_url: str | None = None
    draft_url: str | None = None
    served_model_name: str | None = None  # model id on those servers; default: the verifier folder's name
    api_key: str | None = field(default=None, repr=False)  # for servers given by URL; never logged


def held_out_prompts(layout: DataLayout, partition_key: str, n: int) -> list[Prompt]:
    """The first ``n`` prompts of the held-out partition of raw_prompts (in dataset order)."""
    import polars as pl

    if not layout.prompts_path.exists():
        raise FileNotFoundError(f"no raw_prompts at {layout.prompts_path}: materialize raw_prompts first")
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


def summed_counts(generations: Sequence[Generation], k: int) -> dict[str, Any]:
    """Acceptance counts over this evaluation's own responses (zero for a server without a draft)."""
    total: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": [0] * k}
    for g in generations:
        if g.speculative is None:
            continue
        one = acceptance_counts(g.speculative, k)
        for name in ("drafts", "draft_tokens", "accepted"):
            total[name] += one[name]
        total["per_position"] = [a + b for a, b in zip(total["per_position"], one["per_position"], strict=True)]
    return total


def generate(base_url: str, model: str, prompts: Sequence[Prompt], config: OnlineConfig) -> GenerationRun:
    """Greedy completions of every prompt, ``concurrency`` at a time; wall time of the whole batch.

    The requests run on an event loop that a stop request (SIGINT, SIGTERM, Dagster's terminate) cancels
    (:func:`eagle3_assets.interrupts.run_interruptible`): the batch ends within seconds, its connections closed,
    instead of waiting for every request in flight and every one queued (what a thread pool did).
    """
    import openai

    from eagle3_assets.interrupts import run_interruptible

    # vLLM without --api-key accepts any key; the openai client insists on one
    api_key = config.api_key or "no-key"

    async def run_all() -> list[Generation]:
        import asyncio

        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=config.request_timeout_s, max_retries=0)
        gate = asyncio.Semaphore(max(1, config.concurrency))

        async def one(prompt: Prompt) -> Generation:
            async with gate:
                response = await client.chat.completions.create(
                    model=model,
                    messages=prompt.messages,  # type: ignore[arg-type]
                    temperature=0,
                    max_tokens=config.max_tokens,
                    extra_body={"return_token_ids": True},
                )
            return _generation(prompt, response)

        try:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        finally:
            await client.close()

    started = time.perf_counter()
    generations = run_interruptible(run_all())
    return GenerationRun(generations, time.perf_counter() - started)


def _generation(prompt: Prompt, response: Any) -> Generation:
    choice = response.choices[0]
    extra = choice.model_extra or {}
    token_ids = extra.get("token_ids")
    message = choice.message
    reasoning = getattr(message, "reasoning", None) or (message.model_extra or {}).get("reasoning") or ""
    usage = response.usage
    metrics = (response.model_extra or {}).get("metrics") or {}
    return Generation(
        sample_id=prompt.sample_id,
        token_ids=list(token_ids) if token_ids is not None else None,
        text=f"{reasoning}\x00{message.content or ''}",
        completion_tokens=int(usage.completion_tokens) if usage else len(token_ids or []),
        finish_reason=choice.finish_reason,
        speculative=metrics.get("speculative_decoding") if isinstance(metrics, dict) else None,
    )


def mismatched(reference: Sequence[Generation], other: Sequence[Generation]) -> list[str]:
    """Sample ids whose greedy output differs (token ids when both have them, else the text)."""
    bad = []
    for a, b in zip(reference, other, strict=True):
        same = a.token_ids == b.token_ids if a.token_ids is not None and b.token_ids is not None else a.text == b.text
        if not same:
            bad.append(a.sample_id)
    return bad


def _measure(
    base_url: str, model: str, prompts: Sequence[Prompt], config: OnlineConfig, speculative: bool = False
) -> GenerationRun:
    """Generate and count acceptance from these responses; a draft server must report it per request."""
    run = generate(base_url, model, prompts, config)
    if speculative:
        without = [g.sample_id for g in run.generations if g.speculative is None]
        if without:
            raise RuntimeError(
                f"{display_url(base_url)} returned no per-request speculative metrics (metrics.speculative_decoding) "
                f"for {len(without)} of {len(run.generations)} requests: start that vLLM with "
                f"{' '.join(PER_REQUEST_METRICS_ARGS)}, or leave its URL empty so the evaluation starts its own "
                "server (server-wide /metrics counters are not used: other clients move them)"
            )
    run.counters = summed_counts(run.generations, config.k)
    return run


def _stats(label: str, k: int, run: GenerationRun) -> AcceptanceStats:
    c = run.counters
    return AcceptanceStats(
        label=label,
        method="online",
        k=k,
        drafts=c["drafts"],
        draft_tokens=c["draft_tokens"],
        accepted_tokens=c["accepted"],
        accepted_per_position=list(c["per_position"]),
        output_tokens=run.output_tokens,
        seconds=run.seconds,
        extra={"truncated": sum(1 for g in run.generations if g.finish_reason == "length")},
    )


def _local_server(verifier: Path, config: OnlineConfig, name: str, draft: Path | None) -> Any:
    from eagle3_assets.local.vllm_server import LocalVLLMServer, VLLMServerConfig, find_free_port

    spec = None
    if draft is not None:
        spec = {"method": "eagle3", "model": str(Path(draft).resolve()), "num_speculative_tokens": config.k}
    return LocalVLLMServer(
        VLLMServerConfig(
            model=verifier,
            served_model_name=name,
            port=find_free_port(),
            python=config.python,
            max_model_len=config.max_model_len,
            speculative_config=spec,
            log_dir=config.log_dir,
            extra_args=PER_REQUEST_METRICS_ARGS if draft is not None else (),
        )
    )


@dataclass
class OnlineResult:
    stats: list[AcceptanceStats]
    baseline: GenerationRun
    mismatches: dict[str, list[str]]
    startup_s: dict[str, float]


def evaluate_online(
    verifier: Path,
    drafts: Mapping[str, Path],
    prompts: Sequence[Prompt],
    config: OnlineConfig,
    log: Callable[[str], None] | None = None,
) -> OnlineResult:
    """Plain verifier, then the verifier with each draft (label -> speculators draft folder), on the same prompts.

    With ``config.plain_url`` / ``config.draft_url`` set, those servers are used (the trained draft is the first
    label); every other one is started locally and stopped after its batch.
    """
    say = log or logger.info
    name = config.served_model_name or Path(verifier).name
    startup: dict[str, float] = {}

    def run_on(label: str, draft: Path | None, url: str | None) -> GenerationRun:
        if url is not None:
            say(f"online [{label}]: using the server at {display_url(url)}")
            return _measure(url, name, prompts, config, speculative=draft is not None)
        say(f"online [{label}]: starting vLLM on {verifier}" + (f" with draft {draft}" if draft else ""))
        with _local_server(verifier, config, name, draft) as server:
            startup[label] = round(float(server.startup_s or 0.0), 1)
            say(f"online [{label}]: ready in {startup[label]:.0f} s; generating {len(prompts)} prompts")
            return _measure(server.base_url, name, prompts, config, speculative=draft is not None)

    baseline = run_on("plain", None, config.plain_url)
    say(f"online [plain]: {baseline.output_tokens} tokens in {baseline.seconds:.1f} s")
    stats: list[AcceptanceStats] = []
    mismatches: dict[str, list[str]] = {}
    for i, (label, draft) in enumerate(drafts.items()):
        run = run_on(label, Path(draft), config.draft_url if i == 0 else None)
        s = _stats(label, config.k, run)
        mismatches[label] = mismatched(baseline.generations, run.generations)
        say(
            f"online [{label}]: mean acceptance length {s.mean_acceptance_length:.3f} over {s.drafts} drafts, "
            f"{run.output_tokens} tokens in {run.seconds:.1f} s, {len(mismatches[label])} greedy mismatches"
        )
        stats.append(s)
    return OnlineResult(stats=stats, baseline=baseline, mismatches=mismatches, startup_s=startup)
