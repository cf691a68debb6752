"""Hidden-state extraction tokens/s against a bare transformers forward loop over the same samples, same run.

    .venv/bin/python benchmarks/hidden_states_throughput.py [--samples 300] [--hidden-size 256] [--vocab-size 4096]

The bare loop is what a one-off script would do: the same rendered samples, the same length-bucketed batches,
``AutoModelForCausalLM(...)(input_ids, attention_mask, output_hidden_states=True)``, nothing kept. The
pipeline (``extract_partition``: render, forward, capture, check, write one fsynced safetensors file per sample,
index) must reach at least 0.9x its tokens/s. Both run with the same torch thread count. Everything is
written under a temporary folder.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import _common
from bare_engines import bare_forward
from eagle3_assets.hidden_states.hf_backend import BATCH_TOKENS


def main() -> int:
    parser = _common.tiny_model_parser(__doc__, samples=300)
    parser.add_argument("--batch-tokens", type=int, default=BATCH_TOKENS)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores but one)")
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each; the best of each counts")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
    from eagle3_assets.hidden_states.backends import plan_batches
    from eagle3_assets.hidden_states.samples import read_ok_responses as _read_ok_responses
    from eagle3_assets.hidden_states.samples import render_rows as _render_rows
    from eagle3_assets.prompts.sample_data import fabricate_responses

    verifier = _common.tiny_model(args)
    layer_ids = [1, 2, 3] if args.layers <= 4 else None
    with tempfile.TemporaryDirectory(prefix="eagle3-bench-") as tmp:
        layout = DataLayout.at(Path(tmp) / "data")
        fabricate_responses(layout, "00000", args.samples, min_words=60, max_words=140)
        ok, _ = _read_ok_responses(layout, "00000")
        rows, _served = _render_rows(ok, verifier, 2048, args.vocab_size, "00000")
        ids = [r.input_ids for r in rows]
        tokens = sum(len(x) for x in ids)
        batches = plan_batches([len(x) for x in ids], args.batch_tokens)
        model = AutoModelForCausalLM.from_pretrained(str(verifier), dtype=torch.float32, attn_implementation="sdpa")
        model.eval()

        def bare() -> float:
            return bare_forward(model, ids, batches, args.threads)

        def pipeline(run: int) -> float:
            import shutil

            # every published version, its pointer and index link: the next run computes every sample again
            shutil.rmtree(layout.asset_dir("hidden_states"), ignore_errors=True)
            config = HiddenStatesConfig(layer_ids=layer_ids, batch_tokens=args.batch_tokens, num_threads=args.threads)
            result = extract_partition(layout, "00000", verifier, config, log=lambda _msg: None)
            assert result.tokens_computed == tokens, (result.tokens_computed, tokens)
            return result.tokens_per_s

        bare()  # warm-up (allocator, kernels)
        bare_best = pipe_best = 0.0
        for run in range(args.repeats):
            bare_best = max(bare_best, bare())
            pipe_best = max(pipe_best, pipeline(run))

    ratio = pipe_best / bare_best
    print(
        f"samples {len(ids)}, tokens {tokens:,}, batches {len(batches)}, hidden {args.hidden_size}, "
        f"threads {args.threads or 'default'}"
    )
    print(f"{'bare transformers forward':<32}{bare_best:>12,.0f} tok/s")
    print(f"{'extract_partition (hf backend)':<32}{pipe_best:>12,.0f} tok/s")
    print(f"ratio extraction / bare forward: {ratio:.3f} (target >= 0.9) {'OK' if ratio >= 0.9 else 'BELOW TARGET'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
