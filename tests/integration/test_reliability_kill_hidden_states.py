"""Issue 8, kill anywhere (hidden_states): SIGKILL an extraction at random points (seeded: before the first sample
file, late among the sample files, during the final writes of the dataset, token frequencies, metadata and index);
after re-materialization the partition equals an uninterrupted run's (same index, same token ids, the same states
within bf16 rounding, the same training dataset, token frequencies and metadata) and files stored whole before the
kill were not recomputed.
tests/unit/test_hidden_states.py::test_sigkill_during_extraction_recomputes_nothing_stored_whole proves one
kill point."""

from __future__ import annotations

import json
import random
import shutil
import textwrap
from pathlib import Path

import polars as pl
import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.hidden_states.versions import hidden_states_staging_dir
from support.reliability import block_before_rename, sigkill_child_when

KEY = "00000"
N = 24
LAYERS = [1, 2, 3]
# (seed, where the kill lands); each costs ~10 s here (torch + verifier start-up in the child). The seed draws the
# number of sample files stored before the kill (seed 2: 0, seed 17: 21 of 24) or the delay into the final writes.
KILLS = [(2, "samples"), (17, "samples"), (5, "final-writes")]

CHILD = block_before_rename(3) + textwrap.dedent(
    f"""
    import os, sys, time
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
    from eagle3_assets.hidden_states.vllm_backend import VLLMBackendOptions
    from eagle3_assets.core.storage import DataLayout
    url = os.environ.get("EAGLE3_TEST_HS_URL", "")
    storage = os.environ.get("EAGLE3_TEST_HS_STORAGE") or None
    backend = {{"backend": "vllm", "vllm": VLLMBackendOptions(urls=(url,), storage_path=storage)}} if url else {{}}
    print("START", flush=True)
    extract_partition(DataLayout.at(sys.argv[1]), "{KEY}", sys.argv[2],
                      HiddenStatesConfig(layer_ids={LAYERS!r}, batch_tokens=600, **backend))
    print("DONE", flush=True)
    time.sleep(3600)  # a kill "just after the end" still lands on a live process (the helper asserts SIGKILL)
    """
)


