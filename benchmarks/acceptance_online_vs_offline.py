"""Online (vLLM spec-decode counters) vs offline (simulated from stored hidden states) acceptance of the trained draft.

Runs the same evaluation as the ``draft_evaluation`` asset on a materialized data directory (``make demo``'s by
default) and prints both figures side by side, per draft (trained, untrained) and per position, with the difference
against the stated tolerance. Exit code 1 when the trained draft's figures disagree beyond it.

    .venv/bin/python benchmarks/acceptance_online_vs_offline.py [--data-dir DIR] [--prompts 32] [--k 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eagle3_assets.evaluation.online_metrics import OnlineConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None, help="default: EAGLE3_DATA_DIR")
    parser.add_argument("--draft", type=Path, default=None, help="default: DATA_DIR/draft_model/final")
    parser.add_argument("--verifier", type=Path, default=None, help="default: the verifier the draft names")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--k", type=int, default=OnlineConfig.k)
    parser.add_argument("--prompts", type=int, default=OnlineConfig.prompts)
    parser.add_argument("--max-tokens", type=int, default=OnlineConfig.max_tokens)
    parser.add_argument("--max-samples", type=int, default=256, help="0: all stored samples")
    parser.add_argument("--tolerance", type=float, default=None)
    parser.add_argument("--out", type=Path, default=None, help="also write report.json/report.md there")
    args = parser.parse_args(argv)

    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.environment import env_value
    from eagle3_assets.evaluation.evaluate import DEFAULT_TOLERANCE, EvaluationOptions, run_evaluation
    from eagle3_assets.evaluation.evaluation_report import write_report

    layout = DataLayout.at(args.data_dir or env_value("EAGLE3_DATA_DIR"))
    draft = args.draft or layout.draft_model_dir / "final"
    tolerance = args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE
    options = EvaluationOptions(
        k=args.k,
        partition=args.partition,
        offline_max_samples=args.max_samples or None,
        tolerance=tolerance,
        # online vs offline on the same kind of prompts: the held-out partition's (offline simulates its samples)
        online_config=OnlineConfig(prompts=args.prompts, max_tokens=args.max_tokens, prompt_sets=("held-out",)),
    )
    # the benchmark never overwrites the asset's report unless asked to
    report = run_evaluation(layout, draft, args.verifier, options, log=print, write=False)
    if args.out is not None:
        write_report(report, args.out)

    print(f"\n{'draft':<10} {'method':<8} {'drafts':>7} {'mean len':>9}  per-position acceptance")
    for s in report.stats:
        rates = " ".join(f"{r:.3f}" for r in s.acceptance_rate_per_position)
        print(f"{s.label:<10} {s.method:<8} {s.drafts:>7} {s.mean_acceptance_length:>9.3f}  {rates}")
    ok = True
    for label in report.labels():
        diff = report.agreement(label)
        if diff is None:
            continue
        on, off = report.get(label, "online"), report.get(label, "offline")
        assert on is not None and off is not None
        per_pos = [
            a - b for a, b in zip(on.acceptance_rate_per_position, off.acceptance_rate_per_position, strict=True)
        ]
        verdict = "agree" if abs(diff) <= tolerance else "DISAGREE"
        print(
            f"{label}: online {on.mean_acceptance_length:.3f} vs offline {off.mean_acceptance_length:.3f} "
            f"(diff {diff:+.3f}, tolerance {tolerance}): {verdict}; per-position diff "
            + " ".join(f"{d:+.3f}" for d in per_pos)
        )
        if label == "trained" and abs(diff) > tolerance:
            ok = False
    for label in report.labels():
        speedup = report.speedup(label)
        if speedup is not None:
            print(f"{label}: speed-up {speedup:.2f}x output tokens/s over the plain verifier")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
