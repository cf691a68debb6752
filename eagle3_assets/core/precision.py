"""Compute precision of the hf hidden-states backend and of draft training (``EAGLE3_PRECISION``).

``auto`` follows the precision the verifier is served at, so the states a draft learns from are the ones it meets:
bfloat16 on GPUs (vLLM serves in bf16 there), float32 on the CPU (the embedded CPU vLLM serves in float32, and a
kill-and-resume or a switch between the ``hf`` and ``vllm`` backends must give the same states). ``bfloat16`` on the
CPU is an explicit speed choice: on CPUs whose instruction set has bf16 dot products (AVX512-BF16 or AMX-BF16: Intel
Cooper Lake / Sapphire Rapids and later, AMD Zen 4 and later; ``cpu_has_native_bf16``) SmolLM2-135M's forward pass
ran ~2.6x faster (measured on 2 cores); elsewhere a bf16 matmul is emulated and slower than float32. The hidden
states are stored in the ``hidden_states`` run config's ``dtype`` (bf16 by default) whatever the compute
precision; bf16 compute changes the last bits of every layer's output, as serving in bf16 does.
"""

from __future__ import annotations

from pathlib import Path

# EAGLE3_DEVICE's and EAGLE3_PRECISION's default, and every config's that carries them: follow the hardware (every
# visible GPU, else the CPU; bf16 on GPUs, float32 on the CPU)
AUTO = "auto"
PRECISIONS = (AUTO, "float32", "bfloat16")
PRECISION_KEY = "EAGLE3_PRECISION"
# /proc/cpuinfo flag names of native bf16 arithmetic (Linux)
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU computes bf16 dot products natively (a Linux cpuinfo flag); False when unknown."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return bool(_BF16_FLAGS & set(line.partition(":")[2].split()))
    return False


def resolve_precision(precision: str, on_gpu: bool) -> str:
    """``float32`` or ``bfloat16`` for a requested ``precision`` on a GPU (``on_gpu``) or the CPU."""
    if precision not in PRECISIONS:
        raise ValueError(f"{PRECISION_KEY}={precision!r}: must be one of {', '.join(PRECISIONS)}")
    if precision != "auto":
        return precision
    return "bfloat16" if on_gpu else "float32"


def fastest_cpu_precision(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The faster explicit precision for CPU-only runs (the real-model demo): bf16 where the CPU computes it."""
    return "bfloat16" if cpu_has_native_bf16(cpuinfo) else "float32"
