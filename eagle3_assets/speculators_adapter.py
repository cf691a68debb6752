"""Every use of vllm-project/speculators (0.9) goes through this module.

speculators is the reference for the EAGLE-3 model, its offline data format and its vLLM client; this project
uses its pieces but not its CLI or its accelerator-only ``Trainer``. Keeping all of its import paths here means a
speculators release that moves something breaks one file, and the rest of the package reads as plain calls.

``import speculators`` takes ~20 s (it pulls in torch._inductor, datasets and transformers), so nothing is
imported at module load: each accessor imports what it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any


def eagle3_classes() -> SimpleNamespace:
    """``Eagle3DraftModel`` (the draft, ``from_training_args`` / ``get_trainer_kwargs`` / ``save_pretrained``) and
    ``Eagle3SpeculatorConfig``, and the generic ``SpeculatorModel`` loader (``from_pretrained`` of any draft)."""
    # lazy: loads torch (heavy), which only this path needs
    from speculators import SpeculatorModel
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    return SimpleNamespace(
        Eagle3DraftModel=Eagle3DraftModel,
        Eagle3SpeculatorConfig=Eagle3SpeculatorConfig,
        SpeculatorModel=SpeculatorModel,
    )


def create_transformer_layer_config(**kwargs: Any) -> Any:
    """The draft decoder's config shaped from the verifier, exactly as ``speculators train`` builds it.

    It lives in speculators' CLI module (``speculators.train.cli``); there is no library-level equivalent in 0.9, and
    rebuilding it here would drift from what vLLM expects of a speculators draft.
    """
    # lazy: loads torch (heavy), which only this path needs
    from speculators.train.cli import create_transformer_layer_config as build

    return build(**kwargs)


def offline_data() -> SimpleNamespace:
    """speculators' offline dataset pieces: ``ArrowDataset`` (reads our hidden-states layout), ``CollateFn``,
    the EAGLE-3 ``shift_batch`` preprocessing and the packing sampler ``MultipackDistributedBatchSamplerV2``."""
    # lazy: loads torch (heavy), which only this path needs
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    return SimpleNamespace(
        ArrowDataset=ArrowDataset,
        CollateFn=CollateFn,
        shift_batch=shift_batch,
        MultipackDistributedBatchSamplerV2=MultipackDistributedBatchSamplerV2,
    )


def shift_batch_every_position(batch: dict[str, Any]) -> dict[str, Any]:
    """speculators' ``shift_batch`` with the loss on every position, prompts included (``TrainConfig.loss_on="all"``).

    The loss target is the verifier's own distribution at each position (its last hidden states through its LM head),
    so a prompt position is as much the verifier's behaviour to imitate as an answer position; the states are already
    extracted, so this adds supervised positions at no extra cost. Module-level: loader workers pickle it."""
    # lazy: loads torch (heavy), which only this path needs
    import torch
    from speculators.models.eagle3.data import shift_batch

    return shift_batch({**batch, "loss_mask": torch.ones_like(batch["loss_mask"])})


def batch_preprocess(loss_on: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The per-sample preprocessing of a training batch: the loss on the answers only, or on every position."""
    # lazy: loads torch (heavy), which only this path needs
    from speculators.models.eagle3.data import shift_batch

    return shift_batch_every_position if loss_on == "all" else shift_batch


def build_optimizers(model: Any, lr: float, weight_decay: float, optimizer: str, muon_lr: float | None) -> list[Any]:
    """speculators' optimizers for ``optimizer``: AdamW alone, or Muon on the 2-D weight matrices beside AdamW on the
    rest. Muon's momentum, weight decay and Newton-Schulz steps are speculators' own defaults (its config schema)."""
    # lazy: loads torch (heavy), which only this path needs
    from speculators.train.config.schema import OptimizerArgs
    from speculators.train.optimizers import build_optimizers as build

    args = OptimizerArgs(optimizer=optimizer, lr=lr, weight_decay=weight_decay, muon_lr=muon_lr or lr)
    return build(model, args)


def normalize_counted_metrics(sums: dict[str, float]) -> dict[str, float]:
    """speculators' convention for metrics summed over batches: losses per batch, accuracies per token."""
    # lazy: loads torch (heavy), which only this path needs
    from speculators.train.utils import normalize_counted_metrics as normalize

    return normalize(sums)


def build_vocab_mappings(freq: Any, draft_vocab_size: int, target_vocab_size: int) -> tuple[Any, Any]:
    """(d2t, t2d) from token frequencies: target id = i + d2t[i]; t2d marks the draft's target tokens."""
    # lazy: loads torch (heavy), which only this path needs
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    return build_vocab_mappings_from_distribution(freq, draft_vocab_size, target_vocab_size)


def load_model_layers(names: list[str], path: str) -> dict[str, Any]:
    """Named tensors from a model folder's safetensors shards, without building the model."""
    # lazy: loads torch (heavy), which only this path needs
    from speculators.utils.loading import load_model_layers as load

    return load(names, path)


def hidden_states_client() -> SimpleNamespace:
    """speculators' vLLM extraction client: ``generate_hidden_states_async(client, model, {"input_ids": ids},
    timeout=, max_retries=)`` -> (connector file path, kv_transfer_params), and its ``InvalidResponseError``."""
    # lazy: loads torch (heavy), which only this path needs
    from speculators.data_generation.vllm_client import InvalidResponseError, generate_hidden_states_async

    return SimpleNamespace(
        generate_hidden_states_async=generate_hidden_states_async, InvalidResponseError=InvalidResponseError
    )
