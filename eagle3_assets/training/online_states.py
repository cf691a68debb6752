"""Online training: each batch's hidden states are computed while the draft trains, never stored whole.

``TrainConfig.hidden_states_source``:

* ``stored`` (default): every state is read from the ``hidden_states`` partition's files.
* ``online``: the partition's files are not read (an online partition has none: ``hidden_states`` built with
  ``store_states=False`` records token ids, loss masks, token frequencies and lineage only). Every batch's states
  come from the extraction side: the ``vllm`` backend's servers (``EAGLE3_HIDDEN_STATES_URLS``, or an embedded CPU
  vLLM in extraction mode started here for the run) or, for a verifier that fits beside training, the ``hf``
  backend in the loader's worker process.
* ``hybrid``: the stored files where they exist, the rest fetched online (a partition stored up to a disk budget).

Extraction and training overlap through torch's DataLoader: ``online_workers`` worker processes (spawned, kept for
the whole run) each fetch whole batches (one backend call per batch: batched forward passes for ``hf``, concurrent
requests for ``vllm``), and at most ``online_workers x prefetch_batches`` batches wait ready, so the states in memory
and the connector files on disk stay bounded by that window whatever the dataset's size. Every epoch fetches its
states again: an epoch costs one extraction pass over the data on top of the training (say it to users: 3 epochs
online = 3 extraction passes, where stored mode pays one).

The states go through speculators' own ``ArrowDataset`` (its per-sample packing and its check that the states'
token ids equal the sample's), filled by a transfer that hands it the fetched batch.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from eagle3_assets.core.precision import AUTO
from eagle3_assets.core.settings import OUTAGE_BUDGET_S, read_api_key
from eagle3_assets.hidden_states.backends import make_backend
from eagle3_assets.hidden_states.connector_files import sweep_stale_files
from eagle3_assets.hidden_states.hf_backend import BATCH_TOKENS
from eagle3_assets.hidden_states.samples import HS_SUBDIR
from eagle3_assets.hidden_states.storage_format import decode
from eagle3_assets.hidden_states.vllm_backend import VLLMBackendOptions
from eagle3_assets.local.extraction_server import context_for
from eagle3_assets.speculators_adapter import batch_preprocess, offline_data
from eagle3_assets.training.ranks import Ranks
from eagle3_assets.training.train_config import TrainConfig

SOURCES = ("stored", "online", "hybrid")
ONLINE_TRANSFER_DIR = ".online-transfer"  # under draft_model/: an embedded extraction server's connector files
ONLINE_TIME_KEY = "online_extract_s"  # seconds a batch's states took to fetch, carried beside the batch


@dataclass(frozen=True)
class OnlineExtraction:
    """How a worker reaches the extraction side (picklable: it travels to spawned workers)."""

    source: str
    backend: str  # "hf" or "vllm"
    verifier_path: str
    layer_ids: tuple[int, ...]
    device: str = AUTO
    precision: str = AUTO
    batch_tokens: int = BATCH_TOKENS
    vllm: Any = None  # VLLMBackendOptions with the servers' URLs (an embedded server's is filled in by `serving`)


class _BatchTransfer:
    """An hs_connectors transfer that hands ``ArrowDataset`` the states fetched for the current batch (and, in
    hybrid mode, a stored file where one exists)."""

    def __init__(self, hidden_states_dir: Path, read_stored: bool) -> None:
        self.hidden_states_dir = hidden_states_dir
        self.read_stored = read_stored
        self.fetched: dict[int, dict[str, Any]] = {}

    def stored(self, file_idx: int) -> Path | None:
        path = self.hidden_states_dir / f"hs_{file_idx}.safetensors"
        return path if self.read_stored and path.is_file() else None

    def setup(self) -> None:
        pass

    def get_cached(self, file_idx: int) -> dict[str, Any] | None:
        if file_idx in self.fetched:
            return self.fetched[file_idx]
        path = self.stored(file_idx)
        if path is None:
            return None
        # lazy: loads torch (heavy), which only this path needs
        from safetensors.torch import load_file

        tensors = load_file(str(path))
        return {"hidden_states": decode(tensors), "token_ids": tensors["token_ids"]}

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> None:
        return None

    def delete(self, handle: str) -> None:
        pass


class OnlineDataset:
    """One partition read through speculators' ``ArrowDataset``, its states fetched a batch at a time."""

    def __init__(self, datapath: Path, max_len: int, dtype: Any, extraction: OnlineExtraction) -> None:
        self.extraction = extraction
        self.transfer = _BatchTransfer(Path(datapath) / HS_SUBDIR, read_stored=extraction.source == "hybrid")
        self.inner = offline_data().ArrowDataset(
            max_len=max_len, datapath=str(datapath), transfer=self.transfer, on_missing="raise",
            hidden_states_dtype=dtype,
        )  # fmt: skip
        self.approx_lengths = self.inner.approx_lengths
        self._backend: Any = None

    def __len__(self) -> int:
        return len(self.inner)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_backend": None}  # each worker process opens its own backend

    def backend(self) -> Any:
        if self._backend is None:
            self._backend = open_backend(self.extraction)
        return self._backend

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        # lazy: loads torch (heavy), which only this path needs
        import torch

        started = time.perf_counter()
        wanted = [i for i in indices if self.transfer.stored(self.inner._map_to_file_idx(i)) is None]
        ids = [self.inner.data[i]["input_ids"].tolist() for i in wanted]
        states = self.backend().extract(ids) if ids else []
        self.transfer.fetched = {
            self.inner._map_to_file_idx(i): {"hidden_states": hs, "token_ids": torch.tensor(t, dtype=torch.long)}
            for i, t, hs in zip(wanted, ids, states, strict=True)
        }
        try:
            items = [self.inner[i] for i in indices]
        finally:
            self.transfer.fetched = {}
        if items and isinstance(items[0], dict):
            items[0][ONLINE_TIME_KEY] = time.perf_counter() - started
        return items

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]


