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


def test_the_sorted_header_is_one_of_the_layouts_safetensors_writes_and_never_longer() -> None:
    """A checkpoint trained on a mapping written before the sort resumes when its file had the sorted layout; a
    header that would not fit its length (not possible from safetensors' compact form) is left as written."""
    from safetensors.torch import load, save

    from eagle3_assets.training.vocab import _sorted_header

    tensors = {"d2t": torch.arange(4), "t2d": torch.ones(8, dtype=torch.bool)}
    metadata = {"target_vocab_size": "8", "draft_vocab_size": "4", "note": "é—x"}
    layouts = {save(tensors, metadata=metadata) for _ in range(64)}
    assert len(layouts) > 1  # safetensors' own order varies: what the sort is for
    sorted_bytes = {_sorted_header(data) for data in layouts}
    assert len(sorted_bytes) == 1 and sorted_bytes <= layouts
    (one,) = sorted_bytes
    assert load(one).keys() == tensors.keys() and all(torch.equal(load(one)[k], v) for k, v in tensors.items())
    header = b'{"__metadata__":{"b":"1","a":"2"},"x":1e2}'  # re-dumped, 1e2 is 100.0: longer than it was
    too_long = len(header).to_bytes(8, "little") + header
    assert _sorted_header(too_long) == too_long
