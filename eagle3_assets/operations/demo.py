"""``eagle3 demo``: the whole pipeline end to end on the shipped sample and the embedded tiny model.

Builds the tiny verifier, starts the local CPU vLLM on it, materializes every asset of the definitions
(every partition of the partitioned ones) into the Dagster instance at DAGSTER_HOME, so ``make dev``
shows the runs afterwards, prints the DuckDB counts and a timing table, and stops the server. The terminal
gets one progress line per stage and partition; Dagster's event log and every library's output go to
EAGLE3_DATA_DIR/_logs/demo.log, named at the start and the end.
Paths come from EAGLE3_DATA_DIR (data, the tiny model, server logs) and DAGSTER_HOME.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_assets.core import settings
from eagle3_assets.core.precision import fastest_cpu_precision
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.local import accelerator
from eagle3_assets.local.real_verifier import build_real_verifier
from eagle3_assets.local.reasoning import describe
from eagle3_assets.local.tiny_model import build_tiny_model
from eagle3_assets.operations.counts import print_counts
from eagle3_assets.operations.demo_runs import (
    DEMO_ASSET_CONFIG,
    DEMO_ENV,
    REAL_ASSET_CONFIG,
    REAL_ENV,
    REAL_MAX_MODEL_LEN,
    REAL_SAMPLES,
    RECIPE_POINT,
    RECIPE_SAMPLES,
)
from eagle3_assets.operations.measurement import MeasurementFile
from eagle3_assets.training.checkpoints import HISTORY_FILE

if TYPE_CHECKING:
    from eagle3_assets.generation.fullness import ServerFullness


def real_precision() -> str:
    """``EAGLE3_PRECISION`` of ``demo --real``: ``auto`` (bfloat16) where a GPU is visible, else the faster one of
    this CPU (``precision.fastest_cpu_precision``)."""
    # lazy: loads torch (heavy), which only this path needs
    import torch

    return "auto" if torch.cuda.is_available() else fastest_cpu_precision()


def _print_table(rows: list[tuple[str, str, float]]) -> None:
    width = max(len(name) for name, _, _ in rows)
    print(f"\n{'stage'.ljust(width)}  {'partitions':>10}  {'seconds':>8}")
    for name, partitions, seconds in rows:
        print(f"{name.ljust(width)}  {partitions:>10}  {seconds:8.1f}")
    print(f"{'total'.ljust(width)}  {'':>10}  {sum(s for _, _, s in rows):8.1f}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3 demo", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("EAGLE3_DEMO_PORT", "8000")),
        help="port of the local vLLM server on 127.0.0.1 (default: $EAGLE3_DEMO_PORT or 8000)",
    )
    parser.add_argument("--keep-server", action="store_true", help="leave the vLLM server running")
    parser.add_argument(
        "--real",
        action="store_true",
        help="SmolLM2-135M-Instruct on ShareGPT first turns instead of the tiny verifier on the shipped sample",
    )
    parser.add_argument(
        "--recipe",
        action="store_true",
        help=f"--real on {RECIPE_SAMPLES} ShareGPT rows, its measurement file named recipe_<commit>.json",
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=None,
        help=f"--real: ShareGPT rows read (default {REAL_SAMPLES}; {RECIPE_SAMPLES} with --recipe)",
    )
    parser.add_argument(
        "--run", default=None, help="the run's name in its measurement file's name (default: demo, or demo-real)"
    )
    parser.add_argument(
        "--measurements",
        type=Path,
        default=None,
        help="folder of the run's measurement file, {run}_{commit}.json (default: EAGLE3_DATA_DIR/_measurements)",
    )
    return parser


@contextmanager
def output_to(log_path: Path) -> Iterator[Callable[[str], None]]:
    """Send everything written to fd 1 and 2 (Dagster's console events, library prints and warnings) to
    ``log_path``; yield a function that prints one line on the terminal."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    terminal = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    with open(log_path, "a", encoding="utf-8", buffering=1) as log:
        os.dup2(log.fileno(), 1)  # subprocesses and C extensions
        os.dup2(log.fileno(), 2)
        try:
            with redirect_stdout(log), redirect_stderr(log):  # Python-level writers, wherever sys.stdout pointed
                yield lambda line: print(line, file=terminal, flush=True)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            terminal.close()


def _failure(result: Any) -> str:
    """The first step failure's message (the full stack trace is in the log file)."""
    for event in result.all_events:
        error = getattr(event.event_specific_data, "error", None)
        while error is not None and error.cause is not None and "Error occurred while executing" in error.message:
            error = error.cause  # Dagster's wrapper around the asset's own error: name the asset's error
        if error is not None and error.message:
            line = error.message.strip().splitlines()[0]
            prefix, _, rest = line.partition(": ")  # "package.module.ErrorClass: text" -> "text"
            return (rest if rest and " " not in prefix else line)[:300]
    return "failed"


def _rows(result: Any) -> str:
    for event in result.get_asset_materialization_events():
        metadata = event.materialization.metadata
        for key in ("dagster/partition_row_count", "dagster/row_count"):
            if key in metadata:
                return f", {metadata[key].value} rows"
    return ""


# The asset whose partitions run overlapped (generation.partition.OVERLAPPED_PARTITIONS at a time), as under the
# daemon's backfill: the server never idles on a tail between partitions. Every other asset runs its partitions one
# after another: they compute in this process's cores, where two at a time only contend.
GENERATION_ASSET = "synthetic_responses"


def run_stages(
    defs: Any,
    instance: Any,
    say: Callable[[str], None],
    run_config_for: Callable[[str], dict[str, Any] | None],
    only: Sequence[str] | None = None,
    watch_server: Callable[[str], ServerFullness | None] = lambda _name: None,
    on_stage: Callable[[str, str, float, dict[str, Any]], None] | None = None,
) -> list[tuple[str, str, float]]:
    """Materialize every asset (every partition of the partitioned ones) in dependency order, one progress
    line per stage and partition; raises SystemExit naming the failed stage. Returns the timing rows.
    ``watch_server(name)``: a server whose fullness the stage ``name`` reports in one more line (or None);
    ``on_stage(name, partitions, seconds, figures)``: called as each stage ends (the run's measurement file)."""

    # lazy: loads dagster (heavy), which only this path needs
    from eagle3_assets.defs.ablation import OPT_IN_ASSETS
    from eagle3_assets.defs.partitions import PROMPT_PARTITIONS
    from eagle3_assets.generation.partition_run import OVERLAPPED_PARTITIONS

    graph = defs.resolve_asset_graph()
    timings: list[tuple[str, str, float]] = []
    for key in graph.toposorted_asset_keys:
        name = key.to_user_string()
        if (only is not None and name not in only) or (only is None and name in OPT_IN_ASSETS):
            continue
        run_config = run_config_for(name)
        partitioned = graph.get(key).partitions_def is not None
        keys = instance.get_dynamic_partitions(PROMPT_PARTITIONS.name) if partitioned else [None]
        fullness = watch_server(name)
        figures: dict[str, Any] = {}
        started = time.monotonic()
        if fullness is not None:
            fullness.start()
        try:
            at_once = OVERLAPPED_PARTITIONS if name == GENERATION_ASSET else 1
            _run_partitions(defs, instance, say, name, key, keys, run_config, at_once)
        finally:
            if fullness is not None:
                report = fullness.stop()
                say(report.line(name))
                figures["server_fullness"] = {**dataclasses.asdict(report), "share": round(report.share, 3)}
        timings.append((name, str(len(keys)) if partitioned else "-", time.monotonic() - started))
        if on_stage is not None:
            on_stage(*timings[-1], figures)
    return timings


def _run_partitions(
    defs: Any,
    instance: Any,
    say: Callable[[str], None],
    name: str,
    key: Any,
    partition_keys: Sequence[str | None],
    run_config: dict[str, Any] | None,
    at_once: int,
) -> None:
    """One run per partition and a progress line as each ends; raises SystemExit naming the first failure. With
    ``at_once`` > 1, that many runs at a time, each in its own process (operations/partition_runs.py says why),
    started and reported in key order; a failure starts no further run and waits for those already going."""
    failed: list[str] = []

    def report(i: int, partition_key: str | None, result: Any, seconds: float) -> bool:
        where = f" partition {partition_key} ({i}/{len(partition_keys)})" if partition_key else ""
        if result.success:
            say(f"{name}{where}: ok in {seconds:.1f} s{_rows(result)}")
            return True
        why = _failure(result)
        if "ExecutionInterruptedError" in why or "KeyboardInterrupt" in why:  # SIGINT/SIGTERM: nothing to fix
            say(f"{name}{where}: stopped by a signal")
            failed.append(f"{name} stopped (run {result.run_id}); re-run the same command to resume")
            return False
        say(f"{name}{where}: FAILED: {why}")
        failed.append(f"{name} failed (run {result.run_id}); fix it, then re-run make demo")
        return False

    if at_once > 1 and None not in partition_keys:
        # lazy: loads dagster (heavy), which only this path needs
        from eagle3_assets.operations.partition_runs import run_partitions

        run_partitions(instance, name, [str(k) for k in partition_keys], run_config, at_once, report)
    else:
        for i, partition_key in enumerate(partition_keys, start=1):
            step = time.monotonic()
            result = materialize_asset(defs, instance, key, partition_key, run_config, raise_on_error=False)
            if not report(i, partition_key, result, time.monotonic() - step):
                break
    if failed:
        raise SystemExit(failed[0])


def materialize_asset(
    defs: Any,
    instance: Any,
    key: Any,
    partition_key: str | None = None,
    run_config: dict[str, Any] | None = None,
    raise_on_error: bool = True,
) -> Any:
    """One asset (one partition of it) of the Definitions ``defs``, run with their own resources, as the UI would."""
    # lazy: loads dagster (heavy), which only this path needs
    import dagster as dg

    return dg.materialize(
        list(defs.assets or []),
        selection=[key],
        partition_key=partition_key,
        instance=instance,
        resources=defs.resources,
        run_config=run_config,
        raise_on_error=raise_on_error,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv or []))
    stop_on_sigterm()
    if args.recipe:
        args.real, args.run = True, args.run or "recipe"
    if args.samples is None:
        args.samples = RECIPE_SAMPLES if args.recipe else REAL_SAMPLES
    # lazy: loads dagster (heavy), which only this path needs
    import dagster as dg

    # lazy: the settings models import every stage (~1.6 s), which only this path needs
    from eagle3_assets.environment import env_value

    # bf16 compute where this CPU has it: hidden states and training ~2.6x faster, the demo's time goes to data; on
    # a GPU `auto` (bf16 there)
    real_env = {**REAL_ENV, "EAGLE3_PROMPTS_LIMIT": str(args.samples), "EAGLE3_PRECISION": real_precision()}
    for key, value in (real_env if args.real else DEMO_ENV).items():
        os.environ.setdefault(key, value)
    data_dir = Path(env_value("EAGLE3_DATA_DIR")).resolve()
    default_model = "smollm2-135m-instruct" if args.real else "tiny-verifier"
    verifier = Path(env_value("EAGLE3_VERIFIER_PATH") or data_dir / "_models" / default_model)
    os.environ["EAGLE3_VERIFIER_PATH"] = str(verifier)
    os.environ.setdefault("EAGLE3_VLLM_BASE_URL", f"http://127.0.0.1:{args.port}/v1")
    if "DAGSTER_HOME" not in os.environ:
        raise settings.ConfigError("DAGSTER_HOME='': set it (the Makefile uses ./dagster_home)")
    log_path = data_dir / "_logs" / "demo.log"
    log_path.unlink(missing_ok=True)
    print(f"eagle3 demo: the full Dagster event log goes to {log_path}")
    measurement = _measurement_file(args, data_dir)
    print(f"eagle3 demo: the run's measurements go to {measurement.path}")
    try:
        with output_to(log_path) as say:
            timings, server = _setup(verifier, data_dir, args.port, say, real=args.real)
            for name, partitions, seconds in timings:
                measurement.stage(name, partitions, seconds)
            # draft_evaluation measures the plain verifier on the demo's own server
            os.environ.setdefault("EAGLE3_EVAL_PLAIN_URL", server.base_url)
            os.environ.setdefault("EAGLE3_EVAL_MODEL", server.model_name)
            # lazy: loads dagster (heavy), which only this path needs
            from eagle3_assets.definitions import build_definitions

            try:
                defs = build_definitions()
                with dg.DagsterInstance.get() as instance:
                    config_for = _real_run_config if args.real else _run_config
                    timings += run_stages(
                        defs, instance, say, config_for, watch_server=_fullness_of(server),
                        on_stage=lambda name, partitions, seconds, figures: measurement.stage(
                            name, partitions, seconds, **figures
                        ),
                    )  # fmt: skip
            finally:
                if not args.keep_server:
                    server.stop()
    except BaseException:
        print(f"eagle3 demo stopped; the full log is {log_path}", file=sys.stderr)
        raise
    _summary(data_dir, timings, log_path, real=args.real)
    print(f"measurements of this run: {measurement.finish_run(data_dir)}")
    return 0


