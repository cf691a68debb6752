"""Bytes on disk per token of stored hidden states against the floor (aux layers + 1) x hidden x dtype size.

    .venv/bin/python benchmarks/hidden_states_bytes.py [--samples 200] [--hidden-size 256]

Counts the per-sample safetensors files (the payload that scales with tokens: hidden states + token ids +
header) for bfloat16 and float32 in the same run, and separately the partition's other files (dataset, token
frequencies, index). Target: sample files <= 1.05 x the floor. Everything is written under a temporary folder.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import _common


def main() -> int:
    args = _common.tiny_model_parser(__doc__, samples=200).parse_args()

    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
    from eagle3_assets.hidden_states.storage_format import bytes_per_token
    from eagle3_assets.prompts.sample_data import fabricate_responses

    verifier = _common.tiny_model(args)
    layer_ids = [1, 2, 3]
    print(f"{'dtype':<14}{'tokens':>10}{'bytes/token':>14}{'floor':>10}{'ratio':>8}{'other files/token':>20}")
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="eagle3-bench-") as tmp:
        for dtype in ("bfloat16", "float32", "float8_e4m3fn"):
            layout = DataLayout.at(Path(tmp) / dtype)
            fabricate_responses(layout, "00000", args.samples)
            result = extract_partition(
                layout, "00000", verifier, HiddenStatesConfig(layer_ids=layer_ids, dtype=dtype), log=lambda _m: None
            )
            floor = bytes_per_token(dtype, len(layer_ids) + 1, result.hidden_size)
            per_token = result.bytes / result.tokens
            all_files = sum(p.stat().st_size for p in layout.asset_dir("hidden_states").rglob("*") if p.is_file())
            other = (all_files - result.bytes) / result.tokens
            ratio = per_token / floor
            worst = max(worst, ratio)
            print(f"{dtype:<14}{result.tokens:>10,}{per_token:>14.1f}{floor:>10}{ratio:>8.3f}{other:>20.1f}")
    print(f"worst ratio sample bytes / floor: {worst:.3f} (target <= 1.05) {'OK' if worst <= 1.05 else 'ABOVE TARGET'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
