"""Hidden-state extraction throughput of the two backends, hf and vllm, on the same partition, side by side.

    .venv/bin/python benchmarks/hidden_states_backends.py [--samples 200] [--hidden-size 64] [--url URL] [--device D]

Both extract the same fabricated responses partition of the tiny verifier (float32 storage, layer ids 1,2,3) into
separate folders. ``tokens/s`` is extraction only, the backend's start-up excluded (model load for hf, server
start-up for vllm, which is reported on its own line): forward passes or requests, reading, checking and writing
every sample file. vllm uses the embedded CPU vLLM (started and stopped here) unless ``--url`` names a running
extraction server. The last lines give the vllm/hf throughput ratio and the largest difference between the two
backends' hidden states relative to their scale. Everything is written under a temporary folder.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import _common
from eagle3_assets.hidden_states.extract import HiddenStatesConfig
from eagle3_assets.hidden_states.vllm_backend import VLLMBackendOptions

LAYERS = [1, 2, 3]
KEY = "00000"


def main() -> int:
    parser = _common.tiny_model_parser(__doc__, samples=200, hidden_size=64, vocab_size=1024)
    parser.add_argument("--url", default="", help="a running extraction server (default: the embedded CPU vLLM)")
    parser.add_argument("--storage", default="", help="with --url: this machine's mount of its connector folder")
    parser.add_argument(
        "--device", default=HiddenStatesConfig.device, help="hf backend device (auto, cpu, cuda, cuda:N)"
    )
    # own default: float32 stores the states as computed (the backends' comparison needs no rounding)
    parser.add_argument("--dtype", default="float32", help="storage dtype (float32 or bfloat16)")
    parser.add_argument(
        "--concurrency", type=int, default=VLLMBackendOptions.concurrency, help="vllm requests in flight"
    )
    args = parser.parse_args()

    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.hidden_states import extract_partition
    from eagle3_assets.prompts.sample_data import fabricate_responses

    verifier = _common.tiny_model(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="eagle3-hs-backends-") as tmp:
        results = {}
        for backend in ("hf", "vllm"):
            layout = DataLayout.at(Path(tmp) / backend)
            fabricate_responses(layout, KEY, args.samples, min_words=60, max_words=200)
            options = VLLMBackendOptions(
                urls=(args.url,) if args.url else (), storage_path=args.storage or None, concurrency=args.concurrency
            )
            config = HiddenStatesConfig(
                layer_ids=LAYERS, dtype=args.dtype, backend=backend, device=args.device, vllm=options
            )
            started = time.perf_counter()
            result = extract_partition(layout, KEY, verifier, config, log=lambda _m: None)
            startup = time.perf_counter() - started - result.extract_seconds
            results[backend] = result
            rows.append(
                (backend, result.samples, result.tokens_computed, result.extract_seconds, result.tokens_per_s, startup)
            )
        worst = _max_relative_difference(results["hf"].data_dir, results["vllm"].data_dir, results["hf"].samples)

    print(
        f"tiny verifier: {args.layers} layers, hidden {args.hidden_size}; {args.samples} samples; {args.dtype} storage"
    )
    print(f"{'backend':<8} {'samples':>8} {'tokens':>9} {'extract s':>10} {'tokens/s':>10} {'start-up s':>11}")
    for backend, samples, tokens, seconds, rate, startup in rows:
        print(f"{backend:<8} {samples:>8} {tokens:>9,} {seconds:>10.2f} {rate:>10,.0f} {startup:>11.1f}")
    hf_rate, vllm_rate = rows[0][4], rows[1][4]
    print(f"vllm / hf tokens/s: {vllm_rate / hf_rate:.2f}")
    print(f"max |vllm - hf| / max |hf| over samples: {worst:.2e}")
    return 0


def _max_relative_difference(hf_dir: Path, vllm_dir: Path, samples: int) -> float:
    from safetensors.torch import load_file

    worst = 0.0
    for row in range(samples):
        ours = load_file(hf_dir / "hidden_states" / f"hs_{row}.safetensors")["hidden_states"].float()
        theirs = load_file(vllm_dir / "hidden_states" / f"hs_{row}.safetensors")["hidden_states"].float()
        worst = max(worst, float((theirs - ours).abs().max() / ours.abs().max()))
    return worst


if __name__ == "__main__":
    sys.exit(main())
