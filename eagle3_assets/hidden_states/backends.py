"""Where the verifier's hidden states come from: a small interface and its implementations.

``extract_partition`` only talks to :class:`HiddenStateBackend`: it hands over batches of token-id sequences and
gets back, per sequence, a ``[T, n_aux + 1, H]`` tensor (the auxiliary layers in order, then the last decoder
layer's output before the final norm) in the storage dtype, on the CPU. Everything about running the verifier
(device, precision, batching, a remote server) stays behind that line, so a new backend is one class plus one
entry in :data:`BACKENDS`; the asset and the on-disk layout do not change.

Layer id convention (EAGLE-3, vLLM and speculators agree): id ``i`` is the input of decoder layer ``i``, which
is HF's ``output_hidden_states[i]`` (0 = the embeddings). vLLM collects auxiliary states in layer order while it
runs the layers, so ids must be strictly increasing or the draft would see them permuted at serving time.

Backends
--------
``hf`` (:mod:`eagle3_assets.hidden_states.hf_backend`): a transformers forward pass in this process over
length-bucketed, right-padded batches; on GPUs bf16 and ``device_map="auto"`` over every visible GPU, on the CPU
float32. Hooks capture only the needed layers.

``vllm`` (:mod:`eagle3_assets.hidden_states.vllm_backend`): the verifier runs in vLLM extraction servers (one or
several, any tensor-parallel size); this process sends token ids and reads the connector's files. The way a
verifier too large for one process is run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from eagle3_assets.core.precision import AUTO
from eagle3_assets.core.settings import ConfigError
from eagle3_assets.hidden_states.hf_backend import HFBackend
from eagle3_assets.hidden_states.vllm_backend import VLLMBackend

if TYPE_CHECKING:
    import torch

    from eagle3_assets.hidden_states.vllm_backend import VLLMBackendOptions


def default_threads() -> int:
    """One core left to everything else (writer threads, Dagster, a local vLLM): on a busy 2-core machine two
    OpenMP threads spin against other processes and a training step measured 30x slower than with one."""
    return max(1, (os.cpu_count() or 2) - 1)


@contextlib.contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """Run a block with ``num_threads`` intra-op threads (None: :func:`default_threads`), then restore."""
    # lazy: loads torch (heavy), which only this path needs
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(num_threads or default_threads())
    try:
        yield
    finally:
        torch.set_num_threads(before)


@runtime_checkable
class HiddenStateBackend(Protocol):
    """Runs the verifier over token sequences and returns the states EAGLE-3 trains on."""

    name: str
    layer_ids: list[int]
    hidden_size: int
    #: padded tokens per ``extract`` call the backend handles well; the caller batches by it
    batch_tokens: int

    def extract(self, batch: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """One ``[len(ids), len(layer_ids) + 1, hidden_size]`` CPU tensor per sequence, in the storage dtype."""
        ...

    def close(self) -> None: ...


def plan_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped into length-sorted batches whose padded size (count x longest) fits ``batch_tokens``.

    Sorting by length keeps padding near zero; a sequence longer than the budget gets a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # lengths ascend, so the candidate is the longest of the batch
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


BACKEND_NAMES = ("hf", "vllm")


def make_backend(
    name: str,
    verifier_path: str | Path,
    layer_ids: list[int],
    store_dtype: str,
    device: str,
    batch_tokens: int,
    vllm_options: VLLMBackendOptions | None = None,
    log: Callable[[str], None] | None = None,
    precision: str = AUTO,
) -> HiddenStateBackend:
    if name == "hf":
        return HFBackend(
            verifier_path, layer_ids, store_dtype=store_dtype, device=device, batch_tokens=batch_tokens,
            precision=precision,
        )  # fmt: skip
    if name == "vllm":
        return VLLMBackend(verifier_path, layer_ids, store_dtype, batch_tokens, options=vllm_options, log=log)
    raise ConfigError(f"backend={name!r}: unknown hidden-states backend; choose one of {list(BACKEND_NAMES)}")
