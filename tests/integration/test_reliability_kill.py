"""Issue 8, kill anywhere (synthetic_responses): SIGKILL a partition's generation at a random point (several seeds,
from before the first response to during the final Parquet write); after re-materialization the output equals an
uninterrupted run's. tests/integration/test_generation_kill.py proves one kill point with exact request
accounting; this adds the random points."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import polars as pl
import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.generation import GenerationConfig, PromptToGenerate, generate_partition
from eagle3_assets.generation.journal import read_journal
from fake_vllm import FakeConfig, FakeServerProcess
from support.reliability import block_before_rename, block_inside_parquet_write, journal_lines, sigkill_child_when

KEY = "00007"
N = 120
SEEDS = [3, 11, 37]  # kill after 120 (all journaled: the final write), 111 and 0 journaled samples
COMPARED = [
    "sample_id",
    "messages",
    "reasoning",
    "content",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "status",
    "model",
    "sampling_params",
    "error",
]

CHILD = (
    block_before_rename(3)
    + block_inside_parquet_write(3)
    + textwrap.dedent(
        f"""
    import sys, time
    from eagle3_assets.generation import GenerationConfig, PromptToGenerate, generate_partition
    from eagle3_assets.core.storage import DataLayout

    url, root = sys.argv[1], sys.argv[2]
    prompts = [PromptToGenerate(f"anywhere-{{i:04d}}", [{{"role": "user", "content": f"kill anywhere {{i}}"}}])
               for i in range({N})]
    config = GenerationConfig(base_urls=[url], model="fake-model", concurrency=16, max_tokens=4000,
                              fsync_interval_s=0.1, progress_interval_s=0.5)
    print("START", flush=True)
    generate_partition(prompts, "{KEY}", DataLayout.at(root), config, log=lambda m: None)
    print("DONE", flush=True)
    time.sleep(3600)  # a kill just after the end still lands on a live process
    """
    )
)


def make_prompts() -> list[PromptToGenerate]:
    return [
        PromptToGenerate(f"anywhere-{i:04d}", [{"role": "user", "content": f"kill anywhere {i}"}]) for i in range(N)
    ]


def config(url: str) -> GenerationConfig:
    return GenerationConfig(base_urls=[url], model="fake-model", concurrency=16, max_tokens=4000)


@pytest.fixture(scope="module")
def server() -> FakeServerProcess:
    with FakeServerProcess(FakeConfig(token_rate=3000, median_tokens=150, sigma=0.8)) as running:
        yield running  # type: ignore[misc]


@pytest.fixture(scope="module")
def reference(server: FakeServerProcess, tmp_path_factory: pytest.TempPathFactory) -> pl.DataFrame:
    layout = DataLayout.at(tmp_path_factory.mktemp("reference") / "data")
    generate_partition(make_prompts(), KEY, layout, config(server.base_url), log=lambda _m: None)
    return pl.read_parquet(layout.responses_path(KEY))


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_sigkill_at_a_random_point_then_resume_equals_an_uninterrupted_run(
    seed: int, server: FakeServerProcess, reference: pl.DataFrame, tmp_path: Path
) -> None:
    rng = random.Random(seed)
    # the kill point: after 0..N journaled samples (N: during the Parquet write or just after), plus a jitter
    threshold = rng.choice([0, N, rng.randint(1, N - 1), rng.randint(1, N - 1)])
    jitter = rng.uniform(0, 0.05)
    layout = DataLayout.at(tmp_path / "data")
    journal = layout.responses_in_progress_path(KEY)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    sigkill_child_when(
        script, [server.base_url, str(layout.root)], lambda: journal_lines(journal) >= threshold, 60, jitter
    )

    before = read_journal(journal)
    assert before.corrupt_lines == 0 and before.lines == len(before.records)  # no duplicate, no mangled line
    finished_before = dict(before.records)
    if layout.responses_path(KEY).exists():  # the kill came after the rename
        done = pl.read_parquet(layout.responses_path(KEY))
        assert done.height == N  # a finished file is always whole
        finished_before.update({row["sample_id"]: row for row in done.iter_rows(named=True)})

    result = generate_partition(make_prompts(), KEY, layout, config(server.base_url), log=lambda _m: None)
    assert (result.total, result.ok, result.failed) == (N, N, 0)
    assert result.resumed == len(finished_before) and result.requested == N - len(finished_before)
    frame = pl.read_parquet(layout.responses_path(KEY))
    assert frame.select(COMPARED).equals(reference.select(COMPARED)), f"seed {seed}, threshold {threshold}"
    for row in frame.filter(pl.col("sample_id").is_in(list(finished_before))).iter_rows(named=True):
        assert row["finished_at"] == finished_before[row["sample_id"]]["finished_at"]  # kept, not regenerated
    assert list(layout.partition_files("synthetic_responses")) == [KEY]
    assert not list(layout.asset_dir("synthetic_responses").glob(".*.tmp-*"))  # no leftover of a killed write
    assert not journal.exists()


@pytest.mark.parametrize("point", ["inside-the-parquet-write", "before-the-rename"])
def test_sigkill_inside_the_final_write_then_resume_equals_an_uninterrupted_run(
    point: str, server: FakeServerProcess, reference: pl.DataFrame, tmp_path: Path
) -> None:
    """The child stops for good with half the final Parquet written, or with it written and not yet renamed, and is
    SIGKILLed there: the partition has no file, the journal holds every sample, and the next run writes the same
    rows without a request."""
    layout = DataLayout.at(tmp_path / "data")
    journal = layout.responses_in_progress_path(KEY)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    marker = tmp_path / "blocked"
    block = "--block-parquet" if point == "inside-the-parquet-write" else f".{KEY}.parquet.tmp-"
    sigkill_child_when(script, [server.base_url, str(layout.root), block, str(marker)], marker.exists, 60)
    temporaries = list(layout.asset_dir("synthetic_responses").glob(f".{KEY}.parquet.tmp-*"))
    assert len(temporaries) == 1 and not layout.responses_path(KEY).exists()  # killed with the temporary written
    assert layout.partition_files("synthetic_responses") == {} and journal_lines(journal) == N

    result = generate_partition(make_prompts(), KEY, layout, config(server.base_url), log=lambda _m: None)
    assert (result.requested, result.resumed) == (0, N)
    frame = pl.read_parquet(layout.responses_path(KEY))
    assert frame.select(COMPARED).equals(reference.select(COMPARED)), point
    assert not list(layout.asset_dir("synthetic_responses").glob(".*.tmp-*")) and not journal.exists()


def test_temporary_file_of_a_writer_killed_mid_write_is_removed_by_the_next_write(tmp_path: Path) -> None:
    """A SIGKILL during the final Parquet write leaves `.{key}.parquet.tmp-{pid}`; it never counts as a partition
    (the glob is `*.parquet`) and the next write of that file removes it. A live writer's temporary file is kept."""
    from eagle3_assets.core import storage

    layout = DataLayout.at(tmp_path / "data")
    target = layout.responses_path(KEY)
    target.parent.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = target.with_name(f".{target.name}.tmp-{dead.pid}")
    stale.write_bytes(b"PAR1 half a file")
    live = target.with_name(f".{target.name}.tmp-1")  # pid 1 is alive
    live.write_bytes(b"PAR1 being written")
    assert layout.partition_files("synthetic_responses") == {}
    storage.write_parquet_atomic(pl.DataFrame({"sample_id": ["a"]}), target)
    assert not stale.exists() and live.exists()
    assert list(layout.partition_files("synthetic_responses")) == [KEY]


