"""vocab_mapping and draft_model: speculators' vocab function, training that beats the untrained draft, the saved
draft reloading with SpeculatorModel.from_pretrained, and resuming from the last checkpoint after a SIGKILL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eagle3_assets.core.settings import ConfigError
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
from eagle3_assets.training import TrainConfig, build_vocab_mapping, load_vocab_mapping, train_draft
from support.common import reaped, sigkill_when
from support.hidden_states_data import cached_tiny_verifier, fabricate_responses

REPO = Path(__file__).resolve().parents[2]
KEYS = ["00000", "00001", "00002"]
# small packed batches: attention cost is quadratic in the packed length, and many steps teach more on a CPU
FAST = TrainConfig(epochs=3, tokens_per_batch=768, lr=3e-3, warmup_ratio=0.0)


@pytest.fixture(scope="module")
def verifier() -> Path:
    return cached_tiny_verifier()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, verifier: Path) -> DataLayout:
    layout = DataLayout.at(tmp_path_factory.mktemp("train") / "data")
    for key in KEYS:
        fabricate_responses(layout, key, 48, failed_every=12, min_words=20, max_words=40)
        extract_partition(layout, key, verifier, HiddenStatesConfig(layer_ids=[1, 2, 3]))
    build_vocab_mapping(layout, KEYS[:2], draft_vocab_size=256, target_vocab_size=1024)
    return layout


def _copy_layout(src: DataLayout, dst: Path) -> DataLayout:
    """A private copy of the data (hidden states + vocab mapping) so tests do not share draft_model folders."""
    import shutil

    for asset in ("hidden_states", "vocab_mapping"):
        shutil.copytree(src.asset_dir(asset), dst / asset, ignore=shutil.ignore_patterns("_locks"))
    return DataLayout.at(dst)


def test_vocab_mapping_coverage_and_cap(data: DataLayout) -> None:
    import numpy as np
    import torch

    result = build_vocab_mapping(data, KEYS[:2], draft_vocab_size=256, target_vocab_size=1024)
    d2t, t2d = (tensor.numpy() for tensor in load_vocab_mapping(data))  # one file: vocab_mapping.safetensors
    assert d2t.shape == (256,) and t2d.shape == (1024,) and int(t2d.sum()) == 256
    assert np.array_equal(np.nonzero(t2d)[0], np.arange(256) + d2t)  # target id = i + d2t[i]
    freq = torch.load(result.token_freq_path, weights_only=True)
    assert result.loss_tokens == sum(freq.values())
    assert 0.0 < result.coverage <= 1.0 and not result.capped

    capped = build_vocab_mapping(data, KEYS[:2], draft_vocab_size=32000, target_vocab_size=1024)
    assert capped.capped and capped.draft_vocab_size == 1024 and capped.coverage == 1.0
    assert any("capped" in note for note in capped.notes)
    build_vocab_mapping(data, KEYS[:2], draft_vocab_size=256, target_vocab_size=1024)  # restore for the others
    with pytest.raises(ConfigError, match="draft_vocab_size=0"):
        build_vocab_mapping(data, KEYS[:2], draft_vocab_size=0, target_vocab_size=1024)


def test_training_beats_the_untrained_draft_and_reloads(data: DataLayout, verifier: Path, tmp_path: Path) -> None:
    import torch
    from speculators import SpeculatorModel

    layout = _copy_layout(data, tmp_path)
    lines: list[str] = []
    config = TrainConfig(**{**FAST.__dict__, "progress_interval_s": 0.0})  # a progress line after every step
    result = train_draft(layout, KEYS[:2], KEYS[2], verifier, config, log=lines.append)
    assert result.epochs == 3 and result.resumed_from_epoch is None
    progress = [line for line in lines if ": step " in line]
    assert len(progress) == result.steps, lines
    assert progress[0].startswith("draft_model epoch 1/3: step 1/") and "tokens/s" in progress[0]
    assert result.val_loss[-1] < 0.5 * result.val_loss_untrained, (result.val_loss, result.val_loss_untrained)
    assert result.val_loss[-1] < result.val_loss[0]
    assert len(result.val_accuracy) == 3 and all(len(a) == FAST.ttt_steps for a in result.val_accuracy)
    assert len(result.loss_curve) == result.steps > 0
    assert result.draft_vocab_size == 256 and result.layer_ids == [1, 2, 3]

    config = json.loads((result.final_dir / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(verifier.resolve())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    reloaded = SpeculatorModel.from_pretrained(str(result.final_dir))
    assert type(reloaded).__name__ == "Eagle3DraftModel"
    assert reloaded.draft_vocab_size == 256
    assert torch.equal(reloaded.d2t, load_vocab_mapping(layout)[0])
    assert not torch.isnan(reloaded.lm_head.weight).any() and not torch.isnan(reloaded.embed_tokens.weight).any()


@pytest.mark.slow
def test_sigkill_during_training_resumes_from_last_checkpoint(data: DataLayout, verifier: Path, tmp_path: Path) -> None:
    layout = _copy_layout(data, tmp_path)
    config = TrainConfig(epochs=4, tokens_per_batch=768, lr=3e-3, warmup_ratio=0.0)
    script = textwrap.dedent(
        f"""
        from eagle3_assets.core.storage import DataLayout
        from eagle3_assets.training import TrainConfig, train_draft
        train_draft(DataLayout.at({str(layout.root)!r}), {KEYS[:2]!r}, {KEYS[2]!r}, {str(verifier)!r},
                    TrainConfig(epochs=4, tokens_per_batch=768, lr=3e-3, warmup_ratio=0.0))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=tmp_path)
    ckpt_dir = layout.draft_model_dir / "checkpoints"
    with reaped(proc):
        sigkill_when(proc, (ckpt_dir / "epoch_0001.pt").exists, timeout_s=300, interval_s=0.05)
    assert not (layout.draft_model_dir / "final").exists()
    done = sorted(p.name for p in ckpt_dir.glob("epoch_*.pt"))
    last = int(done[-1].split("_")[1].split(".")[0])
    assert last >= 1

    result = train_draft(layout, KEYS[:2], KEYS[2], verifier, config)
    assert result.resumed_from_epoch == last
    assert result.epochs_run == 4 - (last + 1) and result.epochs == 4
    assert len(result.val_loss) == 4 and result.val_loss[-1] < result.val_loss_untrained
    assert (result.final_dir / "config.json").exists()

    # training longer continues from the finished run instead of starting again
    longer = train_draft(layout, KEYS[:2], KEYS[2], verifier, TrainConfig(**{**config.__dict__, "epochs": 5}))
    assert longer.resumed_from_epoch == 3 and longer.epochs_run == 1 and longer.epochs == 5


