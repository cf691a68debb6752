"""Online acceptance: the draft in vLLM's EAGLE-3 speculative decoding, counted from the evaluation's own requests.

The same prompts (every named prompt set: ``prompt_sets.py``) go, at temperature 0, to the plain verifier and to the
verifier with each draft (``--speculative-config {"method": "eagle3", "model": DRAFT, "num_speculative_tokens": k}``),
one server at a time so their tokens/s are measured on an otherwise identical machine. Acceptance is summed from the
per-request speculative metrics each response carries (``metrics.speculative_decoding``: vLLM's
``--per-request-spec-decode-metrics summary``), never from the server-wide ``/metrics`` counters, which every other
client of a shared server moves too. The servers the evaluation starts itself get that flag; a server given by URL
must have it, or the evaluation stops saying so. Requests carry the API key of the generation setting. Greedy outputs
with a draft must equal the plain verifier's token for token: speculative decoding is lossless at temperature 0, so
any difference is a bug (in the draft's config, the engine, or the comparison) and is reported per prompt.

Per prompt set and server, two batches: the *acceptance* batch, every prompt of the set ``concurrency`` at a time
(acceptance does not depend on the batch, so the fastest concurrency is used), and the *speed* batch, the first
``speed_prompts`` one at a time: speculative decoding pays off when decoding is latency-bound, and one sequence at a
time makes tokens/s comparable between runs. The speed-up is the speed batch's tokens/s over the plain verifier's.

Each request is bounded in time (the whole request, every byte of the reply, within ``request_timeout_s``: a server
or proxy that trickles a body stays under any per-read timeout) and in size (the reply limit of ``max_tokens``,
:func:`eagle3_assets.generation.replies.reply_limit`). A request that fails (that way, or any other) is counted as
failed (``failed`` in its stats) and in no acceptance, speed or mismatch; a batch whose every request failed stops
the evaluation naming the server and the error. Tokens/s comes only from a speed batch whose every request was
answered (``speed_failed`` 0): a batch's tokens/s is its tokens over its wall time, and a failed request adds no
tokens but keeps its time (up to ``request_timeout_s``) in the batch, so one timeout among a minute of answers would
cut that side's tokens/s, and move the speed-up, by up to ten times. Such a batch reports its answered tokens and no
time: no tokens/s, and the report withholds every speed-up over it, naming the count.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.evaluation.prompt_sets import DEFAULT_PROMPT_SETS, HELD_OUT, Prompt, held_out_prompts
from eagle3_assets.evaluation.report import AcceptanceStats
from eagle3_assets.generation.config import display_url

__all__ = ["OnlineConfig", "Prompt", "evaluate_online", "held_out_prompts"]

logger = logging.getLogger(__name__)

# vLLM's flag for per-request acceptance in each response body (``summary``: the histogram, no per-step arrays)
PER_REQUEST_METRICS_ARGS = ("--per-request-spec-decode-metrics", "summary")


@dataclass
class Generation:
    sample_id: str
    token_ids: list[int] | None
    text: str  # reasoning + "\x00" + content: the comparison falls back on it without token ids
    completion_tokens: int
    finish_reason: str | None
    speculative: dict[str, Any] | None = None  # the response's metrics.speculative_decoding, if any
    error: str | None = None  # why the request failed (no reply to count); None: it succeeded

    @property
    def failed(self) -> bool:
        return self.error is not None


@dataclass
class GenerationRun:
    generations: list[Generation]
    seconds: float
    counters: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tokens(self) -> int:
        return sum(g.completion_tokens for g in self.generations)

    @property
    def failures(self) -> list[Generation]:
        return [g for g in self.generations if g.failed]


@dataclass
class OnlineConfig:
    k: int = 3
    prompts: int = 32  # held-out prompts
    humaneval_prompts: int = 0  # HumanEval problems; 0: all 164
    max_tokens: int = 128
    # acceptance does not depend on the batch: each prompt set's acceptance batch goes out this many at a time
    concurrency: int = 64
    # tokens/s, with and without a draft, on the first N prompts of each set one at a time (batch 1: where
    # decoding is latency-bound and drafts pay off); 0: no speed measurement
    speed_prompts: int = 8
    prompt_sets: tuple[str, ...] = tuple(DEFAULT_PROMPT_SETS.split(","))
    max_model_len: int = 2048  # held-out prompts of real datasets run to ~1.5k tokens
    request_timeout_s: float = 600.0
    python: Path | None = None  # the vLLM interpreter (default: $EAGLE3_VLLM_PYTHON or .venv-vllm)
    log_dir: Path | None = None
    # `auto` (the verifier's tokenizer decides), `none` or a vLLM parser: every server started here
    reasoning_parser: str = "auto"
    # servers already running (e.g. a GPU box): the plain verifier, and a verifier serving the trained draft
    plain_url: str | None = None
    draft_url: str | None = None
    served_model_name: str | None = None  # model id on those servers; default: the verifier folder's name
    api_key: str | None = field(default=None, repr=False)  # for servers given by URL; never logged


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

    from eagle3_assets.bounded_http import capped_openai_http_client
    from eagle3_assets.generation.replies import reply_limit
    from eagle3_assets.interrupts import run_interruptible

    # vLLM without --api-key accepts any key; the openai client insists on one
    api_key = config.api_key or "no-key"
    # the replies are plain (not streamed) chat completions of at most max_tokens, with their token ids
    limit = reply_limit(config.max_tokens, stream=False, extra_sampling={})
    deadline_s = config.request_timeout_s

    async def run_all() -> list[Generation]:
        import asyncio

        client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key=api_key,
            timeout=deadline_s,
            max_retries=0,
            http_client=capped_openai_http_client(lambda request: limit.bytes_for(request.content)),
        )
        gate = asyncio.Semaphore(max(1, config.concurrency))

        async def one(prompt: Prompt) -> Generation:
            async with gate:
                deadline = asyncio.timeout(deadline_s)  # the SDK's timeout bounds each read; this the whole reply
                try:
                    async with deadline:
                        response = await client.chat.completions.create(
                            model=model,
                            messages=prompt.messages,  # type: ignore[arg-type]
                            temperature=0,
                            max_tokens=config.max_tokens,
                            extra_body={"return_token_ids": True},
                        )
                except Exception as error:  # not a cancellation (a stop request): CancelledError is no Exception
                    if deadline.expired():
                        return _failed(
                            prompt, f"timeout: the reply did not end within the request timeout of {deadline_s:g} s"
                        )
                    return _failed(prompt, _failure_text(error))
            return _generation(prompt, response)

        try:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        finally:
            await client.close()

    started = time.perf_counter()
    generations = run_interruptible(run_all())
    return GenerationRun(generations, time.perf_counter() - started)


def _failed(prompt: Prompt, why: str) -> Generation:
    return Generation(
        sample_id=prompt.sample_id, token_ids=None, text="", completion_tokens=0, finish_reason=None, error=why
    )


def _failure_text(error: Exception) -> str:
    """The SDK's error with its cause (its connection error says only "Connection error.")."""
    text = f"{type(error).__name__}: {error}"
    cause = error.__cause__
    return f"{text} ({type(cause).__name__}: {cause})" if cause is not None else text


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
    """Sample ids whose greedy output differs (token ids when both have them, else the text); a prompt whose request
    failed on either side has no output to compare (it is counted as failed instead)."""
    bad = []
    for a, b in zip(reference, other, strict=True):
        if a.failed or b.failed:
            continue
        same = a.token_ids == b.token_ids if a.token_ids is not None and b.token_ids is not None else a.text == b.text
        if not same:
            bad.append(a.sample_id)
    return bad


