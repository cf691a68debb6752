"""Issue 31, clause 9: durable before visible.

A rename that makes a file or a folder visible under the data dir (a published hidden_states version and its
pointer, the vocabulary mapping, a checkpoint, the saved draft) must come after every file in it, and every folder
in it, was fsynced: otherwise a power cut after the rename can leave a visible name over empty or torn files, which a
reader (or a resume) then trusts. A real child process runs extraction (a build and a rebuild that publishes over
it), the vocabulary mapping and a short training run with ``os.fsync`` / ``os.rename`` / ``os.replace`` watched: each
fsync records the inode it synced, and each rename into a visible name checks that everything it exposes was synced.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support.common import child_env
from support.hidden_states_data import cached_tiny_verifier

CHILD = textwrap.dedent(
    """
    import json, os, stat, sys
    root, verifier, out = sys.argv[1:4]
    root = os.path.realpath(root)
    synced, violations, checked = set(), [], []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        number = fd if isinstance(fd, int) else fd.fileno()
        info = os.fstat(number)
        synced.add((info.st_dev, info.st_ino))
        return real_fsync(fd)

    def unsynced(path):
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            return []
        missing = [] if (info.st_dev, info.st_ino) in synced else [path]
        if stat.S_ISDIR(info.st_mode):
            for name in os.listdir(path):
                missing += unsynced(os.path.join(path, name))
        return missing

    def visible(dst):
        # a name readers see: under the data dir, not a writer's temporary (.NAME.tmp-PID / .old-PID), not inside
        # a build in progress (_staging) or a lock folder
        dst = os.path.abspath(str(dst))
        parts = os.path.relpath(dst, root).split(os.sep)
        return not parts[0] == ".." and not any(p.startswith(".") or p in ("_staging", "_locks") for p in parts)

    def watched(real):
        def call(src, dst, *args, **kwargs):
            if visible(dst):
                exposed = os.path.realpath(src) if os.path.islink(src) else str(src)
                missing = unsynced(exposed)
                checked.append(os.path.relpath(os.path.abspath(str(dst)), root))
                if missing:
                    violations.append({"rename_to": checked[-1], "unsynced": sorted(missing)[:5], "n": len(missing)})
            return real(src, dst, *args, **kwargs)
        return call

    os.fsync, os.rename, os.replace = fsync, watched(real_rename), watched(real_replace)

    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
    from eagle3_assets.prompts.sample_data import fabricate_responses
    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.training import TrainConfig, build_vocab_mapping, train_draft

    layout = DataLayout.at(root)
    config = HiddenStatesConfig(layer_ids=[1, 2, 3])
    for key, seed in (("00000", 0), ("00001", 0), ("00000", 1)):  # the third call rebuilds and publishes over
        fabricate_responses(layout, key, 6, seed=seed, min_words=10, max_words=20)
        extract_partition(layout, key, verifier, config)
    build_vocab_mapping(layout, ["00000"], draft_vocab_size=256, target_vocab_size=1024)
    train = TrainConfig(epochs=2, tokens_per_batch=256, max_steps_per_epoch=2, max_val_batches=1, num_threads=1)
    train_draft(layout, ["00000"], "00001", verifier, train)
    with open(out, "w") as handle:
        json.dump({"violations": violations, "checked": checked}, handle)
    """
)


@pytest.mark.slow
def test_every_rename_into_a_visible_name_exposes_only_synced_files_and_folders(tmp_path: Path) -> None:
    script, out = tmp_path / "child.py", tmp_path / "renames.json"
    script.write_text(CHILD)
    command = [sys.executable, str(script), str(tmp_path / "data"), str(cached_tiny_verifier()), str(out)]
    result = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    checked = report["checked"]
    # the renames that matter were seen: the version published, the pointer switched, the mapping, the final draft
    for expected in ("hidden_states/_versions/00000/", "hidden_states/00000", "vocab_mapping/", "draft_model/final"):
        assert any(name.startswith(expected) for name in checked), (expected, checked)
    assert report["violations"] == [], json.dumps(report["violations"], indent=1)