@pytest.fixture(params=["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict:
    """The same kill scenarios with each hidden-states backend (vllm: a real CPU extraction server); the child
    reads the server from EAGLE3_TEST_HS_URL and its connector folder from EAGLE3_TEST_HS_STORAGE. Returns the
    HiddenStatesConfig fields of that backend."""
    if request.param == "hf":
        monkeypatch.delenv("EAGLE3_TEST_HS_URL", raising=False)
        monkeypatch.delenv("EAGLE3_TEST_HS_STORAGE", raising=False)
        return {}
    from eagle3_assets.hidden_states.vllm_backend import VLLMBackendOptions

    url, storage = request.getfixturevalue("hidden_states_server")
    monkeypatch.setenv("EAGLE3_TEST_HS_URL", url)
    monkeypatch.setenv("EAGLE3_TEST_HS_STORAGE", str(storage))
    return {"backend": "vllm", "vllm": VLLMBackendOptions(urls=(url,), storage_path=str(storage))}


def _count(folder: Path) -> int:
    try:
        return sum(1 for p in folder.iterdir() if p.name.startswith("hs_"))
    except FileNotFoundError:
        return 0


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(verifier, responses-only data dir to copy, reference data dir after an uninterrupted extraction)"""
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
    from support.hidden_states_data import cached_tiny_verifier, fabricate_responses

    verifier = cached_tiny_verifier()
    base = tmp_path_factory.mktemp("hs_base") / "data"
    fabricate_responses(DataLayout.at(base), KEY, N, min_words=60, max_words=120)
    reference = tmp_path_factory.mktemp("hs_reference") / "data"
    shutil.copytree(base, reference)
    extract_partition(DataLayout.at(reference), KEY, verifier, HiddenStatesConfig(layer_ids=LAYERS, batch_tokens=600))
    return verifier, base, reference


def _visible(folder: Path) -> list[str]:
    """The partition folder's entries (not the temporary ones, which start with a dot)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def _assert_equal_partitions(layout: DataLayout, reference: DataLayout, where: str) -> None:
    """Index, per-sample files, training dataset, token frequencies and metadata equal the reference's."""
    import torch
    from datasets import load_from_disk
    from safetensors.torch import load_file

    from eagle3_assets.hidden_states.extract import META_FILE, TOKEN_FREQ_FILE

    expected = pl.read_parquet(reference.hidden_states_index_path(KEY)).drop("bytes")
    got = pl.read_parquet(layout.hidden_states_index_path(KEY)).drop("bytes")
    assert got.equals(expected), where
    ours_dir, ref_dir = layout.hidden_states_dir(KEY), reference.hidden_states_dir(KEY)
    assert _visible(ours_dir) == _visible(ref_dir), where  # no stale arrow file of an earlier dataset write
    assert _visible(ours_dir / "hidden_states") == _visible(ref_dir / "hidden_states"), where
    for name in _visible(ref_dir / "hidden_states"):
        ours, theirs = load_file(ours_dir / "hidden_states" / name), load_file(ref_dir / "hidden_states" / name)
        assert torch.equal(ours["token_ids"], theirs["token_ids"]), f"{where}: {name}"
        torch.testing.assert_close(
            ours["hidden_states"].float(), theirs["hidden_states"].float(), rtol=2e-2, atol=2e-2, msg=name
        )
    ours_rows = load_from_disk(str(ours_dir)).with_format(None).to_dict()
    assert ours_rows == load_from_disk(str(ref_dir)).with_format(None).to_dict(), where
    assert torch.load(ours_dir / TOKEN_FREQ_FILE) == torch.load(ref_dir / TOKEN_FREQ_FILE), where
    assert json.loads((ours_dir / META_FILE).read_text()) == json.loads((ref_dir / META_FILE).read_text()), where


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "mode"), KILLS)
def test_sigkill_hidden_states_at_a_random_point_then_resume_equals_an_uninterrupted_run(
    seed: int, mode: str, prepared: tuple[Path, Path, Path], tmp_path: Path, backend: dict
) -> None:
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition

    verifier, base, reference = prepared
    root = tmp_path / "data"
    shutil.copytree(base, root)
    layout = DataLayout.at(root)
    data_dir = hidden_states_staging_dir(layout, KEY)  # a partition is built here and published whole
    hs_dir = data_dir / "hidden_states"
    rng = random.Random(seed)
    if mode == "samples":  # among the sample files (4 writer threads: several are in flight at once)
        threshold = rng.choice([rng.randint(0, N // 3), rng.randint(N // 3, N)])
        delay = rng.uniform(0, 0.05)

        def reached() -> bool:
            return _count(hs_dir) >= threshold
    else:  # the dataset's temporary folder exists: somewhere in the dataset, token_freq, metadata or index write
        threshold = N
        delay = rng.uniform(0, 0.1)

        def reached() -> bool:
            return any(data_dir.glob("._dataset.tmp-*")) or (data_dir / "state.json").exists()

    script = tmp_path / "child.py"
    script.write_text(CHILD)
    sigkill_child_when(script, [str(root), str(verifier)], reached, 120, delay)
    where = f"seed {seed} ({mode}), threshold {threshold}, delay {delay:.3f} s"

    kept = {p.name: p.stat().st_mtime_ns for p in hs_dir.iterdir()} if hs_dir.is_dir() else {}
    result = extract_partition(layout, KEY, verifier, HiddenStatesConfig(layer_ids=LAYERS, batch_tokens=600, **backend))
    whole = {name for name in kept if name.startswith("hs_")}
    hs_dir = layout.hidden_states_dir(KEY) / "hidden_states"  # published: hard links of the staged files
    assert result.skipped_existing >= len(whole) - 1, where  # at most the file being written at the kill was redone
    after = {name: (hs_dir / name).stat().st_mtime_ns for name in whole if (hs_dir / name).exists()}
    assert sum(1 for name in whole if after.get(name) == kept[name]) >= len(whole) - 1, where
    assert not any(p.name.startswith(".") for p in hs_dir.iterdir()), where  # no temporary sample file left
    _assert_equal_partitions(layout, DataLayout.at(reference), where)


@pytest.mark.slow
def test_temporary_files_of_a_killed_extraction_are_removed_by_the_next_run(
    prepared: tuple[Path, Path, Path], tmp_path: Path, backend: dict
) -> None:
    """The child stops for good just before renaming token_freq.pt's temporary file into place and is SIGKILLed;
    the next run equals an uninterrupted run's and leaves no temporary entry anywhere under hidden_states/."""
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition

    verifier, base, reference = prepared
    root = tmp_path / "data"
    shutil.copytree(base, root)
    layout = DataLayout.at(root)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    marker = tmp_path / "blocked"
    sigkill_child_when(script, [str(root), str(verifier), ".token_freq.pt.tmp-", str(marker)], marker.exists, 120)
    folder = layout.asset_dir("hidden_states")
    stale = sorted(str(p.relative_to(folder)) for p in folder.rglob(".*"))
    assert [name.split("-")[0] for name in stale] == [f"_versions/{KEY}/_staging/.token_freq.pt.tmp"], stale  # kill's

    extract_partition(layout, KEY, verifier, HiddenStatesConfig(layer_ids=LAYERS, batch_tokens=600, **backend))
    _assert_equal_partitions(layout, DataLayout.at(reference), "after a kill during the token_freq write")
    left = sorted(str(p.relative_to(folder)) for p in folder.rglob(".*"))
    assert left == [], f"temporary files of a killed extraction left under {folder}: {left}"
