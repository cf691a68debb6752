"""Issue 22: the vocabulary mapping is one checked artifact, lineage records what was read, and status / backfill
--missing report hidden states built from other responses or settings than the current ones.

* A kill between writing ``d2t`` and ``t2d`` (a real child SIGKILLed at the last rename of the mapping) left a pair
  from two builds that training loaded silently; now the mapping is one file written atomically and every load
  checks that d2t and t2d agree (VocabMappingError names the file and the remedy).
* ``hidden_states`` recorded the digest of the responses file at publish time: a regeneration of the partition
  while it was being extracted made the old states look current. Now it records the digest of the bytes it read.
* ``eagle3 status`` and ``backfill --missing`` did not see hidden states built from other responses or another
  verifier / other layer ids.
"""

from __future__ import annotations

import hashlib
import shutil
import textwrap
from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets.core import hashing
from eagle3_assets.core.lineage import PartitionLineage
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
from eagle3_assets.hidden_states import extract as extract_module
from support.hidden_states_data import cached_tiny_verifier, fabricate_responses
from support.reliability import sigkill_child_when

KEY = "00000"
LAYERS = [1, 2, 3]


def _extract(layout: DataLayout, key: str = KEY, layers: list[int] = LAYERS) -> None:
    extract_partition(layout, key, cached_tiny_verifier(), HiddenStatesConfig(layer_ids=layers, max_seq_len=128))


@pytest.fixture(scope="module")
def extracted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vocab") / "data"
    layout = DataLayout.at(root)
    fabricate_responses(layout, KEY, 12, min_words=10, max_words=30)
    _extract(layout)
    return root


def _copy(root: Path, tmp_path: Path) -> DataLayout:
    target = tmp_path / "data"
    shutil.copytree(root, target, symlinks=True)
    return DataLayout.at(target)


# ---------------------------------------------------------------------------------------- vocabulary mapping

VOCAB_CHILD = textwrap.dedent(
    """
    import os, sys, time
    root, size, marker = sys.argv[1:4]
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):  # stop for good at the mapping's last rename (t2d, or the one file)
        if os.path.basename(str(src)).startswith((".t2d.npy.tmp-", ".vocab_mapping.safetensors.tmp-")):
            open(marker, "w").close()
            time.sleep(3600)
        return real_replace(src, dst, *args, **kwargs)

    os.replace = replace
    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.training import build_vocab_mapping
    print("START", flush=True)
    build_vocab_mapping(DataLayout.at(root), ["00000"], int(size), target_vocab_size=1024)
    time.sleep(3600)
    """
)


def _assert_agree(d2t, t2d) -> None:  # type: ignore[no-untyped-def]
    import torch

    assert int(t2d.sum()) == int(d2t.shape[0]), f"t2d marks {int(t2d.sum())} tokens, d2t has {int(d2t.shape[0])}"
    assert torch.equal(torch.nonzero(t2d).flatten(), torch.arange(int(d2t.shape[0])) + d2t)


@pytest.mark.slow
def test_a_kill_while_the_mapping_is_written_leaves_the_old_mapping_whole(extracted: Path, tmp_path: Path) -> None:
    from eagle3_assets.training import build_vocab_mapping, load_vocab_mapping

    layout = _copy(extracted, tmp_path)
    build_vocab_mapping(layout, [KEY], 64, target_vocab_size=1024)
    before = load_vocab_mapping(layout)
    assert before is not None and int(before[0].shape[0]) == 64
    script, marker = tmp_path / "child.py", tmp_path / "blocked"
    script.write_text(VOCAB_CHILD)
    sigkill_child_when(script, [str(layout.root), "128", str(marker)], marker.exists, 180)
    mapping = load_vocab_mapping(layout)
    assert mapping is not None
    _assert_agree(*mapping)  # one build's pair: the old one (the new one was never renamed into place)
    assert int(mapping[0].shape[0]) == 64


def test_a_mapping_whose_d2t_and_t2d_disagree_is_refused_naming_the_file_and_the_remedy(
    extracted: Path, tmp_path: Path
) -> None:
    import torch

    from eagle3_assets.training import build_vocab_mapping, load_vocab_mapping
    from eagle3_assets.training.vocab import MAPPING_FILE, VocabMappingError, save_vocab_mapping

    layout = _copy(extracted, tmp_path)
    build_vocab_mapping(layout, [KEY], 64, target_vocab_size=1024)
    d2t, t2d = load_vocab_mapping(layout)  # type: ignore[misc]
    path = layout.vocab_mapping_dir / MAPPING_FILE
    wrong = t2d.clone()
    first, free = int(torch.nonzero(t2d)[0]), int(torch.nonzero(~t2d)[0])
    wrong[first], wrong[free] = False, True  # one draft token mapped to another target token
    save_vocab_mapping(d2t, wrong, path)
    with pytest.raises(VocabMappingError, match=r"vocab_mapping\.safetensors.*disagree.*re-materialize vocab_mapping"):
        load_vocab_mapping(layout)
    save_vocab_mapping(d2t[:-1], t2d, path)  # shapes from two builds
    with pytest.raises(VocabMappingError, match=r"63 draft tokens but t2d marks 64 .* re-materialize vocab_mapping"):
        load_vocab_mapping(layout)
    path.write_bytes(b"not safetensors")
    with pytest.raises(VocabMappingError, match=rf"{path}.* unreadable .* re-materialize vocab_mapping"):
        load_vocab_mapping(layout)
    path.unlink()
    (layout.vocab_mapping_dir / "d2t.npy").write_bytes(b"an earlier version's file")
    with pytest.raises(VocabMappingError, match=r"d2t\.npy.* two-file layout .* re-materialize vocab_mapping"):
        load_vocab_mapping(layout)