@pytest.mark.parametrize("init", ["token_copy", "speculators"])
def test_token_copy_init_carries_the_new_token_forward(verifier: Path, init: str) -> None:
    """With init="token_copy" the untrained draft's attention output at each position is (a multiple of) that
    position's own normalized token embedding: the pathway a draft otherwise spends thousands of steps finding.
    speculators' plain init mixes all earlier positions instead."""
    import torch

    from eagle3_assets.training.model import build_draft

    torch.manual_seed(0)
    model = build_draft(verifier, [1, 2, 3], TrainConfig(init=init), None).eval()
    seq = 64
    input_ids = torch.randint(0, 1000, (1, seq))
    captured: list[torch.Tensor] = []
    model.layers[0].self_attn.register_forward_hook(lambda _m, _a, out: captured.append(out[0].detach()))
    with torch.no_grad():
        model(
            hidden_states=torch.randn(1, seq, 3 * model.hidden_size),
            input_ids=input_ids,
            document_ids=torch.zeros(1, seq, dtype=torch.long),
            ttt_steps=1,
        )
    own = model.layers[0].input_layernorm(model.embed_tokens(input_ids))
    similarity = torch.nn.functional.cosine_similarity(captured[0], own, dim=-1)[0, 1:]  # position 0 sees only itself
    if init == "token_copy":
        assert similarity.min() > 0.95, similarity
    else:
        assert similarity.abs().mean() < 0.3, similarity


def test_unknown_init_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="init='xavier'"):
        TrainConfig(init="xavier").validate()


