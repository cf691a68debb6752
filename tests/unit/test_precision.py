"""EAGLE3_PRECISION: `auto` follows the serving precision (bf16 on GPUs, float32 on the CPU, so the hf and vllm
backends agree there); bf16 on the CPU is chosen only where the CPU has it; the hf backend's states stay close."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_assets.core.precision import cpu_has_native_bf16, fastest_cpu_precision, resolve_precision

FLAGS_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512vl\n"
FLAGS_PLAIN = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512vl\n"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [(FLAGS_BF16, "bfloat16"), (FLAGS_PLAIN, "float32")],
)
def test_auto_follows_serving_and_the_fast_cpu_choice_follows_the_hardware(
    tmp_path: Path, flags: str, expected: str
) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(flags)
    assert fastest_cpu_precision(cpuinfo) == expected
    assert resolve_precision("auto", on_gpu=False) == "float32"  # whatever the CPU: as the CPU vLLM serves
    assert resolve_precision("auto", on_gpu=True) == "bfloat16"
    # an explicit choice is never overridden
    assert resolve_precision("float32", True) == "float32"
    assert resolve_precision("bfloat16", False) == "bfloat16"


def test_unknown_cpu_and_bad_value(tmp_path: Path) -> None:
    assert cpu_has_native_bf16(tmp_path / "missing") is False
    with pytest.raises(ValueError, match="EAGLE3_PRECISION='fp16'"):
        resolve_precision("fp16", False)


def test_bf16_states_match_float32_states(tmp_path: Path) -> None:
    """The same tiny verifier's captured states in bf16 and in fp32 compute agree to bf16's precision."""
    import torch

    from eagle3_assets.hidden_states.hf_backend import HFBackend
    from support.hidden_states_data import cached_tiny_verifier

    verifier = cached_tiny_verifier()
    ids = [list(range(5, 69)), list(range(100, 130))]
    fp32 = HFBackend(verifier, [1, 2, 3], store_dtype="float32", device="cpu", precision="float32").extract(ids)
    bf16 = HFBackend(verifier, [1, 2, 3], store_dtype="float32", device="cpu", precision="bfloat16").extract(ids)
    for a, b in zip(fp32, bf16, strict=True):
        assert a.shape == b.shape
        scale = a.abs().max()
        assert float((a - b).abs().max()) <= 0.05 * float(scale)
        assert not torch.equal(a, b)  # bf16 compute really ran
