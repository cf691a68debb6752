"""raw_prompts in bounded memory: its peak resident memory and rows per second over a JSONL and a Parquet dataset
of a given size (issue 31, "Huge inputs").

For each format it writes a dataset of ``--size-gb`` (default 10 GB; conversations of a few KB, 1% exact
duplicates, 0.5% rejects) under ``--dir`` or a temporary folder (never the working directory), materializes the
real ``raw_prompts`` asset over it in a child process, and prints that process's peak resident memory (VmHWM from
``/proc``, the imports included), its resident memory before the materialization, and rows and MB per second.
Each dataset is deleted after its run.

    .venv/bin/python benchmarks/raw_prompts_memory.py                       # 10 GB each: needs ~25 GB free
    .venv/bin/python benchmarks/raw_prompts_memory.py --size-gb 1 --dir /mnt/scratch

What memory holds per sample is its id, line, content digest and prompt length (~260 bytes, measured), so the
peak grows by that per row and never with the rows' text. ``tests/integration/test_safety_huge_inputs.py`` runs
the same child at sizes CI affords.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import _common  # noqa: F401 (this checkout's package first on sys.path)
from eagle3_assets.core.partition_keys import PARTITION_SIZE

FORMATS = ("jsonl", "parquet")
# Rows written to the Parquet dataset per row group (a few hundred MB of text, as a bulk export writes them).
PARQUET_ROW_GROUP_ROWS = 65_536
DUPLICATE_EVERY = 100  # one exact copy of an earlier row in this many
REJECT_EVERY = 200  # one row with an empty user turn in this many
PARAGRAPHS = 2_000
WORDS = 4_000


def memory_mb(field: str) -> float:
    """This process's ``VmHWM`` (peak) or ``VmRSS`` (now) from /proc, in MB: its own, not a parent's (unlike
    ``ru_maxrss``, which a forked child inherits)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", status)[1]) / 1024


def _paragraphs(rng: random.Random) -> list[str]:
    """Word salad from a random vocabulary: text of realistic length that compresses about as poorly as prose."""
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    vocabulary = ["".join(rng.choices(letters, k=rng.randint(2, 10))) for _ in range(WORDS)]
    return [" ".join(rng.choices(vocabulary, k=rng.randint(40, 160))) for _ in range(PARAGRAPHS)]


def conversations(seed: int = 0) -> Iterator[dict]:
    """Distinct OpenAI-style conversations (system, user, assistant, user, assistant; ~3 KB of text each) with an
    exact duplicate every :data:`DUPLICATE_EVERY` rows and a rejected row every :data:`REJECT_EVERY`, forever."""
    rng = random.Random(seed)
    paragraphs = _paragraphs(rng)

    def text(index: int, parts: int) -> str:
        return f"[{index}] " + "\n\n".join(rng.choice(paragraphs) for _ in range(parts))

    def rejected(index: int) -> bool:  # never a multiple of DUPLICATE_EVERY: those rows are the duplicates
        return index % REJECT_EVERY == 1

    previous: dict | None = None
    index = 0
    while True:
        index += 1
        if previous is not None and index % DUPLICATE_EVERY == 0:
            yield previous
            continue
        row = {
            "id": f"bench-{index}",
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": text(index, rng.randint(1, 4))},
                {"role": "assistant", "content": text(index, rng.randint(1, 6))},
                {"role": "user", "content": "" if rejected(index) else text(index, rng.randint(1, 3))},
                {"role": "assistant", "content": text(index, rng.randint(1, 4))},
            ],
        }
        previous = row
        yield row


def write_jsonl(path: Path, size_bytes: int, seed: int = 0) -> int:
    """A JSONL dataset of about ``size_bytes``; returns its rows."""
    written = rows = 0
    with open(path, "w", encoding="utf-8") as handle:
        for row in conversations(seed):
            line = json.dumps(row) + "\n"
            handle.write(line)
            written += len(line)
            rows += 1
            if written >= size_bytes:
                return rows
    raise AssertionError("unreachable: conversations() never ends")


