"""What a training step reads: the partitions' shared metadata, the packed loaders over them (stored states through
speculators' ``ArrowDataset``; online ones through ``training/online_states.py``) and a batch moved to the device."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_assets.core.storage import read_json
from eagle3_assets.hidden_states.samples import HS_SUBDIR, hs_file
from eagle3_assets.hidden_states.state_checks import META_FILE
from eagle3_assets.hidden_states.storage_format import training_transfer
from eagle3_assets.speculators_adapter import batch_preprocess, offline_data
from eagle3_assets.training.online_states import OnlineExtraction, online_loader
from eagle3_assets.training.ranks import Ranks
from eagle3_assets.training.train_config import TrainConfig

if TYPE_CHECKING:
    import torch

SINGLE_PROCESS = Ranks()


def _require_state_files(data_dir: Path, samples: int) -> None:
    """Stored training needs every sample's file: say which partition lacks how many, and the two ways on."""
    missing = [row for row in range(samples) if not hs_file(data_dir, row).is_file()]
    if missing:
        raise FileNotFoundError(
            f"hidden_states {data_dir}: {len(missing)} of {samples} state files are missing (first: "
            f"{hs_file(data_dir, missing[0]).name}); re-materialize that hidden_states partition, or train with "
            "hidden_states_source='online' (every state fetched while training) or 'hybrid' (the missing ones)"
        )


def make_loader(
    dirs: Sequence[Path],
    tokens: int,
    hidden_size: int,
    n_aux: int,
    dtype: Any,
    seed: int,
    ranks: Ranks = SINGLE_PROCESS,
    online: OnlineExtraction | None = None,
    config: TrainConfig | None = None,
    loss_on: str = "assistant",
) -> Any:
    """speculators' offline dataset per partition, concatenated, packed by its own sampler (this rank's share);
    with ``online`` (training/online_states.py) each batch's states are fetched by the loader's workers instead.
    ``loss_on``: ``assistant`` (the loss mask the hidden states carry) or ``all`` (every position)."""
    # lazy: loads torch (heavy), which only this path needs
    from torch.utils.data import ConcatDataset, DataLoader

    sp = offline_data()
    if online is not None and online.source != "stored":
        return online_loader(
            dirs, tokens, hidden_size, n_aux, dtype, seed, ranks, online, config or TrainConfig(), loss_on
        )
    datasets = []
    for d in dirs:  # each partition in its own storage dtype: FP8 ones are read through hs_connectors' FP8Transfer
        meta = read_json(d / META_FILE)
        _require_state_files(d, int(meta.get("samples", 0)))  # partitions of older releases: not counted
        storage = meta["dtype"]
        transfer = training_transfer(d / HS_SUBDIR, storage, dtype)
        datasets.append(
            sp.ArrowDataset(
                max_len=tokens, datapath=str(d), transfer=transfer, on_missing="raise", hidden_states_dtype=dtype
            )
        )
    lengths = [n for ds in datasets for n in ds.approx_lengths]
    sampler = sp.MultipackDistributedBatchSamplerV2(
        batch_max_length=tokens, lengths=lengths, num_replicas=ranks.world, rank=ranks.rank, seed=seed
    )
    preprocess = batch_preprocess(loss_on)
    collate = sp.CollateFn(tokens, hidden_size, num_target_layers=n_aux, dtype=dtype, preprocess=preprocess)
    return DataLoader(ConcatDataset(datasets), batch_sampler=sampler, num_workers=0, collate_fn=collate)


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    # lazy: loads torch (heavy), which only this path needs
    import torch

    # collate adds bookkeeping (error_records, recovery metadata) that the model's **kwargs must not receive
    return {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
