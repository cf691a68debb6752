"""How a sample's hidden states are stored (the ``hidden_states`` run config's ``dtype``): bfloat16, float32 or FP8.

FP8 is ``float8_e4m3fn`` with one float32 scale per (token, layer) row, in the file layout of speculators'
``hs_connectors`` FP8 connector: ``hidden_states`` F8_E4M3 ``[T, n_aux + 1, H]`` beside ``hidden_states_scales`` F32
``[T, n_aux + 1, 1]``, dequantized as ``fp8.to(dtype) * scale``. hs_connectors' ``FP8Transfer`` reads that layout
(its scale broadcasts), so speculators' ``ArrowDataset`` trains from an FP8 partition unchanged. The scale is per
(token, layer) rather than hs_connectors' per token: the layers of one token differ in magnitude (the last layer's
raw output, taken before the final norm, is the largest), and one shared scale would spend the smaller layers' few
mantissa bits on zeros. It costs 4 bytes per layer per token, ~0.7% of the values' bytes at H=576.

Backends produce float32 for an FP8 partition and the writer quantizes, so both backends write the same bytes for
the same states (the vLLM connector's own output is converted by the client, as for the other dtypes).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FP8 = "float8_e4m3fn"
# bytes per stored value, and the safetensors header's name for the dtype (what validation compares)
STORAGE_DTYPES = {"bfloat16": 2, "float32": 4, FP8: 1}
_SAFETENSORS_NAMES = {"bfloat16": "BF16", "float32": "F32", FP8: "F8_E4M3"}
SCALES_KEY = "hidden_states_scales"  # hs_connectors.fp8_utils.SCALES_KEY: the name its FP8Transfer reads
_SCALE_BYTES = 4


def bytes_per_token(storage: str, n_states: int, hidden_size: int) -> int:
    """Bytes of stored states per token: the (aux + 1) x H values, plus the per-row scales of FP8."""
    return n_states * hidden_size * STORAGE_DTYPES[storage] + (n_states * _SCALE_BYTES if storage == FP8 else 0)


def backend_dtype(storage: str) -> str:
    """What a backend hands the writer: the storage dtype itself, or float32 for FP8 (quantized once, on write)."""
    return "float32" if storage == FP8 else storage


def safetensors_dtype(storage: str) -> str:
    return _SAFETENSORS_NAMES[storage]


def file_keys(storage: str) -> set[str]:
    """The tensors a sample file of this storage dtype holds."""
    return {"hidden_states", "token_ids", SCALES_KEY} if storage == FP8 else {"hidden_states", "token_ids"}


def encode(states: torch.Tensor, storage: str) -> dict[str, torch.Tensor]:
    """``{"hidden_states": ...}`` (plus the scales for FP8) of ``states`` [T, L, H] in the storage dtype."""
    # lazy: loads torch (heavy), which only this path needs
    import torch

    if storage != FP8:
        return {"hidden_states": states.to(getattr(torch, storage)).contiguous()}
    values = states.float()
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scales = (values.abs().amax(dim=-1, keepdim=True) / fp8_max).clamp(min=1e-12)
    return {"hidden_states": (values / scales).to(torch.float8_e4m3fn).contiguous(), SCALES_KEY: scales.contiguous()}


def decode(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """The stored states of one sample file as ``dtype`` (default: float32 for FP8, else as stored)."""
    # lazy: loads torch (heavy), which only this path needs
    import torch

    states = tensors["hidden_states"]
    if SCALES_KEY not in tensors:
        return states if dtype is None else states.to(dtype)
    dtype = dtype or torch.float32
    return states.to(dtype) * tensors[SCALES_KEY].to(dtype)


def load_states(path: Path, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Read one sample file's hidden states (dequantized when FP8)."""
    # lazy: loads torch (heavy), which only this path needs
    from safetensors.torch import load_file

    return decode(load_file(str(path)), dtype)


def training_transfer(hidden_states_dir: Path, storage: str, dtype: torch.dtype) -> Any:
    """The hs_connectors transfer speculators' ``ArrowDataset`` reads a partition's files through: ``FP8Transfer``
    (dequantizes to ``dtype``) for FP8, None (its default plain-file transfer) otherwise."""
    if storage != FP8:
        return None
    # lazy: loads torch (heavy), which only this path needs
    from hs_connectors.transfer import FP8Transfer

    return FP8Transfer(hidden_states_dir, dequantize_dtype=dtype)
