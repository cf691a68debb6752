"""Per-partition orchestration overhead: Dagster's in-process executor (definitions.py) vs its default
multiprocess executor, side by side on the same no-op partitioned asset.

Usage: ``python benchmarks/partition_overhead.py [--runs 3]``. Each run materializes one partition of a
no-op asset shaped like ``synthetic_responses`` (dynamic partition, pool "vllm", two checks, the same
resources), so what is measured is what Dagster adds around a partition: run setup, the step's process,
importing the code location, events, and teardown. The step process of the multiprocess executor imports
this module, which imports the real code location (``eagle3_assets.definitions``) like a production step.

Prints seconds per run for each executor and the ratio. Uses a throw-away DAGSTER_HOME in a temp folder.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import dagster as dg

import eagle3_assets.definitions  # noqa: F401  (a real step process pays this import too)

PARTITIONS = dg.DynamicPartitionsDefinition(name="overhead_partitions")


@dg.asset(
    partitions_def=PARTITIONS,
    pool="vllm",
    check_specs=[
        dg.AssetCheckSpec("complete", asset="noop_partition"),
        dg.AssetCheckSpec("error_rate", asset="noop_partition"),
    ],
)
def noop_partition(context: dg.AssetExecutionContext):
    """Does nothing: an empty partition."""
    yield dg.MaterializeResult(metadata={"dg.row_count": 0, "partition": context.partition_key})
    yield dg.AssetCheckResult(check_name="complete", passed=True)
    yield dg.AssetCheckResult(check_name="error_rate", passed=True)


def in_process_job() -> dg.JobDefinition:
    return _job("noop_in_process", dg.in_process_executor)


def multiprocess_job() -> dg.JobDefinition:
    return _job("noop_multiprocess", dg.multiprocess_executor)


def _job(name: str, executor: dg.ExecutorDefinition) -> dg.JobDefinition:
    defs = dg.Definitions(
        assets=[noop_partition],
        jobs=[dg.define_asset_job(name, selection=[noop_partition], partitions_def=PARTITIONS, executor_def=executor)],
    )
    return defs.resolve_job_def(name)


def time_runs(instance: dg.DagsterInstance, job_fn, keys: list[str]) -> list[float]:  # type: ignore[no-untyped-def]
    seconds = []
    for key in keys:
        start = time.perf_counter()
        with dg.execute_job(dg.reconstructable(job_fn), instance, tags={"dagster/partition": key}) as result:
            if not result.success:
                raise RuntimeError(f"{job_fn.__name__} failed on partition {key}")
        seconds.append(time.perf_counter() - start)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="partitions (runs) per executor; default %(default)s")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="partition-overhead-") as home:
        Path(home, "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        with dg.DagsterInstance.from_config(home) as instance:
            keys = [f"{i:05d}" for i in range(2 * args.runs + 2)]
            instance.add_dynamic_partitions(PARTITIONS.name, keys)
            # One warm-up run each (first-use costs: SQLite schema, imports), then interleaved so machine
            # noise hits both executors alike.
            time_runs(instance, in_process_job, keys[:1])
            time_runs(instance, multiprocess_job, keys[1:2])
            timings: dict[str, list[float]] = {"in_process": [], "multiprocess": []}
            for i in range(args.runs):
                timings["in_process"] += time_runs(instance, in_process_job, [keys[2 + 2 * i]])
                timings["multiprocess"] += time_runs(instance, multiprocess_job, [keys[3 + 2 * i]])
    in_proc, multi = (statistics.median(timings[k]) for k in ("in_process", "multiprocess"))
    print(f"per-partition orchestration overhead (median of {args.runs} no-op partition runs each)")
    print(f"{'executor':<30}{'s/partition':>12}  runs")
    for name, label in (("in_process", "in_process (definitions.py)"), ("multiprocess", "multiprocess (default)")):
        runs = ", ".join(f"{s:.2f}" for s in timings[name])
        print(f"{label:<30}{statistics.median(timings[name]):>12.2f}  {runs}")
    print(f"ratio multiprocess / in_process: {multi / in_proc:.2f}x")
    chosen_lower = in_proc <= multi
    print(f"chosen executor (in_process) is {'the lower' if chosen_lower else 'NOT the lower'}")
    return 0 if chosen_lower else 1


if __name__ == "__main__":
    sys.exit(main())
