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
``hf`` (:class:`HFBackend`, done): a transformers forward pass over length-bucketed, right-padded batches, on
the CPU (float32 compute) or a GPU (bfloat16 compute). It runs the base model only (no LM head: the logits
are not needed, and at a 128k vocabulary the head costs as much as several layers).

``vllm`` (:class:`VLLMBackend`, NOT implemented here, a documented stub): the way a verifier too large for
one process (e.g. a 1T-parameter MoE) must be run. The plan, measured to work on CPU vLLM 0.32 (see
``shared/NOTES.md``):

1. serve the verifier with ``--speculative-config '{"method": "extract_hidden_states",
   "num_speculative_tokens": 1, "draft_model_config": {"hf_config":
   {"eagle_aux_hidden_state_layer_ids": [...]}}}'`` and ``--kv-transfer-config`` naming a hidden-states
   connector with a ``shared_storage_path`` (the stock example connector crashes on CPU; a subclass that
   does not pin memory and does not ``.query()`` the placeholder event works);
2. ``extract`` sends each sequence as a Completions request with ``prompt`` = the token ids and
   ``max_tokens=1`` (many in flight, like the generation engine), reads
   ``kv_transfer_params.hidden_states_path`` from each response, loads that safetensors file, checks its
   ``token_ids`` against the request, and returns its ``hidden_states`` (same layout as this module's);
3. the connector's file is deleted after loading. speculators' own client
   (``speculators.data_generation.vllm_client.generate_hidden_states`` + ``hs_connectors.FileTransfer``)
   does steps 2-3 and can be reused.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from eagle3_assets.settings import ConfigError

if TYPE_CHECKING:
    import torch

LAYER_IDS_KEY = "layer_ids"
DTYPES = {"bfloat16": 2, "float32": 4}


def default_threads() -> int:
    """One core left to everything else (writer threads, Dagster, a local vLLM): on a busy 2-core machine two
    OpenMP threads spin against other processes and a training step measured 30x slower than with one."""
    return max(1, (os.cpu_count() or 2) - 1)


@contextlib.contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """Run a block with ``num_threads`` intra-op threads (None: :func:`default_threads`), then restore."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(num_threads or default_threads())
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class VerifierShape:
    num_layers: int
    hidden_size: int
    vocab_size: int


def verifier_shape(verifier_path: str | Path) -> VerifierShape:
    """The verifier's layer count and widths from its config alone (no weights loaded)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(verifier_path))
    config = getattr(config, "text_config", config)  # multimodal wrappers keep the LM config inside
    return VerifierShape(config.num_hidden_layers, config.hidden_size, config.vocab_size)


def resolve_layer_ids(layer_ids: Sequence[int] | None, num_layers: int, key: str = LAYER_IDS_KEY) -> list[int]:
    """Default ``[2, N//2, N-3]`` (EAGLE-3's), validated against the verifier; errors name ``key`` and the value."""
    explicit = layer_ids is not None
    ids = list(layer_ids) if layer_ids is not None else [2, num_layers // 2, num_layers - 3]
    problem = None
    if not ids:
        problem = "needs at least one layer id"
    elif any(i < 0 or i >= num_layers for i in ids):
        problem = f"layer ids must lie in [0, {num_layers - 1}] for this {num_layers}-layer verifier"
    elif any(b <= a for a, b in itertools.pairwise(ids)):
        problem = "layer ids must be distinct and increasing (vLLM collects auxiliary states in layer order)"
    if problem is None:
        return ids
    if explicit:
        raise ConfigError(f"{key}={ids!r}: {problem}")
    raise ConfigError(
        f"{key}=None (default [2, N//2, N-3] = {ids!r}): {problem}; set {key} explicitly "
        f"(e.g. {list(range(1, min(num_layers, 4)))} for a small verifier)"
    )


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


class HFBackend:
    """transformers forward pass; aux states from ``output_hidden_states``, the last layer's output by a hook."""

    name = "hf"

    def __init__(
        self,
        verifier_path: str | Path,
        layer_ids: list[int],
        store_dtype: str = "bfloat16",
        device: str = "auto",
        batch_tokens: int = 8192,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        # bf16 compute on accelerators; on CPUs bf16 matmuls are often slower than fp32 and less exact
        compute_dtype = torch.bfloat16 if self.device.type != "cpu" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(
            str(verifier_path), dtype=compute_dtype, attn_implementation="sdpa"
        )
        model.eval().to(self.device)
        # The base model only: the LM head's logits are never used here.
        self.base = getattr(model, model.base_model_prefix)
        self.hidden_size = int(model.config.get_text_config().hidden_size)
        self.layer_ids = list(layer_ids)
        self.store_dtype = getattr(torch, store_dtype)
        self.batch_tokens = batch_tokens
        self._last: list[Any] = []
        norm = getattr(self.base, "norm", None)
        if norm is None:
            raise ValueError(f"{type(self.base).__name__} has no final `norm` module to hook (pre-norm states)")
        # HF's hidden_states[-1] is AFTER the final norm; EAGLE-3 trains on the last layer's raw output, which is
        # exactly the final norm's input.
        self._hook = norm.register_forward_pre_hook(lambda _module, args: self._last.append(args[0]))

    def extract(self, batch: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        import torch

        lengths = [len(ids) for ids in batch]
        longest = max(lengths)
        input_ids = torch.zeros((len(batch), longest), dtype=torch.long)
        attention_mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
        self._last.clear()
        with torch.inference_mode():
            out = self.base(
                input_ids=input_ids.to(self.device),
                # right padding never changes the causal states of real tokens; no mask at all when unpadded
                attention_mask=attention_mask.to(self.device) if min(lengths) < longest else None,
                output_hidden_states=True,
                use_cache=False,
            )
            states = [out.hidden_states[i] for i in self.layer_ids] + [self._last[-1]]
            stacked = torch.stack(states, dim=2).to(self.store_dtype).cpu()  # [B, T, n_aux+1, H]
        self._last.clear()
        return [stacked[row, :n].clone() for row, n in enumerate(lengths)]

    def close(self) -> None:
        self._hook.remove()


class VLLMBackend:
    """Placeholder for extraction through a vLLM server; NOT implemented. See this module's docstring."""

    name = "vllm"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "hidden_states backend 'vllm' is not implemented yet: use backend='hf'. The design (vLLM "
            "extract_hidden_states speculative method + a hidden-states KV connector, client via speculators' "
            "generate_hidden_states) is documented in eagle3_assets/hidden_states/backends.py"
        )

    def extract(self, batch: Sequence[Sequence[int]]) -> list[torch.Tensor]:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover
        pass


BACKENDS: dict[str, type] = {"hf": HFBackend, "vllm": VLLMBackend}


def make_backend(
    name: str,
    verifier_path: str | Path,
    layer_ids: list[int],
    store_dtype: str,
    device: str,
    batch_tokens: int,
) -> HiddenStateBackend:
    if name not in BACKENDS:
        raise ConfigError(f"backend={name!r}: unknown hidden-states backend; choose one of {sorted(BACKENDS)}")
    return BACKENDS[name](verifier_path, layer_ids, store_dtype=store_dtype, device=device, batch_tokens=batch_tokens)
