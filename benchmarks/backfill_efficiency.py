"""Is the server kept full across partition boundaries, without being overfilled? (issue 15)

N partitions go through a REAL ``dagster-daemon`` asset backfill (run queue, ``vllm`` pool, one run process per
partition, with the repo's dagster_home/dagster.yaml) against one server of capacity C (the fake vLLM with
``max_num_seqs`` = C, lognormal response lengths, a fixed per-sequence token rate). Printed side by side:

- server-busy efficiency: ideal / (first request to last response), ideal = sum of the sequences' generation
  times / C (= total tokens / (C x per-sequence rate) when there is no time to first token);
- the continuous in-order ceiling: the same ratio for one perfect pool of C slots taking all N x P samples in
  key order (only the very last tail is lost), and partition after partition (every partition pays its tail);
- the largest waiting queue the server had (acceptance: never above 10% of C) and the peak in flight;
- when each partition landed (they should land in key order), and the machine's load average.

    .venv/bin/python benchmarks/backfill_efficiency.py                        # acceptance: 6 x 1,000, C=128
    .venv/bin/python benchmarks/backfill_efficiency.py --partitions 3 --partition-size 200 --capacity 32
    .venv/bin/python benchmarks/backfill_efficiency.py --vllm --partitions 3 --partition-size 64 --capacity 16

``--vllm`` runs the same backfill against the real CPU vLLM on the tiny test model (``--max-num-seqs C``); its
per-sequence rate depends on the batch, so there the busy figure is the mean of ``vllm:num_requests_running``
over C (sampled from /metrics every 0.1 s) and the ceilings use each sample's measured latency.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import shutil
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
import _common  # noqa: E402 (this checkout's package first on sys.path)
from eagle3_assets.core.partition_keys import PARTITION_SIZE  # noqa: E402
from eagle3_assets.generation.capacity import metrics_url, parse_load  # noqa: E402
from eagle3_assets.generation.generation_config import GenerationConfig  # noqa: E402
from fake_vllm import FakeConfig, FakeServerProcess  # noqa: E402


def in_order_ceiling(durations: list[float], capacity: int) -> float:
    """Wall time of a perfect pool of ``capacity`` slots taking the samples in order, each the instant a slot
    frees up."""
    slots = [0.0] * capacity
    for d in durations:
        heapq.heappush(slots, heapq.heappop(slots) + d)
    return max(slots)


def write_inputs(root: Path, partitions: int, size: int) -> dict[str, Path]:
    prompts = root / "prompts.jsonl"
    with prompts.open("w") as handle:
        for i in range(partitions * size):
            handle.write(json.dumps({"id": f"s{i:07d}", "prompt": f"backfill benchmark question {i}"}) + "\n")
    home = root / "dagster_home"
    home.mkdir()
    shutil.copy(ROOT / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    workspace = root / "workspace.yaml"
    workspace.write_text(
        "load_from:\n  - python_module:\n      module_name: eagle3_assets.definitions\n"
        "      location_name: eagle3_assets\n"
    )
    return {"prompts": prompts, "home": home, "workspace": workspace, "data": root / "data"}


class LoadSampler:
    """Samples the server's running/waiting gauges every ``interval_s`` on a thread (the real-vLLM mode's
    busy measure, and a cross-check of the fake server's own peaks)."""

    def __init__(self, base_url: str, interval_s: float = 0.1) -> None:
        self.url = metrics_url(base_url)
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                with urllib.request.urlopen(self.url, timeout=5) as response:
                    load = parse_load(response.read().decode())
            except OSError:
                continue
            if load is not None:
                self.samples.append((time.time(), load.running, load.waiting))

    def busy(self, capacity: int) -> tuple[float, float, float, int]:
        """(first busy sample, last busy sample, mean running / capacity between them, peak waiting)."""
        busy = [s for s in self.samples if s[1] + s[2] > 0]
        if not busy:
            return 0.0, 0.0, 0.0, 0
        inside = [s for s in self.samples if busy[0][0] <= s[0] <= busy[-1][0]]
        mean = sum(s[1] for s in inside) / len(inside) / capacity
        return busy[0][0], busy[-1][0], mean, max(s[2] for s in self.samples)


