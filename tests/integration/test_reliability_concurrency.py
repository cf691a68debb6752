"""Issue 8, two runs of one partition at once (a double click in the UI, a backfill overlapping a manual run):
the second fails at once with PartitionBusyError naming the partition and the holder, writes nothing, and the
first completes intact. (A lock held by the test itself is covered by
tests/unit/test_generation_engine.py::test_second_writer_of_a_partition_is_refused; here the first writer is a real,
running generation in another process.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from eagle3_assets.core.storage import DataLayout, PartitionBusyError
from eagle3_assets.defs.inference import RemoteVLLMResource
from eagle3_assets.defs.prompts import raw_prompts
from eagle3_assets.generation import PromptToGenerate, generate_partition, partition_prompts
from eagle3_assets.generation.journal import read_journal
from fake_vllm import FakeConfig, FakeServerProcess
from support.common import child_env, make_resources, materialize_responses, reaped, write_jsonl
from support.reliability import journal_lines, make_prompts, quick_config, wait_for

# The first writer: generate_partition of one partition in its own process, slow enough to be caught mid-run.
WRITER = textwrap.dedent(
    """
    import sys
    from eagle3_assets.generation import GenerationConfig, generate_partition, partition_prompts
    from eagle3_assets.core.storage import DataLayout

    url, root, key = sys.argv[1], sys.argv[2], sys.argv[3]
    layout = DataLayout.at(root)
    config = GenerationConfig(base_urls=[url], model="fake-model", concurrency=2, max_tokens=4000,
                              fsync_interval_s=0.2, progress_interval_s=0.5)
    result = generate_partition(partition_prompts(layout, key), key, layout, config, log=lambda m: None)
    print("DONE", result.ok, result.failed, result.total, flush=True)
    """
)


@contextmanager
def first_writer(tmp_path: Path, url: str, layout: DataLayout, key: str) -> Iterator[subprocess.Popen[str]]:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    child = subprocess.Popen(
        [sys.executable, str(script), url, str(layout.root), key],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    with reaped(child):
        yield child


def _dataset(tmp_path: Path, n: int) -> Path:
    return write_jsonl(
        tmp_path / "prompts.jsonl", [{"id": f"c{i:04d}", "prompt": f"concurrency {i}"} for i in range(n)]
    )


def _check_intact(layout: DataLayout, key: str, prompts: list[PromptToGenerate]) -> None:
    frame = pl.read_parquet(layout.responses_path(key))
    assert frame["sample_id"].to_list() == [p.sample_id for p in prompts]  # once each, in partition order
    assert set(frame["status"]) == {"ok"} and frame["content"].null_count() == 0
    assert not layout.responses_in_progress_path(key).exists()


def _journal_is_clean(path: Path) -> int:
    """Every complete line parses and names a distinct sample: no interleaving, no duplicate writer."""
    contents = read_journal(path)
    assert contents.corrupt_lines == 0
    assert contents.lines == len(contents.records)
    return contents.lines


@pytest.mark.slow
def test_second_run_of_a_running_partition_fails_at_once_and_the_first_completes_intact(
    tmp_path: Path, layout: DataLayout, instance: dg.DagsterInstance
) -> None:
    key = "00000"
    fake = FakeConfig(token_rate=200, median_tokens=100, sigma=0.3)  # ~0.5 s per response, 2 in flight: ~7.5 s
    with FakeServerProcess(fake) as server:
        resources = make_resources(
            layout,
            _dataset(tmp_path, 30),
            partition_size=30,
            inference_server=RemoteVLLMResource(base_url=server.base_url, concurrency=4),
        )
        assert dg.materialize([raw_prompts], instance=instance, resources=resources).success
        prompts = partition_prompts(layout, key)
        journal = layout.responses_in_progress_path(key)
        with first_writer(tmp_path, server.base_url, layout, key) as child:
            wait_for(lambda: journal_lines(journal) >= 3 or child.poll() is not None, 60, "the first writer")
            assert child.poll() is None, child.communicate()[0]
            requests_before = server.stats()["total_requests"]
            lines_before = _journal_is_clean(journal)

            # 1) the engine entry point: refused at once, before any request
            started = time.monotonic()
            with pytest.raises(PartitionBusyError) as refused:
                generate_partition(prompts, key, layout, quick_config(server.base_url), log=lambda _m: None)
            assert time.monotonic() - started < 2.0
            message = str(refused.value)
            assert f"synthetic_responses partition {key} is being written by pid {child.pid}" in message
            assert str(layout.lock_path("synthetic_responses", key)) in message

            # 2) a Dagster materialization of the same partition (a double click in the UI)
            started = time.monotonic()
            result = materialize_responses(
                key,
                instance,
                resources,
                raise_on_error=False,
            )
            assert not result.success and time.monotonic() - started < 20
            failure = result.get_step_failure_events()[0].event_specific_data.error
            assert failure is not None and "PartitionBusyError" in failure.to_string()
            assert f"being written by pid {child.pid}" in failure.to_string()

            # the first run is still going (no final file yet, checked before its process, so no race)
            assert not layout.responses_path(key).exists()
            assert child.poll() is None
            assert _journal_is_clean(journal) >= lines_before
            out, _ = child.communicate(timeout=60)
        assert child.returncode == 0, out
        assert "DONE 30 0 30" in out
        # every request the server saw belongs to the first writer: one per sample
        stats = server.stats()
        assert stats["total_requests"] == 30 and set(stats["requests"].values()) == {1}, (requests_before, stats)
    _check_intact(layout, key, prompts)

    # The lock is released with the first run (flock dies with its holder): the next run is accepted and,
    # finding everything done under the same settings (the writer's max_tokens; the model its manifest recorded,
    # since no server answers), sends nothing.
    dead = quick_config("http://127.0.0.1:9/v1", max_tokens=4000)
    again = generate_partition(prompts, key, layout, dead, log=lambda _m: None)
    assert (again.requested, again.resumed) == (0, 30)


def test_other_partitions_are_not_blocked_by_a_running_one(tmp_path: Path, layout: DataLayout) -> None:
    """The lock is per partition: partition 00001 generates while 00000 is locked by another process."""
    from eagle3_assets.core import storage

    with FakeServerProcess(FakeConfig(token_rate=5000, median_tokens=20)) as server:
        locker = subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(
                    """
                import sys, time
                from pathlib import Path
                from eagle3_assets.core import storage
                with storage.exclusive_lock(Path(sys.argv[1]), "test"):
                    print("LOCKED", flush=True)
                    time.sleep(60)
                """
                ),
                str(layout.lock_path("synthetic_responses", "00000")),
            ],
            env=child_env(),
            stdout=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        try:
            assert locker.stdout is not None and locker.stdout.readline().strip() == "LOCKED"
            with pytest.raises(storage.PartitionBusyError, match=f"pid {locker.pid}"):
                generate_partition(
                    make_prompts(3, "a"), "00000", layout, quick_config(server.base_url), log=lambda _m: None
                )
            result = generate_partition(
                make_prompts(5, "b"), "00001", layout, quick_config(server.base_url), log=lambda _m: None
            )
            assert result.ok == 5
        finally:
            locker.kill()
            locker.wait()
            locker.stdout.close()  # type: ignore[union-attr]
        # SIGKILL of the holder releases the lock: no stale lock file blocks the next run
        assert (
            generate_partition(
                make_prompts(3, "a"), "00000", layout, quick_config(server.base_url), log=lambda _m: None
            ).ok
            == 3
        )


HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from eagle3_assets.core import storage
    with storage.exclusive_lock(Path(sys.argv[1]), sys.argv[2]):
        print("LOCKED", flush=True)
        time.sleep(120)
    """
)