def stop_on_sigterm() -> None:
    """SIGTERM (kill, timeout, systemd) stops the demo as Ctrl-C does: the stage in progress winds down (its
    partition processes and the server stopped) instead of the process vanishing with its children left running."""
    signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGINT))


def _measurement_file(args: argparse.Namespace, data_dir: Path) -> Any:
    """The run's measurement file: its settings are the environment and run config the demo gave its stages."""
    env = REAL_ENV if args.real else DEMO_ENV
    settings_given = {
        "environment": {key: os.environ.get(key) for key in sorted({*env, "EAGLE3_PROMPTS_LIMIT", "EAGLE3_PRECISION"})},
        "asset_config": REAL_ASSET_CONFIG if args.real else DEMO_ASSET_CONFIG,
    }
    run = args.run or ("demo-real" if args.real else "demo")
    return MeasurementFile(args.measurements or data_dir / "_measurements", run, settings_given)


def _fullness_of(server: Any) -> Callable[[str], ServerFullness | None]:
    """The demo's own server watched while ``synthetic_responses`` generates, against its target concurrency."""
    # lazy: the settings models import every stage (~1.6 s), which only this path needs
    from eagle3_assets.environment import env_value
    from eagle3_assets.generation.fullness import ServerFullness

    target = int(env_value("EAGLE3_CONCURRENCY"))
    return lambda name: ServerFullness(server.base_url, target) if name == GENERATION_ASSET else None