def measure(
    base_url: str, model: str, prompts: Sequence[Prompt], config: OnlineConfig, speculative: bool = False
) -> GenerationRun:
    """Generate and count acceptance from these responses; a draft server must report it per request. Failed
    requests count nowhere but in ``failures``; a batch with no successful request stops the evaluation."""
    run = generate(base_url, model, prompts, config)
    answered = [g for g in run.generations if not g.failed]
    if run.generations and not answered:
        raise RuntimeError(
            f"{display_url(base_url)}: every one of the {len(run.generations)} evaluation requests failed; the first: "
            f"{run.generations[0].error}"
        )
    if speculative:
        without = [g.sample_id for g in answered if g.speculative is None]
        if without:
            raise RuntimeError(
                f"{display_url(base_url)} returned no per-request speculative metrics (metrics.speculative_decoding) "
                f"for {len(without)} of {len(answered)} requests: start that vLLM with "
                f"{' '.join(PER_REQUEST_METRICS_ARGS)}, or leave its URL empty so the evaluation starts its own "
                "server (server-wide /metrics counters are not used: other clients move them)"
            )
    run.counters = summed_counts(run.generations, config.k)
    return run


def acceptance_stats(
    label: str, k: int, run: GenerationRun, speed: GenerationRun | None = None, prompt_set: str = HELD_OUT
) -> AcceptanceStats:
    """Acceptance counted over ``run`` (the whole set); tokens/s from ``speed`` (batch 1), else from ``run``, only
    where every request of that batch was answered (else ``seconds`` None and ``speed_failed`` says how many failed)."""
    c = run.counters
    timed = speed if speed is not None else run
    speed_failed = len(timed.failures)
    failed = len(run.failures) + (len(speed.failures) if speed is not None else 0)
    return AcceptanceStats(
        label=label,
        method="online",
        k=k,
        drafts=c["drafts"],
        draft_tokens=c["draft_tokens"],
        accepted_tokens=c["accepted"],
        accepted_per_position=list(c["per_position"]),
        output_tokens=timed.output_tokens if timed.generations else None,
        # a failed request's wall time is in the batch's, its tokens are not: no tokens/s from such a batch
        seconds=timed.seconds if timed.generations and not speed_failed else None,
        prompt_set=prompt_set,
        extra={
            "prompts": len(run.generations),
            "speed_prompts": len(speed.generations) if speed is not None else len(run.generations),
            "truncated": sum(1 for g in run.generations if g.finish_reason == "length"),
            # requests that got no reply (a timeout, an oversized body, an error): in no count above
            "failed": failed,
        },
        failed=failed,
        speed_failed=speed_failed,
    )


