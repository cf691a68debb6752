"""The vocabulary mapping file is the same bytes for the same mapping: a draft's checkpoint fingerprint hashes it.

safetensors writes its metadata from a hash map, in an order that changes from one write to the next: an unchanged
``vocab_mapping`` re-run (a re-run of the whole pipeline) changed the file's digest one time in two, and a finished
draft then trained again from scratch."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3_assets.speculators_adapter import build_vocab_mappings
from eagle3_assets.training.vocab import save_vocab_mapping


def test_the_same_mapping_is_written_as_the_same_bytes_and_reads_back(tmp_path: Path) -> None:
    d2t, t2d = build_vocab_mappings({5: 9, 7: 3, 900: 1}, draft_vocab_size=16, target_vocab_size=1024)
    written = set()
    for i in range(16):  # an unsorted header once in two writes: 16 alike by chance is 1 in 32,768
        save_vocab_mapping(d2t, t2d, tmp_path / f"{i}.safetensors")
        written.add((tmp_path / f"{i}.safetensors").read_bytes())
    assert len(written) == 1
    loaded = load_file(tmp_path / "0.safetensors")
    assert torch.equal(loaded["d2t"], d2t) and torch.equal(loaded["t2d"], t2d)
