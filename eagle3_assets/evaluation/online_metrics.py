"""Online acceptance: the draft in vLLM's EAGLE-3 speculative decoding, counted from the evaluation's own requests.

The same prompts (every named prompt set: ``prompt_sets.py``) go, at temperature 0, to the plain verifier and to the
verifier with each draft (``--speculative-config {"method": "eagle3", "model": DRAFT, "num_speculative_tokens": k}``).
Acceptance is summed from the per-request speculative metrics each response carries (``metrics.speculative_decoding``:
vLLM's ``--per-request-spec-decode-metrics summary``, which the servers started here get and a server given by URL
must have), never from the server-wide ``/metrics`` counters that every client of a shared server moves. Requests
carry the generation setting's API key. Greedy outputs with a draft must equal the plain verifier's token for token
(speculative decoding is lossless at temperature 0): any difference is a bug, reported per prompt.

Per prompt set, two kinds of batch. The *acceptance* batch: every prompt, ``concurrency`` at a time, on the plain
verifier and on each draft's server (acceptance does not depend on the batch). The *paired speed* batch, for the
trained draft (the first; an untrained baseline never pays, so its speed is not measured):
the plain verifier's server stays up beside each draft's (a local one is started once, stopped after the last
draft), and each of the first ``speed_prompts`` prompts goes once to each server, one request at a time (batch 1,
where decoding is latency-bound and drafts pay off), the plain verifier first on an even index and the draft first
on an odd one, so drift and warm-up hit both sides alike (two servers measured minutes apart gave the same draft
0.98 and 1.37). Each request is timed on its own; a prompt's ratio is the draft's tokens/s over the plain verifier's
on it, and the report gives the median ratio with a 95% bootstrap interval (``report.speedup_interval``) and says
the draft *pays* only where the interval's lower bound is above 1.0.

Each request is bounded in time (the whole reply within ``request_timeout_s``: a trickled body stays under any
per-read timeout) and in size (``net.reply_limits.reply_limit`` of ``max_tokens``). A request that fails is
counted as failed and in no acceptance, speed or mismatch; a batch whose every request on one side failed stops the
evaluation naming the server and the error. A prompt whose plain or draft speed request failed is left out of the
ratios and counted; the stricter rule holds: any failed speed request withholds that draft's speed-up (a failed plain
one also the plain verifier's tokens/s), said with the count, never a number over the surviving pairs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.core.interrupts import run_interruptible
from eagle3_assets.core.verifier import SPECULATIVE_TOKENS
from eagle3_assets.evaluation.acceptance_counts import (
    Generation,
    GenerationRun,
    by_prompt_length,
    request_seed,
    seeds_requests,
    summary,
    summed_counts,
)
from eagle3_assets.evaluation.evaluation_report import AcceptanceStats, pair_record
from eagle3_assets.evaluation.prompt_sets import DEFAULT_PROMPT_SETS, HELD_OUT, Prompt, held_out_prompts
from eagle3_assets.local import accelerator, reasoning
from eagle3_assets.net.bounded_http import capped_openai_http_client
from eagle3_assets.net.credentials import display_url
from eagle3_assets.net.ports import find_free_port
from eagle3_assets.net.reply_limits import reply_limit

__all__ = ["OnlineConfig", "Prompt", "evaluate_online", "held_out_prompts"]

logger = logging.getLogger(__name__)

# vLLM's flag for per-request acceptance in each response body (``summary``: the histogram, no per-step arrays)
PER_REQUEST_METRICS_ARGS = ("--per-request-spec-decode-metrics", "summary")
PLAIN, DRAFT = "plain", "draft"


@dataclass
class OnlineConfig:
    k: int = SPECULATIVE_TOKENS
    prompts: int = 32  # held-out prompts
    humaneval_prompts: int = 0  # HumanEval problems; 0: all 164
    max_tokens: int = 128
    # acceptance does not depend on the batch: each prompt set's acceptance batch goes out this many at a time
    concurrency: int = 64
    # the trained draft's paired speed batch: each set's first N prompts, each sent to the plain verifier and to it, one
    # request at a time (batch 1: where decoding is latency-bound and drafts pay off), alternating which goes
    # first; the speed-up is the median per-prompt ratio with a 95% bootstrap interval; 0: no speed measurement
    speed_prompts: int = 32
    prompt_sets: tuple[str, ...] = tuple(DEFAULT_PROMPT_SETS.split(","))
    max_model_len: int = 2048  # held-out prompts of real datasets run to ~1.5k tokens
    request_timeout_s: float = 600.0
    python: Path | None = None  # the vLLM interpreter (default: $EAGLE3_VLLM_PYTHON or .venv-vllm)
    log_dir: Path | None = None
    # `auto` (the verifier's tokenizer decides), `none` or a vLLM parser: every server started here
    reasoning_parser: str = reasoning.AUTO
    # servers already running (e.g. a GPU box): the plain verifier, and a verifier serving the trained draft
    plain_url: str | None = None
    draft_url: str | None = None
    served_model_name: str | None = None  # model id on those servers; default: the verifier folder's name
    api_key: str | None = field(default=None, repr=False)  # for servers given by URL; never logged
    # the trained draft's acceptance batch again at this temperature (vLLM's rejection sampling; each request seeded
    # by its sample id where the server can seed, see seeds_requests); 0: greedy only
    sampled_temperature: float = 0.7


def _client(base_url: str, config: OnlineConfig) -> Any:
    """An OpenAI client of one server: no retries, each read within ``request_timeout_s``, replies capped at the
    limit of ``max_tokens``."""
    # lazy: loads openai (heavy), which only this path needs
    import openai

    # the replies are plain (not streamed) chat completions of at most max_tokens, with their token ids
    limit = reply_limit(config.max_tokens, stream=False, extra_sampling={})
    return openai.AsyncOpenAI(
        base_url=base_url,
        api_key=config.api_key or "no-key",  # vLLM without --api-key accepts any key; the openai client insists on one
        timeout=config.request_timeout_s,
        max_retries=0,
        http_client=capped_openai_http_client(lambda request: limit.bytes_for(request.content)),
    )


async def _complete(
    client: Any, model: str, prompt: Prompt, config: OnlineConfig, temperature: float = 0.0, seeded: bool = False
) -> Generation:
    """One completion (greedy unless ``temperature``; seeded by its sample id if ``seeded``), timed from its send to
    the whole reply; a failure is a failed Generation."""
    deadline_s = config.request_timeout_s
    deadline = asyncio.timeout(deadline_s)  # the SDK's timeout bounds each read; this the whole reply
    started = time.perf_counter()
    try:
        async with deadline:
            response = await client.chat.completions.create(
                model=model,
                messages=prompt.messages,  # type: ignore[arg-type]
                temperature=temperature,
                max_tokens=config.max_tokens,
                extra_body={"return_token_ids": True},
                **({"seed": request_seed(prompt.sample_id)} if temperature and seeded else {}),
            )
    except Exception as error:  # not a cancellation (a stop request): CancelledError is no Exception
        if deadline.expired():
            return _failed(prompt, f"timeout: the reply did not end within the request timeout of {deadline_s:g} s")
        return _failed(prompt, _failure_text(error))
    seconds = time.perf_counter() - started
    return dataclasses.replace(_generation(prompt, response), seconds=seconds)


def generate(
    base_url: str,
    model: str,
    prompts: Sequence[Prompt],
    config: OnlineConfig,
    temperature: float = 0.0,
    seeded: bool = False,
) -> GenerationRun:
    """Completions of every prompt (greedy unless ``temperature``), ``concurrency`` at a time; wall time of the
    whole batch.

    The requests run on an event loop that a stop request (SIGINT, SIGTERM, Dagster's terminate) cancels
    (:func:`eagle3_assets.core.interrupts.run_interruptible`): the batch ends within seconds, its connections closed,
    instead of waiting for every request in flight and every one queued (what a thread pool did).
    """

    async def run_all() -> list[Generation]:
        client = _client(base_url, config)
        gate = asyncio.Semaphore(max(1, config.concurrency))

        async def one(prompt: Prompt) -> Generation:
            async with gate:
                return await _complete(client, model, prompt, config, temperature, seeded)

        try:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        finally:
            await client.close()

    started = time.perf_counter()
    generations = run_interruptible(run_all())
    return GenerationRun(generations, time.perf_counter() - started)


def paired_order(index: int) -> tuple[str, str]:
    """Which side of prompt ``index``'s pair goes first: the plain verifier on an even index, the draft on an odd."""
    return (PLAIN, DRAFT) if index % 2 == 0 else (DRAFT, PLAIN)


def generate_paired(
    plain_url: str, draft_url: str, model: str, prompts: Sequence[Prompt], config: OnlineConfig
) -> tuple[GenerationRun, GenerationRun]:
    """The paired speed batch: per prompt one request to each server, one request at a time, in
    :func:`paired_order`; (plain, draft) runs in prompt order, each run's seconds the sum of its answered requests'."""

    async def run_all() -> dict[str, list[Generation]]:
        clients = {PLAIN: _client(plain_url, config), DRAFT: _client(draft_url, config)}
        out: dict[str, list[Generation]] = {PLAIN: [], DRAFT: []}
        try:
            for i, prompt in enumerate(prompts):
                for side in paired_order(i):
                    out[side].append(await _complete(clients[side], model, prompt, config))
        finally:
            for client in clients.values():
                await client.close()
        return out

    sides = run_interruptible(run_all())
    runs = [GenerationRun(sides[s], sum(g.seconds or 0.0 for g in sides[s])) for s in (PLAIN, DRAFT)]
    return runs[0], runs[1]


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
        prompt_tokens=int(usage.prompt_tokens) if usage and usage.prompt_tokens is not None else None,
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


def _checked(base_url: str, run: GenerationRun, config: OnlineConfig, speculative: bool) -> GenerationRun:
    """``run`` with its acceptance counted; a run with no answered request, or a draft server's without
    per-request metrics, stops the evaluation naming the server."""
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


def measure(
    base_url: str,
    model: str,
    prompts: Sequence[Prompt],
    config: OnlineConfig,
    speculative: bool = False,
    temperature: float = 0.0,
    seeded: bool = False,
) -> GenerationRun:
    """Generate and count acceptance from these responses; a draft server must report it per request. Failed
    requests count nowhere but in ``failures``; a batch with no successful request stops the evaluation."""
    run = generate(base_url, model, prompts, config, temperature, seeded)
    return _checked(base_url, run, config, speculative)


def acceptance_stats(
    label: str,
    k: int,
    run: GenerationRun,
    speed: GenerationRun | None = None,
    prompt_set: str = HELD_OUT,
    plain_speed: GenerationRun | None = None,
    timed_by_run: bool = True,
) -> AcceptanceStats:
    """Acceptance counted over ``run`` (the whole set); tokens/s from ``speed`` (batch 1), else from ``run`` unless
    ``timed_by_run`` is False (the baseline was timed at batch 1, so a ratio to ``run``'s throughput, many requests in
    flight, would mean nothing), only where every request of that batch was answered (else ``seconds`` None and
    ``speed_failed`` says how many failed). With ``plain_speed``, ``speed`` is the draft's side of a paired speed batch
    and the per-prompt pairs are kept (``speed_pairs``: each side's tokens and seconds, None where its request
    failed)."""
    c = run.counters
    timed = speed if speed is not None else run if timed_by_run else GenerationRun([], 0.0)
    speed_failed = len(timed.failures)
    failed = len(run.failures) + (len(speed.failures) if speed is not None else 0)
    pairs = []
    if plain_speed is not None and speed is not None:
        for i, sides in enumerate(zip(plain_speed.generations, speed.generations, strict=True)):
            answered = [None if g.failed or g.seconds is None else (g.completion_tokens, g.seconds) for g in sides]
            pairs.append(pair_record(sides[1].sample_id, paired_order(i)[0], *answered))
    return AcceptanceStats(
        label=label,
        method="online",
        k=k,
        drafts=c["drafts"],
        draft_tokens=c["draft_tokens"],
        accepted_tokens=c["accepted"],
        accepted_per_position=list(c["per_position"]),
        output_tokens=timed.output_tokens if timed.generations else None,
        # a batch with a failed request: no tokens/s (its seconds, a batch's wall time, hold the failed one's too)
        seconds=timed.seconds if timed.generations and not speed_failed else None,
        prompt_set=prompt_set,
        extra={
            "prompts": len(run.generations),
            "speed_prompts": len(speed.generations) if speed is not None else len(run.generations),
            "truncated": sum(1 for g in run.generations if g.finish_reason == "length"),
            # requests that got no reply (a timeout, an oversized body, an error): in no count above
            "failed": failed,
            "by_prompt_length": by_prompt_length(run.generations, k),
        },
        failed=failed,
        speed_failed=speed_failed,
        speed_pairs=pairs,
    )


def local_server(verifier: Path, config: OnlineConfig, name: str, draft: Path | None) -> Any:
    """A vLLM server on the verifier (with ``draft``, at k): float32 on the CPU build of vLLM; bfloat16 and a share of
    the GPU on the CUDA build (``local/accelerator.py``), beside the demo's own server, as the plain verifier."""
    # lazy: looked up when called, so a test can replace it
    from eagle3_assets.local.vllm_server import LocalVLLMServer, VLLMServerConfig

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
    """One server on one prompt set: the acceptance batch (every prompt, ``concurrency`` at a time) and its side of
    the paired speed batches (the plain verifier: its requests of every draft's pairs, in draft order)."""

    acceptance: GenerationRun
    speed: GenerationRun | None

    @property
    def generations(self) -> list[Generation]:
        return self.acceptance.generations + (self.speed.generations if self.speed is not None else [])

    @property
    def failures(self) -> list[Generation]:
        return [g for g in self.generations if g.failed]


@dataclass
class OnlineResult:
    stats: list[AcceptanceStats]
    # prompt set -> the plain verifier's run: its acceptance batch and its side of every draft's paired speed batch
    baseline: dict[str, SetRun]
    mismatches: dict[str, dict[str, list[str]]]  # prompt set -> label -> sample ids whose greedy output differed
    startup_s: dict[str, float]


def _say_failures(say: Callable[[str], None], label: str, set_name: str, batch: str, run: GenerationRun) -> None:
    if failures := run.failures:
        withheld = ": no tokens/s, and no speed-up over it" if batch == "speed batch" else ""
        say(
            f"online [{label}] {set_name}: {len(failures)} of the {batch}'s {len(run.generations)} requests failed, "
            f"counted in no acceptance, speed or mismatch{withheld}; the first: {failures[0].error}"
        )


def _sampled_batch(
    url: str, model: str, prompts: Sequence[Prompt], config: OnlineConfig, say: Callable[[str], None], label: str,
    set_name: str,
) -> dict[str, Any]:  # fmt: skip
    """The trained draft's acceptance batch again at ``config.sampled_temperature``: its counts, and whether its
    requests were seeded (:func:`seeds_requests`)."""
    temperature, seeded = config.sampled_temperature, seeds_requests(config.python, config.draft_url is not None)
    how = "each request seeded by its sample id" if seeded else "unseeded (a CPU vLLM cannot seed a request)"
    say(f"online [{label}] {set_name}: acceptance again at temperature {temperature:g}, {how}")
    run = measure(url, model, prompts, config, True, temperature, seeded)
    _say_failures(say, label, set_name, f"temperature-{temperature:g} batch", run)
    return {
        "temperature": temperature,
        "seeded": seeded,
        "failed": len(run.failures),
        **summary(run.generations, config.k),
    }


def evaluate_online(
    verifier: Path,
    drafts: Mapping[str, Path],
    prompt_sets: Mapping[str, Sequence[Prompt]],
    config: OnlineConfig,
    log: Callable[[str], None] | None = None,
) -> OnlineResult:
    """The plain verifier's acceptance batches, then each draft's (label -> speculators draft folder), and the first
    (trained) draft's paired speed batch against the plain verifier, on every prompt set (name -> prompts).

    With ``config.plain_url`` / ``config.draft_url`` set, those servers are used (the trained draft is the first
    label); every other one is started locally (with ``config.reasoning_parser``): the plain verifier's once, kept up
    beside each draft's and stopped after the last; a draft's stopped after its batches.
    """
    say = log or logger.info
    name = config.served_model_name or Path(verifier).name
    startup: dict[str, float] = {}

    def serve(stack: contextlib.ExitStack, label: str, draft: Path | None, url: str | None) -> str:
        if url is not None:
            say(f"online [{label}]: using the server at {display_url(url)}")
            return url
        say(f"online [{label}]: starting vLLM on {verifier}" + (f" with draft {draft}" if draft else ""))
        server = stack.enter_context(local_server(verifier, config, name, draft))
        startup[label] = round(float(server.startup_s or 0.0), 1)
        say(f"online [{label}]: ready in {startup[label]:.0f} s")
        return server.base_url

    def acceptance(label: str, url: str, set_name: str, speculative: bool) -> GenerationRun:
        say(f"online [{label}] {set_name}: {len(prompt_sets[set_name])} prompts, {config.concurrency} at a time")
        run = measure(url, name, prompt_sets[set_name], config, speculative)
        _say_failures(say, label, set_name, "acceptance batch", run)
        return run

    def paired(plain_url: str, draft_url: str, label: str, set_name: str) -> tuple[GenerationRun, GenerationRun]:
        prompts = prompt_sets[set_name][: config.speed_prompts]
        say(f"online [plain vs {label}] {set_name}: speed on {len(prompts)} prompts, paired, one request at a time")
        plain_run, draft_run = generate_paired(plain_url, draft_url, name, prompts, config)
        _say_failures(say, "plain", set_name, "speed batch", _checked(plain_url, plain_run, config, False))
        _say_failures(say, label, set_name, "speed batch", _checked(draft_url, draft_run, config, True))
        return plain_run, draft_run

    stats: list[AcceptanceStats] = []
    mismatches: dict[str, dict[str, list[str]]] = {set_name: {} for set_name in prompt_sets}
    plain_speed: dict[str, list[GenerationRun]] = {set_name: [] for set_name in prompt_sets}
    with contextlib.ExitStack() as plain_server:
        plain_url = serve(plain_server, "plain", None, config.plain_url)
        plain = {set_name: acceptance("plain", plain_url, set_name, False) for set_name in prompt_sets}
        if config.speed_prompts <= 0:
            plain_server.close()  # no paired speed batch: nothing to keep the plain verifier up for
        for i, (label, draft) in enumerate(drafts.items()):
            with contextlib.ExitStack() as draft_server:
                draft_url = serve(draft_server, label, Path(draft), config.draft_url if i == 0 else None)
                trained = i == 0  # the rest are baselines: an untrained draft never pays, so no speed or sampled batch
                runs = {set_name: acceptance(label, draft_url, set_name, True) for set_name in prompt_sets}
                for set_name, run in runs.items():
                    reference, other = list(plain[set_name].generations), list(run.generations)
                    plain_run = draft_run = None
                    if config.speed_prompts > 0 and trained:
                        plain_run, draft_run = paired(plain_url, draft_url, label, set_name)
                        plain_speed[set_name].append(plain_run)
                        reference, other = reference + plain_run.generations, other + draft_run.generations
                    # a baseline gets no speed batch when the trained draft has one: then no tok/s, no speed-up
                    s = acceptance_stats(
                        label, config.k, run, draft_run, set_name, plain_run, config.speed_prompts <= 0
                    )
                    if trained and config.sampled_temperature > 0:
                        prompts = prompt_sets[set_name]
                        s.extra["sampled"] = _sampled_batch(draft_url, name, prompts, config, say, label, set_name)
                    mismatches[set_name][label] = list(dict.fromkeys(mismatched(reference, other)))
                    say(
                        f"online [{label}] {set_name}: mean acceptance length {s.mean_acceptance_length:.3f} over "
                        f"{s.drafts} drafts, {len(mismatches[set_name][label])} greedy mismatches"
                    )
                    stats.append(s)
    baseline = {set_name: SetRun(plain[set_name], _joined(plain_speed[set_name])) for set_name in prompt_sets}
    return OnlineResult(stats=stats, baseline=baseline, mismatches=mismatches, startup_s=startup)


def _joined(runs: Sequence[GenerationRun]) -> GenerationRun | None:
    """One side's requests over several paired batches: their generations, their seconds summed (None: none)."""
    return GenerationRun([g for r in runs for g in r.generations], sum(r.seconds for r in runs)) if runs else None