def run_backfill(paths: dict[str, Path], env: dict[str, str], partitions: int, timeout_s: float) -> dict[str, Any]:
    """raw_prompts in this process, then one daemon-run backfill of the missing synthetic_responses."""
    os.environ.update(env)
    import dagster as dg

    from eagle3_assets.defs.prompts import raw_prompts
    from eagle3_assets.defs.registry import default_resources
    from eagle3_assets.operations import backfill

    with dg.DagsterInstance.get() as instance:
        assert dg.materialize([raw_prompts], instance=instance, resources=default_resources()).success
        # Every storage created now: the daemon and this process creating the SQLite schemas at once collide.
        instance.get_runs(limit=1), instance.get_backfills(), instance.all_instigator_state()
        instance.get_daemon_heartbeats()
        command = ["dagster-daemon", "run", "-w", str(paths["workspace"])]
        log = paths["home"].parent / "daemon.log"
        with _common.dagster_process(command, {}, paths["workspace"].parent, log) as proc:
            plan = backfill.plan_missing(instance, downstream=False)
            backfill_id = backfill.launch(instance, plan)
            launched = time.time()
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError((paths["home"].parent / "daemon.log").read_text()[-3000:])
                runs = instance.get_runs(dg.RunsFilter(tags={"dagster/backfill": backfill_id}))
                if len(runs) == partitions and all(r.is_finished for r in runs):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"backfill {backfill_id} not done after {timeout_s:.0f} s")
                time.sleep(1)
            landed = {}
            for run in runs:
                stats = instance.get_run_stats(run.run_id)
                landed[run.tags["dagster/partition"]] = (run.status.value, stats.end_time or 0.0)
    return {"backfill_id": backfill_id, "launched": launched, "landed": landed}


def sample_durations(data: Path, keys: list[str], fake: FakeConfig | None) -> list[list[float]]:
    """Per partition, in sample order: each sequence's generation time (fake: from its token count; vLLM: its
    measured latency)."""
    import polars as pl

    from eagle3_assets.core.storage import DataLayout

    layout = DataLayout.at(data)
    out = []
    for key in keys:
        frame = pl.read_parquet(layout.responses_path(key)).sort("sample_id")
        if fake is not None:
            tokens = frame["completion_tokens"].to_list()
            out.append([fake.ttft_s + n / fake.token_rate for n in tokens])
        else:
            out.append(frame["latency_s"].to_list())
    return out


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--partition-size", type=int, default=PARTITION_SIZE)
    parser.add_argument("--capacity", type=int, default=128, help="the server's max_num_seqs")
    parser.add_argument("--token-rate", type=float, default=400.0, help="fake: tokens/s per sequence")
    parser.add_argument("--median-tokens", type=float, default=800.0)
    parser.add_argument("--sigma", type=float, default=0.8)
    parser.add_argument("--max-tokens", type=int, default=GenerationConfig.max_tokens)
    parser.add_argument("--transport", default="", help="EAGLE3_TRANSPORT for the runs (default: the project's)")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--vllm", action="store_true", help="the real CPU vLLM on the tiny model instead")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, data)")
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="backfill_efficiency_"))
    paths = write_inputs(root, args.partitions, args.partition_size)
    keys = [f"{i:05d}" for i in range(args.partitions)]
    load_before = load_average()
    fake: FakeConfig | None = None
    with contextlib_server(args, root) as (base_url, model, fake_process):
        if fake_process is not None:
            fake = fake_process.config
        env = {
            "DAGSTER_HOME": str(paths["home"]),
            "EAGLE3_DATA_DIR": str(paths["data"]),
            "EAGLE3_PROMPTS_PATH": str(paths["prompts"]),
            "EAGLE3_PARTITION_SIZE": str(args.partition_size),
            "EAGLE3_VLLM_BASE_URL": base_url,
            "EAGLE3_MODEL": model,
            "EAGLE3_CONCURRENCY": str(args.capacity),
            "EAGLE3_MAX_TOKENS": str(args.max_tokens),
        }
        if args.transport:
            env["EAGLE3_TRANSPORT"] = args.transport
        with LoadSampler(base_url) as sampler:
            outcome = run_backfill(paths, env, args.partitions, args.timeout_s)
        stats = fake_process.stats() if fake_process is not None else None
    durations = sample_durations(paths["data"], keys, fake)
    report(args, outcome, stats, sampler, durations, load_before)
    if args.keep:
        (root / "load_samples.json").write_text(json.dumps(sampler.samples))
        print(f"kept {root} (load_samples.json: [time, running, waiting] every 0.1 s)")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0


