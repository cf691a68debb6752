"""How close does the generation engine come to what the server could deliver? (issue 3, acceptance 4)

Against the fake vLLM server (a subprocess, so its CPU is not charged to the client) at a known
per-sequence token rate and heavy-tailed (lognormal) response lengths, this prints side by side:

- ideal:            sum(durations) / C, a pool with no tail and no overhead;
- in-order ceiling: the wall time of a perfect zero-overhead pool of C slots taking the samples in order,
                    computed from the same lengths (the long requests at the end bound every in-order client);
- engine:           ``generate_partition`` end to end (journal appends, fsyncs and the final Parquet included);
- batch-then-gather: batches of C ``AsyncOpenAI.chat.completions.create`` calls awaited with gather;

plus the engine's client CPU per request and its peak memory at two sizes (memory must not grow with N).

Each engine run is a fresh subprocess (same server, same workload, one after the other), so no run inherits
another's warm state. ``--before PATH`` also runs the engine of another checkout of this repository (e.g. a
``git worktree`` of the previous commit) side by side, and prints this tree's CPU per request as a ratio of it.

    .venv/bin/python benchmarks/generation_efficiency.py            # the acceptance workload (~3 min)
    .venv/bin/python benchmarks/generation_efficiency.py --quick    # 500 requests, C=64 (~1 min)
    git worktree add /tmp/before HEAD~1 && .venv/bin/python benchmarks/generation_efficiency.py --quick \
        --before /tmp/before --before-transports openai          # before/after in one run
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
# the checkout whose engine runs: this one, or (in a child of --before) the one given
ROOT = Path(os.environ.get("EAGLE3_BENCH_TREE") or HERE)
sys.path.insert(0, str(ROOT))  # that checkout's engine; the fake server (fake_vllm) is this folder's

from eagle3_assets.core.storage import DataLayout  # noqa: E402
from eagle3_assets.generation import GenerationConfig, PromptToGenerate, generate_partition  # noqa: E402
from fake_vllm import FakeConfig, FakeServerProcess, response_length  # noqa: E402


def make_prompts(n: int, tag: str = "benchmark") -> list[PromptToGenerate]:
    return [PromptToGenerate(f"{tag}-{i:06d}", [{"role": "user", "content": f"{tag} prompt {i}"}]) for i in range(n)]


def durations(prompts: list[PromptToGenerate], fake: FakeConfig, max_tokens: int) -> tuple[list[float], list[int]]:
    lengths = [response_length(p.messages, fake, max_tokens)[0] for p in prompts]  # type: ignore[arg-type]
    return [fake.ttft_s + n / fake.token_rate for n in lengths], lengths


def in_order_ceiling(durs: list[float], concurrency: int) -> float:
    """Wall time of a perfect pool: each sample starts the instant the earliest slot frees up, in order."""
    slots = [0.0] * concurrency
    for d in durs:
        heapq.heappush(slots, heapq.heappop(slots) + d)
    return max(slots)


def batch_bound(durs: list[float], concurrency: int) -> float:
    return sum(max(durs[i : i + concurrency]) for i in range(0, len(durs), concurrency))


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_engine(
    prompts: list[PromptToGenerate],
    base_url: str,
    args: argparse.Namespace,
    data_dir: Path,
    transport: str = "openai",
    log: Callable[[str], None] = lambda _m: None,
) -> dict[str, float]:
    config = GenerationConfig(
        base_urls=[base_url],
        model="fake-model",
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        stream=args.stream,
        idle_timeout_s=60,
        request_timeout_s=600,
        progress_interval_s=1e9,
        transport=transport,
    )
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    result = generate_partition(prompts, "00000", DataLayout.at(data_dir), config, log=log)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    assert result.ok == len(prompts), result
    return {
        "wall_s": wall,
        "pool_s": result.pool_s,
        "cpu_ms_per_request": 1000 * cpu / len(prompts),
        "completion_tokens": result.completion_tokens,
    }


async def _batch_then_gather(prompts: list[PromptToGenerate], base_url: str, args: argparse.Namespace) -> float:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), args.concurrency):
        batch = prompts[i : i + args.concurrency]
        await asyncio.gather(
            *[
                client.chat.completions.create(
                    model="fake-model",
                    messages=p.messages,  # type: ignore[arg-type]
                    max_tokens=args.max_tokens,
                )
                for p in batch
            ]
        )
    wall = time.perf_counter() - t0
    await client.close()
    return wall


def engine_child(args: argparse.Namespace, base_url: str, transport: str) -> None:
    """Run in a subprocess (with EAGLE3_BENCH_TREE naming the checkout): one engine run, its numbers as JSON."""
    import polars  # noqa: F401  - a Dagster process has it loaded already; not charged to the run

    with tempfile.TemporaryDirectory() as tmp:
        engine = run_engine(make_prompts(args.requests), base_url, args, Path(tmp), transport=transport)
    print(json.dumps(engine))


def run_engine_in(tree: Path, args: argparse.Namespace, base_url: str, transport: str) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--requests", str(args.requests), "--concurrency", str(args.concurrency)]
    cmd += ["--max-tokens", str(args.max_tokens), "--engine-child", base_url, transport]
    if args.stream:
        cmd.append("--stream")
    env = {**os.environ, "EAGLE3_BENCH_TREE": str(tree), "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def memory_child(n: int, base_url: str, concurrency: int, stream: bool, transport: str) -> None:
    """Run in a subprocess: peak RSS growth during the pool, and during the final Parquet write."""
    prompts = make_prompts(n, tag=f"memory{n}")

    def rss() -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    peak = {"value": 0, "pool": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak["value"] = max(peak["value"], rss())
            time.sleep(0.02)

    def log(message: str) -> None:
        if " finished: " in message:  # the pool has drained; what follows is the final Parquet assembly
            peak["pool"] = max(peak["value"], rss())

    import gc

    gc.collect()
    base = rss()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    with tempfile.TemporaryDirectory() as tmp:
        ns = argparse.Namespace(concurrency=concurrency, max_tokens=8000, stream=stream)
        run_engine(prompts, base_url, ns, Path(tmp), transport=transport, log=log)
    stop.set()
    thread.join()
    print(
        json.dumps(
            {
                "n": n,
                "base_mb": base / 2**20,
                "pool_growth_mb": (peak["pool"] - base) / 2**20,
                "peak_growth_mb": (peak["value"] - base) / 2**20,
            }
        )
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=GenerationConfig.concurrency)
    parser.add_argument("--rate", type=float, default=500.0, help="tokens/s per sequence")
    parser.add_argument("--median-tokens", type=float, default=300.0)
    parser.add_argument("--sigma", type=float, default=0.8)
    parser.add_argument("--max-tokens", type=int, default=GenerationConfig.max_tokens)
    parser.add_argument("--seed", type=int, default=0)  # own default: the fake server's lengths
    parser.add_argument("--stream", action="store_true", help="engine in streaming mode")
    parser.add_argument("--stream-interval", type=float, default=0.02, help="fake server's SSE chunk interval")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument(
        "--transports",
        default="aiohttp,openai",
        help="engine transports to run, comma-separated (aiohttp = the default; openai = stock openai.AsyncOpenAI)",
    )
    parser.add_argument("--before", type=Path, help="another checkout whose engine runs side by side (baseline)")
    parser.add_argument("--before-transports", default="openai", help="its transports, comma-separated")
    parser.add_argument("--memory-sizes", default="1000,4000")
    parser.add_argument("--quick", action="store_true", help="500 requests, C=64, baseline on the same")
    parser.add_argument("--memory-child", nargs=2, metavar=("N", "URL"), help=argparse.SUPPRESS)
    parser.add_argument("--engine-child", nargs=2, metavar=("URL", "TRANSPORT"), help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.engine_child:
        engine_child(args, *args.engine_child)
        return
    if args.memory_child:
        memory_child(
            int(args.memory_child[0]),
            args.memory_child[1],
            args.concurrency,
            args.stream,
            args.transports.split(",")[0],
        )
        return
    if args.quick:
        args.requests, args.concurrency = 500, 64
    compare_engines(args)
    sizes = [int(s) for s in args.memory_sizes.split(",") if s]
    if sizes:
        report_memory(args, sizes)


def compare_engines(args: argparse.Namespace) -> None:
    """Every engine run of the command line against one fake server, then the table and the verdicts."""
    fake = FakeConfig(
        token_rate=args.rate,
        median_tokens=args.median_tokens,
        sigma=args.sigma,
        seed=args.seed,
        stream_interval_s=args.stream_interval,
    )
    prompts = make_prompts(args.requests)
    durs, lengths = durations(prompts, fake, args.max_tokens)
    c = args.concurrency
    ideal = sum(durs) / c
    ceiling = in_order_ceiling(durs, c)
    batch_ideal = batch_bound(durs, c)
    print(
        f"workload: {args.requests} requests, C={c}, {args.rate:g} tok/s per sequence, lognormal median "
        f"{args.median_tokens:g} sigma {args.sigma:g} (max {max(lengths)} tokens, sum {sum(lengths):,}), "
        f"{'streaming' if args.stream else 'non-streaming'}; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )

    rows: list[tuple[str, float, str]] = [("ideal sum(d)/C", ideal, ""), ("in-order ceiling", ceiling, "")]
    verdicts = []
    runs = [("", ROOT, t) for t in args.transports.split(",") if t]
    if args.before is not None:
        runs = [("before ", args.before.resolve(), t) for t in args.before_transports.split(",") if t] + runs
    cpu_of: dict[str, float] = {}
    with FakeServerProcess(fake) as server:
        for label, tree, transport in runs:
            server.reset_stats()
            server_cpu0 = server.cpu_seconds()
            engine = run_engine_in(tree, args, server.base_url, transport)
            server_cpu = server.cpu_seconds() - server_cpu0
            assert server.stats()["total_requests"] == args.requests
            cpu = cpu_of[f"{label}{transport}"] = engine["cpu_ms_per_request"]
            name = f"{label}engine [{transport}]"
            rows.append(
                (
                    f"{name}: request pool",
                    engine["pool_s"],
                    f"client CPU {cpu:.2f} ms/request (whole call), server CPU "
                    f"{1000 * server_cpu / args.requests:.2f} ms/request",
                )
            )
            rows.append(
                (f"{name}: generate_partition", engine["wall_s"], "end to end: + setup, preflight, final Parquet")
            )
            ratio = ceiling / engine["pool_s"]
            verdicts.append(
                f"  {name} {'PASS' if ratio >= 0.97 and cpu <= 2.0 else 'FAIL'}: "
                f"{ratio:.3f} of the ceiling at {cpu:.2f} ms client CPU/request"
            )
        if not args.skip_baseline:
            server.reset_stats()
            wall = asyncio.run(_batch_then_gather(prompts, server.base_url, args))
            note = f"its zero-overhead bound {batch_ideal:.1f}s"
            rows.append(("batch-then-gather (SDK create + gather)", wall, note))

    print()
    print(f"{'':48s} {'wall s':>8s} {'ideal/wall':>11s} {'ceiling/wall':>13s}")
    for name, wall, note in rows:
        print(f"{name:48s} {wall:8.2f} {ideal / wall:11.3f} {ceiling / wall:13.3f}  {note}")
    print(
        f"\nacceptance 4 (request pool >= 0.97 of the in-order ceiling at <= 2 ms client CPU/request; "
        f"load now {os.getloadavg()[0]:.1f}):"
    )
    print("\n".join(verdicts))
    for before in (k for k in cpu_of if k.startswith("before ")):
        for after in (k for k in cpu_of if not k.startswith("before ")):
            print(
                f"  client CPU/request, [{after}] / [{before}]: {cpu_of[after] / cpu_of[before]:.2f} "
                f"({cpu_of[after]:.2f} vs {cpu_of[before]:.2f} ms)"
            )


def report_memory(args: argparse.Namespace, sizes: list[int]) -> None:
    """Peak RSS growth of the first transport's engine at each size, each in a fresh process."""
    c = args.concurrency
    mem_fake = FakeConfig(token_rate=20000, median_tokens=args.median_tokens, sigma=args.sigma, seed=args.seed)
    results = []
    with FakeServerProcess(mem_fake) as server:
        for n in sizes:
            cmd = [
                sys.executable,
                __file__,
                "--concurrency",
                str(c),
                "--transports",
                args.transports.split(",")[0],
                "--memory-child",
                str(n),
                server.base_url,
            ]
            if args.stream:
                cmd.append("--stream")
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
    print(
        "\npeak RSS growth of a generate_partition run (fresh process, above its start; the final Parquet is "
        "assembled from the journal, so that phase holds one partition's rows by design):"
    )
    for r in results:
        print(
            f"  N={r['n']:>6}: request pool +{r['pool_growth_mb']:.1f} MiB, whole call incl. final Parquet "
            f"+{r['peak_growth_mb']:.1f} MiB (process base {r['base_mb']:.0f} MiB)"
        )


if __name__ == "__main__":
    main()
