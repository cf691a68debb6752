"""Issue 22 (items 2, 3, 7): the hidden-states extraction client against servers that lie, go down or die.

Real HTTP servers (tests/support/fake_extraction.py: in a thread, or a subprocess a test kills) answer the
``vllm`` backend; each test injects one fault:

- the client reads and deletes only regular files under its storage root: a reply naming a file elsewhere, a
  symbolic link out of the root, or model weights lying in the folder never loses (or reads) that file; without a
  storage mount a remote extraction is refused, naming ``EAGLE3_HIDDEN_STATES_STORAGE``;
- the stale-file sweep touches only this project's connector files (``eagle3-hs-*``), never model weights;
- a garbage file fails the sample naming the server and the sample (no bare SafetensorError);
- 401 stops at once naming ``EAGLE3_API_KEY``; every server down past the outage budget ends the run with an error
  naming ``EAGLE3_HIDDEN_STATES_OUTAGE_BUDGET_S``; a dead embedded server is reported within seconds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from eagle3_assets.core.settings import ConfigError
from eagle3_assets.hidden_states.vllm_backend import ExtractionError, VLLMBackend, VLLMBackendOptions
from support.fake_extraction import ExtractionFake, ExtractionServerProcess, serve_extraction
from support.hidden_states_data import cached_tiny_verifier

pytestmark = pytest.mark.timeout(120, method="thread")
BATCH = [[i, i + 1, i + 2] for i in range(1, 9)]


def _safetensors(path: Path, ids: list[int] | None = None) -> Path:
    import torch
    from safetensors.torch import save_file

    tensors = {"model.embed_tokens.weight": torch.ones(4, 4)}
    if ids is not None:  # a planted file that looks exactly like the right answer
        tensors = {"hidden_states": torch.ones(len(ids), 4, 64), "token_ids": torch.tensor(ids)}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def _backend(url: str, storage: Path | None, **options: Any) -> VLLMBackend:
    values: dict[str, Any] = dict(urls=(url,), model="m", concurrency=4, bench_s=0.2, max_attempts=3)
    values.update(options)
    opts = VLLMBackendOptions(storage_path=str(storage) if storage else None, **values)
    return VLLMBackend(cached_tiny_verifier(), [1, 2, 3], "float32", options=opts, log=lambda _m: None)


def _extract(url: str, storage: Path | None, batch: list[list[int]] = BATCH, **options: Any) -> Any:
    backend = _backend(url, storage, **options)
    try:
        return backend.extract(batch)
    finally:
        backend.close()


# ------------------------------------------------------------------------------- files the reply names


def test_remote_extraction_without_a_storage_mount_is_refused_and_touches_no_file(tmp_path: Path) -> None:
    victim = _safetensors(tmp_path / "elsewhere" / "precious.safetensors", ids=[1, 2, 3])
    fake = ExtractionFake(tmp_path / "storage", mode="escape", target=str(victim))
    with serve_extraction(fake) as url, pytest.raises(ConfigError, match="EAGLE3_HIDDEN_STATES_STORAGE"):
        _extract(url, None, batch=[[1, 2, 3]])
    assert victim.is_file() and fake.requests == 0  # before: read, accepted and deleted


def test_a_symlink_out_of_the_storage_root_is_never_followed(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    storage.mkdir()
    victim = _safetensors(tmp_path / "elsewhere" / "planted.safetensors", ids=[1, 2, 3])
    fake = ExtractionFake(storage, mode="symlink", target=str(victim))
    with serve_extraction(fake) as url, pytest.raises(ExtractionError, match="symbolic link") as caught:
        _extract(url, storage, batch=[[1, 2, 3]])
    assert url.removesuffix("/v1").split("//")[1] in str(caught.value)  # the server is named
    assert victim.is_file() and fake.requests == 1  # a malformed answer fails the sample at once: not retried


def test_model_weights_in_the_storage_folder_are_neither_deleted_nor_swept(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    weights = _safetensors(storage / "model-00001-of-00002.safetensors")
    stale_ours = storage / "eagle3-hs-old.safetensors"
    stale_ours.write_bytes(b"x")
    long_ago = time.time() - 7200
    for path in (weights, stale_ours):
        os.utime(path, (long_ago, long_ago))
    fake = ExtractionFake(storage, mode="weights", target=str(weights))
    with serve_extraction(fake) as url, pytest.raises(ExtractionError, match="expected hidden_states and token_ids"):
        _extract(url, storage, batch=[[1, 2, 3]], timeout_s=60.0)  # the sweep at start: files older than 120 s
    assert weights.is_file()  # before: swept at start (and deleted after reading)
    assert not stale_ours.exists()  # this project's stale connector file is swept


def test_a_garbage_file_fails_the_sample_naming_server_and_sample(tmp_path: Path) -> None:
    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
    from support.hidden_states_data import fabricate_responses

    layout = DataLayout.at(tmp_path / "data")
    fabricate_responses(layout, "00000", 3)
    storage = tmp_path / "storage"
    storage.mkdir()
    with serve_extraction(ExtractionFake(storage, mode="garbage")) as url:
        options = VLLMBackendOptions(urls=(url,), model="m", storage_path=str(storage), concurrency=1)
        config = HiddenStatesConfig(layer_ids=[1, 2, 3], dtype="float32", backend="vllm", vllm=options)
        with pytest.raises(ExtractionError) as caught:
            extract_partition(layout, "00000", cached_tiny_verifier(), config, log=lambda _m: None)
    text = str(caught.value)
    assert "sample 00000-0000" in text and url.removesuffix("/v1").split("//")[1] in text, text
    assert "not a readable safetensors file" in text, text


# ------------------------------------------------------------------------------- servers down, refusing, dead


def test_a_refused_key_stops_at_once_naming_the_setting(tmp_path: Path) -> None:
    fake = ExtractionFake(tmp_path, mode="status", status=401)
    with serve_extraction(fake) as url, pytest.raises(ExtractionError, match="EAGLE3_API_KEY"):
        _extract(url, tmp_path, max_attempts=4)
    assert fake.requests <= 4  # the requests already in flight, not 4 attempts per sample behind benches


def test_every_server_down_ends_the_run_after_the_outage_budget(tmp_path: Path) -> None:
    fake = ExtractionFake(tmp_path, mode="status", status=503)
    started = time.monotonic()
    with serve_extraction(fake) as url, pytest.raises(ExtractionError) as caught:
        _extract(url, tmp_path, max_attempts=1000, outage_budget_s=1.5)
    assert "EAGLE3_HIDDEN_STATES_OUTAGE_BUDGET_S" in str(caught.value) and "503" in str(caught.value)
    assert time.monotonic() - started < 15


def test_a_dead_embedded_server_is_reported_within_seconds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from eagle3_assets.local import extraction_server

    servers: list[ExtractionServerProcess] = []

    def start(verifier: Path, layer_ids: list[int], storage: Path, **_kwargs: Any) -> ExtractionServerProcess:
        servers.append(ExtractionServerProcess(storage, tmp_path / "server.log"))
        return servers[0]

    monkeypatch.setattr(extraction_server, "start_extraction_server", start)
    opts = VLLMBackendOptions(model="m", concurrency=4)  # the defaults: bench 10 s, outage budget 900 s
    backend = VLLMBackend(cached_tiny_verifier(), [1, 2, 3], "float32", options=opts, log=lambda _m: None)
    try:
        assert len(backend.extract(BATCH)) == len(BATCH)  # alive: it answers
        servers[0].process.kill()  # the embedded server crashes (OOM killer, a segfault in the engine...)
        started = time.monotonic()
        with pytest.raises(ExtractionError, match=r"embedded extraction server \(pid \d+\) exited with code -9"):
            backend.extract(BATCH)
        assert time.monotonic() - started < 10  # before: refused connections retried behind 10-40 s benches
    finally:
        backend.close()
