"""Online training against the embedded CPU vLLM in extraction mode (issue 23): a draft trains from partitions that
hold no state files; the connector's files live only while a batch is fetched, so the folder never holds more than
the in-flight requests' files (workers x the client's concurrency) and nothing is left on disk after the run."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
from eagle3_assets.training import TrainConfig, build_vocab_mapping, train_draft
from eagle3_assets.training.online_states import ONLINE_TRANSFER_DIR

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

KEYS = ["00000", "00001"]
LAYERS = [1, 2, 3]
CONCURRENCY = 32  # VLLMBackendOptions' default: requests in flight per worker


def test_online_training_against_the_embedded_extraction_server_stores_nothing(
    vllm_tiny_verifier: Path, tmp_path: Path
) -> None:
    from support.hidden_states_data import fabricate_responses

    layout = DataLayout.at(tmp_path / "data")
    for key in KEYS:  # partitions built for online training: token ids, masks, frequencies and lineage, no states
        fabricate_responses(layout, key, 24, min_words=20, max_words=40)
        online = HiddenStatesConfig(layer_ids=LAYERS, store_budget_bytes=0)
        assert extract_partition(layout, key, vllm_tiny_verifier, online).samples_with_states == 0
    build_vocab_mapping(layout, KEYS[:1], draft_vocab_size=256, target_vocab_size=1024)
    assert not any(layout.root.rglob("hs_*.safetensors"))

    transfer = layout.draft_model_dir / ONLINE_TRANSFER_DIR
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if transfer.is_dir():
                peak[0] = max(peak[0], sum(1 for p in transfer.iterdir() if p.name.endswith(".safetensors")))
            stop.wait(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    config = TrainConfig(
        epochs=2, tokens_per_batch=768, lr=3e-3, warmup_ratio=0.0, max_val_batches=2, hidden_states_source="online",
        online_backend="vllm", online_workers=1, prefetch_batches=2,
    )  # fmt: skip
    try:
        result = train_draft(layout, KEYS[:1], KEYS[1], vllm_tiny_verifier, config)
    finally:
        stop.set()
        watcher.join()
    assert result.val_loss[-1] < result.val_loss_untrained, (result.val_loss, result.val_loss_untrained)
    assert result.hidden_states["fetch_s"] > 0
    assert not any(layout.root.rglob("*.safetensors.lock"))
    left = [p for p in layout.root.rglob("*.safetensors") if p.name.startswith("hs_") or ONLINE_TRANSFER_DIR in p.parts]
    assert left == [], left  # no state tensor file anywhere: not in the partitions, not in the transfer folder
    assert peak[0] <= config.online_workers * CONCURRENCY, peak
    print(f"peak connector files on disk: {peak[0]} (bound {config.online_workers * CONCURRENCY})")
