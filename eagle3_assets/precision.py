"""Compute precision of the hf hidden-states backend and of draft training (``EAGLE3_PRECISION``).

``auto`` is bfloat16 wherever the hardware computes it natively: on GPUs, and on CPUs whose instruction set has
bf16 dot products (AVX512-BF16 or AMX-BF16: Intel Cooper Lake / Sapphire Rapids and later, AMD Zen 4 and later).
Elsewhere a bf16 matmul is emulated, slower than float32, so ``auto`` is float32 there. Measured on a 2-core
AVX512-BF16 machine (``benchmarks/cpu_precision.py``): SmolLM2-135M's forward pass ran ~2.6x faster in bf16. The
hidden states are stored in ``EAGLE3_HIDDEN_STATES_DTYPE`` (bf16 by default) whatever the compute precision; what
bf16 compute changes is the last bits of every layer's output, as it does for a verifier served in bf16.
"""

from __future__ import annotations

from pathlib import Path

PRECISIONS = ("auto", "float32", "bfloat16")
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


def resolve_precision(precision: str, on_gpu: bool, cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """``float32`` or ``bfloat16`` for a requested ``precision`` on a GPU (``on_gpu``) or the CPU."""
    if precision not in PRECISIONS:
        raise ValueError(f"{PRECISION_KEY}={precision!r}: must be one of {', '.join(PRECISIONS)}")
    if precision != "auto":
        return precision
    return "bfloat16" if on_gpu or cpu_has_native_bf16(cpuinfo) else "float32"
