"""The ``hf`` hidden-states backend: the verifier as a transformers model in this process.

Devices (``EAGLE3_DEVICE``): ``auto`` spreads the model over every visible GPU with ``device_map="auto"`` (a model
too big for one GPU but not for the node), or the CPU when there is none; ``cuda`` means every visible GPU too;
``cuda:N`` one GPU; ``cpu`` the CPU. Compute precision is ``EAGLE3_PRECISION`` (``eagle3_assets/core/precision.py``):
by default bfloat16 on GPUs and float32 on the CPU (what the verifier is served in there).

Only the needed layers are kept: a forward pre-hook on decoder layer ``i`` captures its input (layer id ``i``,
HF's ``output_hidden_states[i]``), and a pre-hook on the final norm captures the last layer's raw output (HF's
``hidden_states[-1]`` is after that norm). ``output_hidden_states=True`` would keep every layer's states alive at
once, which at 60+ layers and long sequences costs more memory than the model's activations need. The base model
runs without its LM head: the logits are never used, and at a 128k vocabulary the head costs several layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_assets.core.precision import AUTO, resolve_precision
from eagle3_assets.core.settings import ConfigError

# padded tokens per forward pass (both backends batch by it; larger fills a GPU better, 8k suits 2 CPU cores)
BATCH_TOKENS = 8192

if TYPE_CHECKING:
    import torch

DEVICE_KEY = "EAGLE3_DEVICE"


def load_options(device: str, precision: str = AUTO) -> tuple[dict[str, Any], bool]:
    """``from_pretrained`` keyword arguments for ``device`` and ``precision``, and whether compute is on GPUs."""
    # lazy: loads torch (heavy), which only this path needs
    import torch

    if device not in ("auto", "cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise ConfigError(f"{DEVICE_KEY}={device!r}: must be auto, cpu, cuda or cuda:N")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.startswith("cuda") and gpus == 0:
        raise ConfigError(f"{DEVICE_KEY}={device!r}: no CUDA device is visible to this process")
    if device.startswith("cuda:") and int(device[5:]) >= gpus:
        raise ConfigError(f"{DEVICE_KEY}={device!r}: only {gpus} CUDA device(s) are visible")
    if device == "cpu" or (device == "auto" and gpus == 0):
        return {"dtype": getattr(torch, resolve_precision(precision, on_gpu=False))}, False
    device_map: Any = {"": int(device[5:])} if device.startswith("cuda:") else "auto"
    return {"dtype": getattr(torch, resolve_precision(precision, on_gpu=True)), "device_map": device_map}, True


class HFBackend:
    """transformers forward pass; the aux layers and the last layer's output captured by hooks."""

    name = "hf"

    def __init__(
        self,
        verifier_path: str | Path,
        layer_ids: list[int],
        store_dtype: str,
        device: str = AUTO,
        batch_tokens: int = BATCH_TOKENS,
        precision: str = AUTO,
    ) -> None:
        # lazy: loads torch (heavy), which only this path needs
        import torch

        # lazy: loads transformers (heavy), which only this path needs
        from transformers import AutoModelForCausalLM

        options, self.on_gpu = load_options(device, precision)
        model = AutoModelForCausalLM.from_pretrained(str(verifier_path), attn_implementation="sdpa", **options)
        model.eval()
        self.base = getattr(model, model.base_model_prefix)
        self.hidden_size = int(model.config.get_text_config().hidden_size)
        self.layer_ids = list(layer_ids)
        self.store_dtype = getattr(torch, store_dtype)
        self.batch_tokens = batch_tokens
        # where input ids go: the embedding's device (with device_map="auto" the first GPU of the map)
        self.input_device = self.base.get_input_embeddings().weight.device
        norm = getattr(self.base, "norm", None)
        layers = getattr(self.base, "layers", None)
        if norm is None or layers is None:
            raise ValueError(f"{type(self.base).__name__} has no `layers` and final `norm` to hook")
        self._captured: dict[int, Any] = {}
        self._hooks = [
            layers[i].register_forward_pre_hook(self._capture(slot), with_kwargs=True)
            for slot, i in enumerate(self.layer_ids)
        ]
        self._hooks.append(norm.register_forward_pre_hook(self._capture(len(self.layer_ids)), with_kwargs=True))

    def _capture(self, slot: int) -> Any:
        def hook(_module: Any, args: tuple, kwargs: dict) -> None:
            states = args[0] if args else kwargs["hidden_states"]
            # to the host at once: with device_map="auto" each layer's states sit on another GPU
            self._captured[slot] = states.detach().to("cpu", self.store_dtype, non_blocking=False)

        return hook

    def extract(self, batch: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        # lazy: loads torch (heavy), which only this path needs
        import torch

        lengths = [len(ids) for ids in batch]
        longest = max(lengths)
        input_ids = torch.zeros((len(batch), longest), dtype=torch.long)
        attention_mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
        self._captured.clear()
        with torch.inference_mode():
            self.base(
                input_ids=input_ids.to(self.input_device),
                # right padding never changes the causal states of real tokens; no mask at all when unpadded
                attention_mask=attention_mask.to(self.input_device) if min(lengths) < longest else None,
                use_cache=False,
            )
            states = [self._captured[slot] for slot in range(len(self.layer_ids) + 1)]
            stacked = torch.stack(states, dim=2)  # [B, T, n_aux+1, H]
        self._captured.clear()
        return [stacked[row, :n].clone() for row, n in enumerate(lengths)]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