def local_server(verifier: Path, config: OnlineConfig, name: str, draft: Path | None) -> Any:
    """A vLLM server on the verifier (with ``draft``, at k): float32 on the CPU build of vLLM; bfloat16 and a share of
    the GPU on the CUDA build (``local/accelerator.py``), beside the demo's own server, as the plain verifier."""
    from eagle3_assets.local import accelerator
    from eagle3_assets.local.vllm_server import LocalVLLMServer, VLLMServerConfig, find_free_port

    spec = None
    if draft is not None:
        spec = {"method": "eagle3", "model": str(Path(draft).resolve()), "num_speculative_tokens": config.k}
    build = accelerator.vllm_build(config.python)
    kv_cache_gib = VLLMServerConfig.kv_cache_gib
    extra_args = PER_REQUEST_METRICS_ARGS if draft is not None else ()
    return LocalVLLMServer(
        VLLMServerConfig(
            model=verifier,
            served_model_name=name,
            port=find_free_port(),
            python=config.python,
            dtype=accelerator.server_dtype(build),
            max_model_len=config.max_model_len,
            reasoning_parser=config.reasoning_parser,
            speculative_config=spec,
            log_dir=config.log_dir,
            extra_args=(*extra_args, *accelerator.server_memory_args(build, kv_cache_gib)),
        )
    )


@dataclass
class SetRun:
    """One server on one prompt set: the acceptance batch (every prompt, ``concurrency`` at a time) and the speed
    batch (the first ``speed_prompts``, one at a time)."""

    acceptance: GenerationRun
    speed: GenerationRun | None

    @property
    def generations(self) -> list[Generation]:
        return self.acceptance.generations + (self.speed.generations if self.speed is not None else [])

    @property
    def failures(self) -> list[Generation]:
        return [g for g in self.generations if g.failed]