def test_dead_writers_temporary_files_and_folders_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    """The sweep every resuming stage runs (storage.remove_dead_writers_temps): a dead writer's `.{name}.tmp-{pid}`
    file or folder and `.{name}.old-{pid}` folder go; a live writer's (pid 1, this process) and anything not named
    like a temporary entry stay; ``names`` limits the sweep to those targets."""
    from eagle3_assets.core import storage

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folder = tmp_path / "draft_model"
    folder.mkdir()
    gone = [f".epoch_0001.pt.tmp-{dead.pid}", f".final.tmp-{dead.pid}", f".final.old-{dead.pid}"]
    kept = [".epoch_0002.pt.tmp-1", f".final.tmp-{os.getpid()}", "final", ".hidden", ".final.tmp-x", "a.tmp-1"]
    other = f".training_history.json.tmp-{dead.pid}"  # dead, but outside ``names`` in the first sweep
    for name in [*gone, *kept, other]:
        if "final" in name:
            (folder / name).mkdir()
            (folder / name / "model.safetensors").write_bytes(b"weights")
        else:
            (folder / name).write_bytes(b"bytes")

    removed = storage.remove_dead_writers_temps(folder, {"epoch_0001.pt", "epoch_0002.pt", "final"})
    assert sorted(p.name for p in removed) == sorted(gone)
    assert sorted(p.name for p in folder.iterdir()) == sorted([*kept, other])
    assert [p.name for p in storage.remove_dead_writers_temps(folder)] == [other]
    assert sorted(p.name for p in folder.iterdir()) == sorted(kept)
    assert storage.remove_dead_writers_temps(tmp_path / "missing") == []


