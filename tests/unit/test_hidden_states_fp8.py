"""FP8 storage of hidden states (``dtype="float8_e4m3fn"``): the file layout hs_connectors reads, values within FP8's
rounding of the bf16 partition's, half its bytes, validation on resume, and training and offline evaluation reading
it back (training through speculators' own ArrowDataset with hs_connectors' FP8Transfer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.hidden_states import HiddenStatesConfig, check_finite, extract_partition
from eagle3_assets.hidden_states.extract import hs_file
from eagle3_assets.hidden_states.storage_format import (
    FP8,
    SCALES_KEY,
    bytes_per_token,
    decode,
    encode,
    load_states,
)
from support.hidden_states_data import cached_tiny_verifier, fabricate_responses

LAYERS = [1, 2, 3]
KEY = "00000"


@pytest.fixture(scope="module")
def partitions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DataLayout]:
    """The same responses extracted twice: bf16 and FP8 storage."""
    verifier = cached_tiny_verifier()
    out = {}
    for dtype in ("bfloat16", FP8):
        layout = DataLayout.at(tmp_path_factory.mktemp(dtype) / "data")
        fabricate_responses(layout, KEY, 12, min_words=20, max_words=40)
        fabricate_responses(layout, "00001", 12, min_words=20, max_words=40)
        for key in (KEY, "00001"):
            extract_partition(layout, key, verifier, HiddenStatesConfig(layer_ids=LAYERS, dtype=dtype))
        out[dtype] = layout
    return out


def test_encode_uses_one_scale_per_token_and_layer_and_round_trips() -> None:
    import torch

    torch.manual_seed(0)
    states = torch.randn(7, 4, 64) * torch.tensor([1.0, 3.0, 10.0, 100.0])[None, :, None]
    stored = encode(states, FP8)
    assert stored["hidden_states"].dtype == torch.float8_e4m3fn and stored[SCALES_KEY].shape == (7, 4, 1)
    restored = decode(stored)
    # e4m3 keeps 3 mantissa bits: every value within 1/16 of its row's largest magnitude, each layer on its own scale
    row_max = states.abs().amax(dim=-1, keepdim=True)
    assert bool(((restored - states).abs() <= row_max / 16).all())
    assert bytes_per_token(FP8, 4, 64) == 4 * 64 + 4 * 4 and bytes_per_token("bfloat16", 4, 64) == 2 * 4 * 64


def test_fp8_partition_holds_the_bf16_states_within_fp8_rounding_at_about_half_the_bytes(
    partitions: dict[str, DataLayout],
) -> None:
    from safetensors import safe_open

    bf16, fp8 = partitions["bfloat16"], partitions[FP8]
    bf16_dir, fp8_dir = bf16.hidden_states_dir(KEY), fp8.hidden_states_dir(KEY)
    with safe_open(str(hs_file(fp8_dir, 0)), framework="pt") as handle:
        assert set(handle.keys()) == {"hidden_states", SCALES_KEY, "token_ids"}
        assert handle.get_slice("hidden_states").get_dtype() == "F8_E4M3"
    for row in range(12):
        ref, got = load_states(hs_file(bf16_dir, row)).float(), load_states(hs_file(fp8_dir, row))
        row_max = ref.abs().amax(dim=-1, keepdim=True)
        assert bool(((got - ref).abs() <= row_max / 12).all()), row  # fp8 rounding on top of bf16's
    size = {name: sum(p.stat().st_size for p in (d / "hidden_states").glob("hs_*")) for name, d in
            (("bf16", bf16_dir), ("fp8", fp8_dir))}  # fmt: skip
    assert size["fp8"] < 0.6 * size["bf16"], size
    assert check_finite(fp8, KEY).passed


def test_resume_keeps_whole_fp8_files_and_redoes_one_whose_scales_are_wrong(partitions: dict[str, DataLayout]) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    layout = partitions[FP8]
    verifier = cached_tiny_verifier()
    path = hs_file(layout.hidden_states_dir(KEY), 3)
    tensors = load_file(str(path))
    tensors[SCALES_KEY] = tensors[SCALES_KEY][:, :1]  # one scale per token: not this project's layout
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    result = extract_partition(layout, KEY, verifier, HiddenStatesConfig(layer_ids=LAYERS, dtype=FP8))
    assert result.skipped_existing == 11
    assert load_file(str(hs_file(layout.hidden_states_dir(KEY), 3)))[SCALES_KEY].shape[1] == len(LAYERS) + 1
    assert torch.isfinite(load_states(hs_file(layout.hidden_states_dir(KEY), 3))).all()


def test_training_loader_dequantizes_fp8_to_the_bf16_partitions_states(partitions: dict[str, DataLayout]) -> None:
    """speculators' ArrowDataset reads an FP8 partition through FP8Transfer: the batch equals the bf16 one's within
    FP8 rounding (read raw, the values would be off by each row's scale)."""
    import torch

    from eagle3_assets.training.data import make_loader

    batches = {}
    for dtype, layout in partitions.items():
        loader = make_loader([layout.hidden_states_dir(KEY)], 512, 64, len(LAYERS), torch.float32, seed=0)
        batches[dtype] = next(iter(loader))
    ref, got = batches["bfloat16"], batches[FP8]
    assert torch.equal(ref["input_ids"], got["input_ids"])
    for name in ("hidden_states", "verifier_last_hidden_states"):
        scale = ref[name].abs().amax()
        assert float((ref[name] - got[name]).abs().max()) <= float(scale) / 12, name


def test_training_and_offline_evaluation_read_fp8_partitions(partitions: dict[str, DataLayout], tmp_path: Path) -> None:
    import shutil

    from eagle3_assets.evaluation.offline import iter_samples
    from eagle3_assets.training import TrainConfig, build_vocab_mapping, train_draft

    layout = DataLayout.at(tmp_path / "data")
    shutil.copytree(partitions[FP8].asset_dir("hidden_states"), layout.asset_dir("hidden_states"))
    build_vocab_mapping(layout, [KEY], draft_vocab_size=256, target_vocab_size=1024)
    config = TrainConfig(epochs=1, tokens_per_batch=512, lr=3e-3, warmup_ratio=0.0, max_val_batches=2)
    result = train_draft(layout, [KEY], "00001", cached_tiny_verifier(), config)
    assert result.steps > 0 and all(v == v for v in result.val_loss)  # trained, no NaN
    _sample, input_ids, _mask, states = next(iter_samples(layout, KEY, max_samples=1))
    assert states.shape == (len(input_ids), len(LAYERS) + 1, states.shape[-1]) and states.dtype.is_floating_point


def test_the_vllm_backend_writes_fp8_partitions_from_what_the_connector_wrote(tmp_path: Path) -> None:
    """FP8 through the ``vllm`` backend: the client converts the connector's float32 file (here a real HTTP server
    writing the states every vLLM connector file holds: value = token id) into the FP8 layout with its row scales,
    the partition passes the finite check, and it reads back as those states within FP8 rounding."""
    import torch
    from safetensors import safe_open

    from eagle3_assets.hidden_states.vllm_backend import VLLMBackendOptions
    from support.fake_extraction import ExtractionFake, serve_extraction

    layout = DataLayout.at(tmp_path / "data")
    fabricate_responses(layout, KEY, 4, min_words=10, max_words=20)
    storage = tmp_path / "storage"
    storage.mkdir()
    with serve_extraction(ExtractionFake(storage)) as url:
        options = VLLMBackendOptions(urls=(url,), model="m", storage_path=str(storage), concurrency=2)
        config = HiddenStatesConfig(layer_ids=LAYERS, dtype=FP8, backend="vllm", vllm=options)
        result = extract_partition(layout, KEY, cached_tiny_verifier(), config, log=lambda _m: None)
    assert result.samples == 4 and result.dtype == FP8 and check_finite(layout, KEY).passed
    assert list(storage.iterdir()) == []  # every connector file read and deleted
    for path in sorted((layout.hidden_states_dir(KEY) / "hidden_states").glob("hs_*.safetensors")):
        with safe_open(str(path), "pt") as f:
            ids = f.get_tensor("token_ids")
            assert f.get_tensor("hidden_states").dtype == torch.float8_e4m3fn
            assert f.get_tensor(SCALES_KEY).shape == (len(ids), len(LAYERS) + 1, 1)  # one scale per token and layer
        states = load_states(path)
        expected = ids.float()[:, None, None].expand(len(ids), len(LAYERS) + 1, 64)
        torch.testing.assert_close(states.float(), expected, rtol=1 / 16, atol=1e-3)