def measure_set(
    base_url: str, model: str, prompts: Sequence[Prompt], config: OnlineConfig, speculative: bool = False
) -> SetRun:
    """The acceptance batch first (it also warms the server up), then the batch-1 speed batch."""
    acceptance = measure(base_url, model, prompts, config, speculative)
    speed = None
    if config.speed_prompts > 0:
        one_at_a_time = dataclasses.replace(config, concurrency=1)
        speed = measure(base_url, model, prompts[: config.speed_prompts], one_at_a_time, speculative)
    return SetRun(acceptance, speed)


@dataclass
class OnlineResult:
    stats: list[AcceptanceStats]
    baseline: dict[str, SetRun]  # prompt set -> the plain verifier's run
    mismatches: dict[str, dict[str, list[str]]]  # prompt set -> label -> sample ids whose greedy output differed
    startup_s: dict[str, float]


def evaluate_online(
    verifier: Path,
    drafts: Mapping[str, Path],
    prompt_sets: Mapping[str, Sequence[Prompt]],
    config: OnlineConfig,
    log: Callable[[str], None] | None = None,
) -> OnlineResult:
    """Plain verifier, then the verifier with each draft (label -> speculators draft folder), on every prompt set
    (name -> prompts), one server at a time.

    With ``config.plain_url`` / ``config.draft_url`` set, those servers are used (the trained draft is the first
    label); every other one is started locally (with ``config.reasoning_parser``) and stopped after its batches.
    """
    say = log or logger.info
    name = config.served_model_name or Path(verifier).name
    startup: dict[str, float] = {}

    def run_on(label: str, draft: Path | None, url: str | None) -> dict[str, SetRun]:
        def all_sets(base_url: str) -> dict[str, SetRun]:
            out = {}
            for set_name, prompts in prompt_sets.items():
                say(f"online [{label}] {set_name}: {len(prompts)} prompts, {config.concurrency} at a time")
                out[set_name] = run = measure_set(base_url, name, prompts, config, speculative=draft is not None)
                if failures := run.failures:
                    say(
                        f"online [{label}] {set_name}: {len(failures)} of {len(run.generations)} requests failed, "
                        f"counted in no acceptance, speed or mismatch; the first: {failures[0].error}"
                    )
                if run.speed is not None and run.speed.failures:
                    say(
                        f"online [{label}] {set_name}: {len(run.speed.failures)} of the speed batch's "
                        f"{len(run.speed.generations)} requests failed: no tokens/s, and no speed-up over it"
                    )
            return out

        if url is not None:
            say(f"online [{label}]: using the server at {display_url(url)}")
            return all_sets(url)
        say(f"online [{label}]: starting vLLM on {verifier}" + (f" with draft {draft}" if draft else ""))
        with local_server(verifier, config, name, draft) as server:
            startup[label] = round(float(server.startup_s or 0.0), 1)
            say(f"online [{label}]: ready in {startup[label]:.0f} s")
            return all_sets(server.base_url)

    baseline = run_on("plain", None, config.plain_url)
    stats: list[AcceptanceStats] = []
    mismatches: dict[str, dict[str, list[str]]] = {set_name: {} for set_name in prompt_sets}
    for i, (label, draft) in enumerate(drafts.items()):
        runs = run_on(label, Path(draft), config.draft_url if i == 0 else None)
        for set_name, run in runs.items():
            s = acceptance_stats(label, config.k, run.acceptance, run.speed, set_name)
            bad = mismatched(baseline[set_name].generations, run.generations)
            mismatches[set_name][label] = sorted(set(bad), key=bad.index)
            say(
                f"online [{label}] {set_name}: mean acceptance length {s.mean_acceptance_length:.3f} over "
                f"{s.drafts} drafts, {len(mismatches[set_name][label])} greedy mismatches"
            )
            stats.append(s)
    return OnlineResult(stats=stats, baseline=baseline, mismatches=mismatches, startup_s=startup)