def test_a_folder_is_replaced_atomically_and_dead_writers_temporaries_are_swept_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`evaluation.offline.save_untrained_draft` (a stub model: no torch) through `storage.replace_dir_atomic`, the
    replacement `training.checkpoints.save_final` shares: a dead writer's `.untrained_draft.tmp-PID` / `.old-PID` are
    swept before the save, a live writer's and other targets' are kept; the old draft stays whole at its name until
    it is renamed aside (atomically) and the new one renamed into place; afterwards only the new draft is left. A
    failed rename of the new folder puts the old one back."""
    from eagle3_assets.core import storage
    from eagle3_assets.evaluation import offline

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folder = tmp_path / "draft_evaluation"
    out = folder / "untrained_draft"
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"old weights")
    (out / "config.json").write_text("{}")
    stale = [f".untrained_draft.tmp-{dead.pid}", f".untrained_draft.old-{dead.pid}"]
    kept = [".untrained_draft.tmp-1", f".report.json.tmp-{dead.pid}"]  # a live writer's; another target's
    for name in [*stale, *kept]:
        (folder / name).mkdir()
        (folder / name / "model.safetensors").write_bytes(b"leftover")

    class Stub:
        def save_pretrained(self, path: str) -> None:
            assert not any((folder / name).exists() for name in stale)  # swept before the save
            Path(path).mkdir()
            (Path(path) / "model.safetensors").write_bytes(b"new weights")
            (Path(path) / "config.json").write_text('{"new": true}')

    monkeypatch.setattr(offline, "build_untrained_like", lambda model, seed, init: Stub())
    real_replace = os.replace
    seen: list[tuple[str, str, bytes | None, bytes | None]] = []
    aside = folder / f".untrained_draft.old-{os.getpid()}"

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        # at every rename: what is at the draft's name, and what is moved aside, each whole or absent
        at_name = (out / "model.safetensors").read_bytes() if out.exists() else None
        moved = (aside / "model.safetensors").read_bytes() if aside.exists() else None
        seen.append((Path(src).name, Path(dst).name, at_name, moved))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    assert offline.save_untrained_draft(object(), out) == out
    pid = os.getpid()
    assert seen == [
        ("untrained_draft", aside.name, b"old weights", None),  # the old draft is whole until it is moved aside
        (f".untrained_draft.tmp-{pid}", "untrained_draft", None, b"old weights"),  # the new one goes in
    ]
    assert (out / "model.safetensors").read_bytes() == b"new weights"
    assert sorted(p.name for p in folder.iterdir()) == sorted(["untrained_draft", *kept])

    # the new folder cannot be renamed in: the old one is put back, whole
    tmp = folder / f".untrained_draft.tmp-{pid}"
    tmp.mkdir()

    def failing(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if Path(src) == tmp:
            raise OSError(5, "injected rename failure")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="injected"):
        storage.replace_dir_atomic(tmp, out)
    assert (out / "model.safetensors").read_bytes() == b"new weights" and not aside.exists()