def write_parquet(path: Path, size_bytes: int, seed: int = 0, row_group_rows: int = PARQUET_ROW_GROUP_ROWS) -> int:
    """An uncompressed Parquet dataset of about ``size_bytes`` on disk (so the file's size is its data's), in row
    groups of ``row_group_rows``; returns its rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    messages = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    schema = pa.schema([("id", pa.string()), ("messages", messages)])
    rows = 0
    source = conversations(seed)
    with pq.ParquetWriter(path, schema, compression="none") as writer:
        while path.stat().st_size < size_bytes:
            batch, batch_bytes = [], 0
            while len(batch) < row_group_rows and path.stat().st_size + batch_bytes < size_bytes:
                row = next(source)
                batch.append(row)
                batch_bytes += sum(len(m["content"]) + 16 for m in row["messages"]) + len(row["id"])
            writer.write_table(pa.Table.from_pylist(batch, schema=schema))
            rows += len(batch)
    return rows


def write_dataset(kind: str, folder: Path, size_bytes: int, seed: int = 0) -> tuple[Path, int]:
    """A ``kind`` (jsonl or parquet) dataset of about ``size_bytes`` in ``folder``: (its path, its rows)."""
    path = folder / f"prompts-{size_bytes}.{kind}"
    rows = write_jsonl(path, size_bytes, seed) if kind == "jsonl" else write_parquet(path, size_bytes, seed)
    return path, rows


def measure(dataset: Path, data_dir: Path, partition_size: int = 1000, timeout_s: float | None = None) -> dict:
    """Materialize ``raw_prompts`` over ``dataset`` into ``data_dir`` in a child process (this file's ``--child``
    mode); what it measured: peak_mb, baseline_mb (resident before the materialization, its libraries imported),
    seconds, cpu_s, rows_read, rows (in the table), rejects, duplicates, rows_per_s, rows_per_cpu_s, mb_per_s,
    success."""
    command = [sys.executable, __file__, "--child", str(dataset), str(data_dir), str(partition_size)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the raw_prompts child failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child(dataset: Path, data_dir: Path, partition_size: int) -> None:
    """The measured process: Dagster's real materialize() of the raw_prompts asset, as a run does it."""
    import dagster as dg
    import polars  # noqa: F401 (imported before the baseline is taken: what the run uses besides the data)
    import pyarrow.parquet  # noqa: F401

    from eagle3_assets.defs.prompts import raw_prompts
    from eagle3_assets.defs.resources import DataStoreResource, PromptDatasetResource

    resources = {
        "data_store": DataStoreResource(data_dir=str(data_dir)),
        "prompt_dataset": PromptDatasetResource(path=str(dataset), partition_size=partition_size),
    }
    baseline = memory_mb("VmRSS")
    started, cpu_started = time.perf_counter(), time.process_time()
    with dg.DagsterInstance.ephemeral() as instance:
        result = dg.materialize([raw_prompts], instance=instance, resources=resources, raise_on_error=False)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    metadata = result.asset_materializations_for_node("raw_prompts")[0].metadata if result.success else {}

    def value(key: str) -> int:
        return int(metadata[key].value) if key in metadata else 0

    rows_read = value("rows_read")
    print(
        json.dumps(
            {
                "success": result.success,
                "peak_mb": round(memory_mb("VmHWM"), 1),
                "baseline_mb": round(baseline, 1),
                "seconds": round(seconds, 2),
                "cpu_s": round(cpu_seconds, 2),  # on a shared machine, rows per CPU second say more than per second
                "rows_per_cpu_s": round(rows_read / cpu_seconds),
                "rows_read": rows_read,
                "rows": value("dagster/row_count"),
                "rejects": value("rejects"),
                "duplicates": value("duplicates"),
                "rows_per_s": round(rows_read / seconds),
                "mb_per_s": round(dataset.stat().st_size / 1e6 / seconds, 1),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gb", type=float, default=10.0, help="size of each dataset file (GB, 10**9 bytes)")
    parser.add_argument("--dir", type=Path, help="folder for the datasets and the data dir (default: a temp folder)")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated: jsonl, parquet")
    parser.add_argument("--partition-size", type=int, default=PARTITION_SIZE)
    parser.add_argument("--child", nargs=3, metavar=("DATASET", "DATA_DIR", "PARTITION_SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        dataset, data_dir, partition_size = args.child
        _child(Path(dataset), Path(data_dir), int(partition_size))
        return
    size_bytes = int(args.size_gb * 1e9)
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="raw-prompts-memory-", dir=args.dir) as folder:
        root = Path(folder)
        free = shutil.disk_usage(root).free
        if free < 2.5 * size_bytes:  # the dataset, the table (zstd) and the rejects beside it
            raise SystemExit(f"{root}: {free / 1e9:.1f} GB free, need ~{2.5 * size_bytes / 1e9:.1f} GB; use --dir")
        for kind in args.formats.split(","):
            started = time.perf_counter()
            dataset, rows = write_dataset(kind, root, size_bytes)
            written_s, file_gb = time.perf_counter() - started, dataset.stat().st_size / 1e9
            try:
                out = measure(dataset, root / f"data-{kind}", args.partition_size)
            finally:
                dataset.unlink()
                shutil.rmtree(root / f"data-{kind}", ignore_errors=True)
            print(
                json.dumps(
                    {"format": kind, "file_gb": round(file_gb, 2), "file_rows": rows, "write_s": round(written_s)} | out
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