@contextmanager
def contextlib_server(args: argparse.Namespace, root: Path) -> Iterator[tuple[str, str, FakeServerProcess | None]]:
    if not args.vllm:
        fake = FakeConfig(
            max_num_seqs=args.capacity,
            token_rate=args.token_rate,
            median_tokens=args.median_tokens,
            sigma=args.sigma,
            max_model_len=max(32768, args.max_tokens + 1024),
        )
        with FakeServerProcess(fake) as server:
            yield server.base_url, fake.model, server
        return
    from eagle3_assets.local.tiny_model import build_tiny_model
    from eagle3_assets.local.vllm_server import LocalVLLMServer
    from eagle3_assets.net.ports import find_free_port

    model_dir = build_tiny_model(root / "models" / "tiny-verifier", seed=0)
    server = LocalVLLMServer(
        model=model_dir,
        port=find_free_port(),
        max_model_len=max(1024, args.max_tokens + 256),
        extra_args=["--max-num-seqs", str(args.capacity)],
        log_dir=root / "vllm_logs",
    )
    server.start()
    try:
        yield server.base_url, server.model_name, None
    finally:
        server.stop()


def report(
    args: argparse.Namespace,
    outcome: dict[str, Any],
    stats: dict[str, Any] | None,
    sampler: LoadSampler,
    durations: list[list[float]],
    load_before: str,
) -> None:
    capacity = args.capacity
    flat = [d for part in durations for d in part]
    ideal = sum(flat) / capacity
    continuous = in_order_ceiling(flat, capacity)
    one_by_one = sum(in_order_ceiling(part, capacity) for part in durations)
    first, last, mean_running, sampled_peak_waiting = sampler.busy(capacity)
    if stats is not None:  # the fake server's exact figures
        span = stats["last_response_at"] - stats["first_request_at"]
        busy = ideal / span
        peak_waiting, peak_in_flight = stats["max_waiting"], stats["max_in_flight"]
        exact = stats["busy_seq_s"] / (capacity * span)
        source = f"fake server, {args.token_rate:g} tok/s per sequence (exact busy fraction {exact:.3f})"
    else:
        span = last - first
        busy = mean_running
        peak_waiting, peak_in_flight = sampled_peak_waiting, None
        source = "real CPU vLLM (gauges sampled every 0.1 s)"
    print(
        f"backfill {outcome['backfill_id']}: {args.partitions} partitions x {args.partition_size} samples, "
        f"capacity {capacity}, {source}"
    )
    print(f"total sequence time {sum(flat):,.0f} s, ideal {ideal:,.1f} s, first request to last response {span:,.1f} s")
    rows = [
        ("server-busy (this backfill)", busy, span),
        ("continuous in-order ceiling", ideal / continuous, continuous),
        ("partition after partition", ideal / one_by_one, one_by_one),
    ]
    for name, value, wall in rows:
        print(f"  {name:30s} {value:6.3f}   ({wall:,.1f} s)")
    ratio = busy / (ideal / continuous)
    print(f"  of the in-order ceiling        {ratio:6.3f}   (acceptance >= 0.95)")
    limit = capacity // 10
    print(
        f"largest waiting queue {peak_waiting} (acceptance <= {limit}, 10% of capacity); "
        f"sampled peak {sampled_peak_waiting}; peak in flight {peak_in_flight}"
    )
    order = sorted(outcome["landed"].items(), key=lambda kv: kv[1][1])
    landed = ", ".join(f"{key} {status} +{end - outcome['launched']:.0f}s" for key, (status, end) in order)
    print(f"partitions landed: {landed}")
    in_key_order = [k for k, _ in order] == sorted(outcome["landed"])
    print(f"landed in key order: {in_key_order}; load average before {load_before}, after {load_average()}")


if __name__ == "__main__":
    raise SystemExit(main())