def _run_config(name: str) -> dict[str, Any] | None:
    asset_config = DEMO_ASSET_CONFIG.get(name)
    return {"ops": {name: {"config": asset_config}}} if asset_config is not None else None


def _real_run_config(name: str) -> dict[str, Any] | None:
    asset_config = REAL_ASSET_CONFIG.get(name)
    return {"ops": {name: {"config": asset_config}}} if asset_config is not None else None


def _setup(
    verifier: Path, data_dir: Path, port: int, say: Callable[[str], None], real: bool = False
) -> tuple[list, Any]:
    """The verifier (the tiny one, or SmolLM2 with ``real``; built once) and the local vLLM serving it."""
    # lazy: looked up when called, so a test can replace it
    from eagle3_assets.local.vllm_server import LocalVLLMServer

    timings: list[tuple[str, str, float]] = []
    started = time.monotonic()
    if real:
        build_real_verifier(verifier, say=say)
    elif not (verifier / "config.json").exists():
        build_tiny_model(verifier, seed=0)
    timings.append(("verifier", "-", time.monotonic() - started))
    say(f"verifier: {verifier}")
    started = time.monotonic()
    # lazy: the settings models import every stage (~1.6 s), which only this path needs
    from eagle3_assets.environment import env_value

    # the real model: prompts up to EAGLE3_MAX_PROMPT_CHARS plus a 256-token answer fit 2,048 tokens
    sizing: dict[str, Any] = {"max_model_len": REAL_MAX_MODEL_LEN, "kv_cache_gib": 2} if real else {}
    # the CUDA vLLM: bf16, and a share of the GPU so that draft_evaluation's servers start beside this one
    build = accelerator.vllm_build()
    sizing["dtype"] = accelerator.server_dtype(build)
    sizing["extra_args"] = accelerator.server_memory_args(build, sizing.get("kv_cache_gib", 1))
    # EAGLE3_REASONING_PARSER (auto: the tokenizer decides; SmolLM2 has no think block, the tiny verifier has one)
    parser = env_value("EAGLE3_REASONING_PARSER")
    say(f"vLLM: {describe(parser, verifier)}")
    server = LocalVLLMServer(
        model=verifier, port=port, log_dir=data_dir / "_logs", reuse_existing=True,
        served_model_name="smollm2" if real else "tiny", reasoning_parser=parser, **sizing,
    )  # fmt: skip
    server.start()
    timings.append(("vLLM start-up", "-", time.monotonic() - started))
    say(f"vLLM serving {server.model_name} at {server.base_url} (log: {server.log_path})")
    return timings, server