class OnlineConcat:
    """Several partitions as one index space; a batch's indices are fetched per partition in one call each."""

    def __init__(self, datasets: Sequence[OnlineDataset]) -> None:
        self.datasets = list(datasets)
        self.offsets = [0]
        for ds in self.datasets:
            self.offsets.append(self.offsets[-1] + len(ds))

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        groups: dict[int, list[tuple[int, int]]] = {}
        for position, index in enumerate(indices):
            part = bisect.bisect_right(self.offsets, index) - 1
            groups.setdefault(part, []).append((position, index - self.offsets[part]))
        items: list[Any] = [None] * len(indices)
        spent = 0.0
        for part, members in groups.items():
            fetched = self.datasets[part].__getitems__([local for _, local in members])
            for (position, _), item in zip(members, fetched, strict=True):
                if isinstance(item, dict):
                    spent += item.pop(ONLINE_TIME_KEY, 0.0)
                items[position] = item
        if items and isinstance(items[0], dict):
            items[0][ONLINE_TIME_KEY] = spent
        return items

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]


class OnlineCollate:
    """speculators' collate, with the batch's fetch time moved out of the samples into the batch."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate

    def __call__(self, items: list[Any]) -> dict[str, Any]:
        spent = sum(item.pop(ONLINE_TIME_KEY, 0.0) for item in items if isinstance(item, dict))
        batch = self.collate(items)
        batch[ONLINE_TIME_KEY] = spent
        return batch


def online_loader_kwargs(workers: int, prefetch_batches: int) -> dict[str, Any]:
    """DataLoader options of the prefetch window: worker processes (spawned: torch's threads and a live event loop
    do not survive a fork) kept for the run, each holding at most ``prefetch_batches`` ready batches."""
    if workers == 0:
        return {"num_workers": 0}
    return {
        "num_workers": workers,
        "prefetch_factor": prefetch_batches,
        "persistent_workers": True,
        "multiprocessing_context": "spawn",
    }


@contextmanager
def serving(extraction: OnlineExtraction, storage: Path) -> Iterator[OnlineExtraction]:
    """The extraction side for the run: for the ``vllm`` backend without URLs, an embedded CPU vLLM in extraction
    mode (its connector files under ``storage``, deleted as they are read), stopped at the end; otherwise as given."""
    if extraction.source == "stored" or extraction.backend != "vllm" or extraction.vllm.urls:
        yield extraction
        return
    # lazy: looked up when called, so a test can replace it
    from eagle3_assets.local.extraction_server import start_extraction_server

    server = start_extraction_server(
        Path(extraction.verifier_path), list(extraction.layer_ids), storage,
        max_model_len=extraction.vllm.max_model_len, startup_timeout_s=extraction.vllm.startup_timeout_s,
        die_with_parent=True,
    )  # fmt: skip
    try:
        process, log = getattr(server, "process", None), getattr(server, "log_path", None)
        options = replace(
            extraction.vllm, urls=(server.base_url,), storage_path=str(storage),
            embedded_pid=process.pid if process is not None else None, embedded_log=str(log) if log else None,
        )  # fmt: skip
        yield replace(extraction, vllm=options)
    finally:
        server.stop()
        # A request the client gave up on (a retry after a timeout, a loader worker stopped mid-batch) is aborted in
        # the server, and the connector leaves the .lock it made when the request arrived (the file too, if it was
        # written). Nobody reads this folder once its server is down, so what is left is removed, not swept later.

        sweep_stale_files(storage, older_than_s=0.0)


def open_backend(extraction: OnlineExtraction) -> Any:
    """The extraction backend that computes states for token ids (float32, the partitions' layers)."""
    x = extraction
    return make_backend(
        x.backend, x.verifier_path, list(x.layer_ids), "float32", x.device, x.batch_tokens, vllm_options=x.vllm,
        precision=x.precision,
    )  # fmt: skip


def for_partition(extraction: OnlineExtraction, meta: dict[str, Any]) -> OnlineExtraction:
    """``extraction`` aimed at a hidden_states partition: its layer ids, and (embedded vLLM) room for its longest
    sample plus the one generated token."""
    vllm = extraction.vllm
    if vllm is not None:
        vllm = replace(vllm, max_model_len=context_for(int(meta["max_seq_len"])))
    return replace(extraction, layer_ids=tuple(meta["layer_ids"]), vllm=vllm)


@contextmanager
def fetching(extraction: OnlineExtraction, storage: Path) -> Iterator[Any]:
    """For one caller outside training (the offline evaluation of an online partition): the extraction side served
    (:func:`serving`) and its backend's ``extract`` (token id lists -> [T, layers, H] states), closed at the end."""
    with serving(extraction, storage) as served:
        backend = open_backend(served)
        try:
            yield backend.extract
        finally:
            backend.close()


def extraction_side(
    backend: str, verifier_path: str | Path, urls: Sequence[str] = (), storage: str | None = None,
    outage_budget_s: float | None = None, device: str = AUTO, precision: str = AUTO, source: str = "online",
) -> OnlineExtraction:  # fmt: skip
    """The extraction side's settings (``EAGLE3_HIDDEN_STATES_*``), the layers left to :func:`for_partition`. The
    servers' API key is read here from ``EAGLE3_API_KEY``: it travels to spawned workers in memory (pickled), never
    in a saved config."""
    vllm = VLLMBackendOptions(
        urls=tuple(urls), storage_path=storage, api_key=read_api_key(),
        outage_budget_s=OUTAGE_BUDGET_S if outage_budget_s is None else outage_budget_s,
    )  # fmt: skip
    return OnlineExtraction(
        source=source, backend=backend, verifier_path=str(verifier_path), layer_ids=(), device=device,
        precision=precision, vllm=vllm,
    )  # fmt: skip


def transfer_dir(out_dir: Path, ranks: Ranks) -> Path:
    """Where this process's embedded extraction server writes its connector files: each torchrun rank starts its own
    server and sweeps its folder when it stops, so ranks never share one (a rank ending first would delete the files
    another rank's server just wrote)."""
    folder = Path(out_dir) / ONLINE_TRANSFER_DIR
    return folder if ranks.world == 1 else folder / f"rank-{ranks.rank}"


def online_extraction(config: TrainConfig, verifier_path: Path, meta: dict[str, Any]) -> OnlineExtraction:
    """Where an online run's loader workers fetch states: the partitions' layer ids on the configured backend."""
    side = extraction_side(
        config.online_backend, verifier_path, config.online_urls, config.online_storage, config.online_outage_budget_s,
        config.device, config.precision, source=config.hidden_states_source,
    )  # fmt: skip
    return for_partition(side, meta)


def online_loader(
    dirs: Sequence[Path], tokens: int, hidden_size: int, n_aux: int, dtype: Any, seed: int, ranks: Ranks,
    online: OnlineExtraction, config: TrainConfig, loss_on: str = "assistant",
) -> Any:  # fmt: skip
    """make_loader's online form: the same sampler and collate over datasets that fetch their states a batch at
    a time, in ``online_workers`` processes holding at most ``prefetch_batches`` ready batches each."""
    # lazy: loads torch (heavy), which only this path needs
    from torch.utils.data import DataLoader

    sp = offline_data()
    datasets = [OnlineDataset(d, tokens, dtype, online) for d in dirs]
    lengths = [n for ds in datasets for n in ds.approx_lengths]
    sampler = sp.MultipackDistributedBatchSamplerV2(
        batch_max_length=tokens, lengths=lengths, num_replicas=ranks.world, rank=ranks.rank, seed=seed
    )
    preprocess = batch_preprocess(loss_on)
    collate = sp.CollateFn(tokens, hidden_size, num_target_layers=n_aux, dtype=dtype, preprocess=preprocess)
    return DataLoader(
        OnlineConcat(datasets), batch_sampler=sampler, collate_fn=OnlineCollate(collate),
        **online_loader_kwargs(config.online_workers, config.prefetch_batches),
    )  # fmt: skip