# ------------------------------------------------------------------------------------------ honest lineage


def test_lineage_records_the_responses_that_were_read_not_those_on_disk_at_publish(
    extracted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The partition's responses are generated again while its hidden states are being extracted."""
    layout = _copy(extracted, tmp_path)
    fabricate_responses(layout, KEY, 12, seed=5, min_words=10, max_words=30)  # answers A, then extract them
    read = layout.responses_path(KEY).read_bytes()
    real_render = extract_module.render_rows

    def render_while_regenerated(*args, **kwargs):  # type: ignore[no-untyped-def]
        fabricate_responses(layout, KEY, 12, seed=6, min_words=10, max_words=30)  # answers B land meanwhile
        return real_render(*args, **kwargs)

    monkeypatch.setattr(extract_module, "render_rows", render_while_regenerated)
    _extract(layout)
    lineage = PartitionLineage.load(layout, "hidden_states", KEY)
    assert lineage is not None
    assert lineage.inputs["responses_data_version"] == hashlib.sha256(read).hexdigest()[:32]
    assert lineage.inputs["responses_data_version"] != hashing.file_digest(layout.responses_path(KEY))
    from eagle3_assets.hidden_states.versions import stale_hidden_states

    assert "other responses" in stale_hidden_states(layout, [KEY])[KEY]


# -------------------------------------------------------------------------------- status and backfill --missing


def _registered(instance: dg.DagsterInstance, keys: list[str]) -> None:
    instance.add_dynamic_partitions("prompt_partitions", keys)
    for key in keys:
        for asset in ("synthetic_responses", "hidden_states"):
            instance.report_runless_asset_event(dg.AssetMaterialization(asset, partition=key))


def test_status_and_backfill_report_hidden_states_built_from_other_responses(
    extracted: Path, tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    from eagle3_assets.operations import backfill, status

    monkeypatch.delenv("EAGLE3_VERIFIER_PATH", raising=False)
    layout = _copy(extracted, tmp_path)
    fabricate_responses(layout, "00001", 6, seed=1, min_words=10, max_words=30)
    _extract(layout, "00001")
    _registered(instance, [KEY, "00001"])
    assert backfill.plan_missing(instance, layout=layout).targets["hidden_states"] == []

    fabricate_responses(layout, KEY, 12, seed=9, min_words=10, max_words=30)  # regenerated after the extraction
    rows = {(r.asset, r.partition_key): r for r in status.partition_table(instance, layout)}
    assert "built from other responses" in rows[("hidden_states", KEY)].stale
    assert rows[("hidden_states", "00001")].stale == ""
    assert "BUILT FROM OTHER RESPONSES" in status.render(list(rows.values()))
    plan = backfill.plan_missing(instance, layout=layout)
    assert plan.targets == {"synthetic_responses": [], "hidden_states": [KEY]}
    assert "built from other responses" in plan.describe()

    _extract(layout)  # re-materialized: current again
    assert backfill.plan_missing(instance, layout=layout).targets["hidden_states"] == []


def test_status_and_backfill_report_hidden_states_built_with_another_verifier_or_layers(
    extracted: Path, tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The environment's settings now name other layer ids, then other verifier weights, than the states'."""
    from eagle3_assets.operations import backfill, status

    layout = _copy(extracted, tmp_path)
    verifier = tmp_path / "verifier"
    shutil.copytree(cached_tiny_verifier(), verifier)
    monkeypatch.setenv("EAGLE3_VERIFIER_PATH", str(verifier))
    monkeypatch.setenv("EAGLE3_LAYER_IDS", ",".join(map(str, LAYERS)))
    _registered(instance, [KEY])
    assert backfill.plan_missing(instance, layout=layout).targets["hidden_states"] == []

    monkeypatch.setenv("EAGLE3_LAYER_IDS", "0,1,3")
    rows = {(r.asset, r.partition_key): r for r in status.partition_table(instance, layout)}
    assert rows[("hidden_states", KEY)].stale == "built with other settings (layer_ids)"
    assert backfill.plan_missing(instance, layout=layout).targets["hidden_states"] == [KEY]

    monkeypatch.setenv("EAGLE3_LAYER_IDS", ",".join(map(str, LAYERS)))
    shutil.copy2(cached_tiny_verifier(seed=1) / "model.safetensors", verifier / "model.safetensors")
    rows = {(r.asset, r.partition_key): r for r in status.partition_table(instance, layout)}
    assert rows[("hidden_states", KEY)].stale == "built with other settings (verifier)"
    assert backfill.plan_missing(instance, layout=layout).targets["hidden_states"] == [KEY]