def _training_line(data_dir: Path, real: bool) -> str:
    """How much the draft was trained on and, for the real demo, where that sits against the recipe's point."""
    try:
        history = json.loads((data_dir / "draft_model" / HISTORY_FILE).read_text())
    except (OSError, ValueError):
        return "\ndraft: no training history found"
    samples, epochs = history.get("train_samples", 0), history.get("config", {}).get("epochs", "?")
    line = (
        f"\ndraft trained on {samples} samples x {epochs} epochs: {history.get('steps', 0)} steps, "
        f"{history.get('tokens_trained', 0):,} tokens"
    )
    if not real:
        return line
    point = RECIPE_POINT
    return (
        f"{line}; on the learning curve (docs/real_model.md) that is {samples / point['samples']:.0%} of the "
        f"recipe's {point['samples']:,} samples x {point['epochs']} epochs, whose draft reached a mean acceptance "
        f"length of {point['humaneval_acceptance']} on HumanEval in vLLM at k=3 (run {point['commit']})"
    )


def _summary(data_dir: Path, timings: list[tuple[str, str, float]], log_path: Path, real: bool = False) -> None:
    print(f"\nrows per partition (DuckDB over {data_dir}):")
    print_counts(DataLayout.at(data_dir))
    evaluation = data_dir / "draft_evaluation" / "report.md"
    if evaluation.exists():
        print("\n" + evaluation.read_text().strip())
    print(_training_line(data_dir, real))
    _print_table(timings)
    print(f"\nfull Dagster event log: {log_path}")
    print(f"Open the UI on this data: make dev  (http://127.0.0.1:3000, DAGSTER_HOME={os.environ['DAGSTER_HOME']})")