def test_loss_on_all_covers_prompt_positions_and_keeps_old_fingerprints(data: DataLayout) -> None:
    """``loss_on="all"`` puts every real position of a packed batch under the loss (prompts included); the default
    keeps the hidden states' answer-only mask, and its fingerprint is the one earlier releases wrote."""
    import torch

    from eagle3_assets.training.data import make_loader

    partition = data.hidden_states_dir(KEYS[0])
    masks = {}
    for loss_on in ("assistant", "all"):
        loader = make_loader([partition], 768, 64, 3, torch.float32, seed=0, loss_on=loss_on)
        batch = next(iter(loader))
        real = batch["document_ids"] >= 0  # the packed batch is padded past its samples with document id -1
        masks[loss_on] = (batch["loss_mask"].bool(), real)
    answers, real = masks["assistant"]
    every, same_batch = masks["all"]
    assert torch.equal(real, same_batch)  # the same seeded packing: only the mask differs
    assert answers.any() and not (answers & ~real).any()
    assert torch.equal(every, real)  # every real position, the prompts' included
    assert answers.sum() < every.sum()
    assert "loss_on" not in TrainConfig().fingerprint_fields()
    assert TrainConfig(loss_on="all").fingerprint_fields()["loss_on"] == "all"
    with pytest.raises(ConfigError, match="loss_on='prompts'"):
        TrainConfig(loss_on="prompts").validate()


def test_validation_runs_under_the_loss_mask_the_draft_trains_with(
    data: DataLayout, verifier: Path, tmp_path: Path
) -> None:
    """``loss_on="all"`` validates over every position too (issue 32: validation ignored it, so the validation loss
    was over assistant positions while training optimized all of them). The untrained draft is the same seeded model
    under both settings: its validation loss differs only when the validation mask does."""
    untrained = {}
    for loss_on in ("assistant", "all"):
        layout = _copy_layout(data, tmp_path / loss_on)
        config = TrainConfig(**{**FAST.__dict__, "epochs": 1, "max_steps_per_epoch": 1, "loss_on": loss_on})
        untrained[loss_on] = train_draft(layout, KEYS[:2], KEYS[2], verifier, config, log=lambda _s: None)
    assistant, every = (untrained[k].val_loss_untrained for k in ("assistant", "all"))
    assert assistant != pytest.approx(every, rel=1e-3), (assistant, every)


def test_speculators_muon_optimizer_trains_resumes_and_keeps_old_fingerprints(
    data: DataLayout, verifier: Path, tmp_path: Path
) -> None:
    """``optimizer="muon"`` (speculators' current default): Muon on the draft's 2-D weights beside AdamW on the rest,
    both checkpointed and resumed; AdamW, the default, leaves the fingerprints of earlier releases as they were."""
    import torch

    from eagle3_assets.training.checkpoints import CHECKPOINT_DIR

    layout = _copy_layout(data, tmp_path)
    muon = TrainConfig(**{**FAST.__dict__, "epochs": 1, "max_steps_per_epoch": 4, "optimizer": "muon"})
    first = train_draft(layout, KEYS[:2], KEYS[2], verifier, muon)
    assert first.val_loss[-1] < first.val_loss_untrained, (first.val_loss, first.val_loss_untrained)
    (checkpoint,) = sorted((layout.draft_model_dir / CHECKPOINT_DIR).glob("epoch_*.pt"))
    state = torch.load(checkpoint, weights_only=False)
    muon_group, adamw_group = (o["param_groups"][0] for o in state["optimizers"])  # both stepped and saved
    assert "ns_steps" in muon_group and "betas" in adamw_group, (muon_group, adamw_group)
    longer = train_draft(layout, KEYS[:2], KEYS[2], verifier, TrainConfig(**{**muon.__dict__, "epochs": 2}))
    assert longer.resumed_from_epoch == 0 and longer.epochs == 2

    assert "optimizer" not in TrainConfig().fingerprint_fields() and "muon_lr" not in TrainConfig().fingerprint_fields()
    assert muon.fingerprint_fields()["optimizer"] == "muon"
    with pytest.raises(ConfigError, match="optimizer='sgd'"):
        TrainConfig(optimizer="sgd").validate()