@contextmanager
def lock_held_elsewhere(lock: Path, what: str, cwd: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding ``lock``, as a running extraction or training holds it."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock), what], env=child_env(), stdout=subprocess.PIPE, text=True, cwd=cwd
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "LOCKED"
        yield holder
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()


def test_hidden_states_and_draft_model_refuse_a_second_writer_before_any_work(
    tmp_path: Path, layout: DataLayout
) -> None:
    """The same lock guards the other writers: while another process extracts partition 00000, a second
    extraction of it fails naming the holder before any work (it writes nothing), and partition 00001 extracts
    meanwhile; while another process trains the draft, a second training fails before writing anything under
    draft_model/. Once the holder dies (SIGKILL), its lock is gone."""
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
    from eagle3_assets.training import TrainConfig, train_draft
    from support.hidden_states_data import cached_tiny_verifier, fabricate_responses

    verifier = cached_tiny_verifier()
    config = HiddenStatesConfig(layer_ids=[1, 2, 3])
    for key in ("00000", "00001"):
        fabricate_responses(layout, key, 3, min_words=5, max_words=10)

    def written(asset: str) -> list[str]:
        folder = layout.asset_dir(asset)
        return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if "_locks" not in p.parts)

    lock = layout.lock_path("hidden_states", "00000")
    with lock_held_elsewhere(lock, "hidden_states partition 00000", tmp_path) as holder:
        with pytest.raises(PartitionBusyError) as refused:
            extract_partition(layout, "00000", verifier, config)
        assert f"hidden_states partition 00000 is being written by pid {holder.pid}" in str(refused.value)
        assert str(lock) in str(refused.value)
        assert written("hidden_states") == []
        assert extract_partition(layout, "00001", verifier, config).samples == 3  # other partitions go on
    assert extract_partition(layout, "00000", verifier, config).samples == 3  # the dead holder's lock is gone

    with lock_held_elsewhere(layout.lock_path("draft_model"), "draft_model training", tmp_path) as holder:
        with pytest.raises(PartitionBusyError, match=f"draft_model training is being written by pid {holder.pid}"):
            train_draft(layout, ["00000"], "00001", verifier, TrainConfig(epochs=1, max_steps_per_epoch=1))
        assert written("draft_model") == []
