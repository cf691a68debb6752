"""``eagle3 evaluate``: evaluate a draft (e.g. one trained elsewhere) online in vLLM and offline, print the table.

    eagle3 evaluate --draft DIR [--verifier DIR] [--data-dir DIR] [--k 3] [--prompts 32] [--offline-only]
                    [--prompt-sets held-out,humaneval] [--humaneval-prompts N] [--speed-prompts 32]

The report (report.json, report.md) goes to ``DATA_DIR/draft_evaluation/`` (or ``--out``). Its table gives each
draft's batch-1 speed-up as the median of per-prompt ratios (plain and draft requests paired, alternating) with its
95% bootstrap interval, and a verdict: ``pays`` only where the interval's lower bound is above 1.0.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from eagle3_assets.core import settings
from eagle3_assets.core.partition_keys import InvalidPartitionKeyError, check_partition_key
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.evaluation.evaluate import EvaluationOptions, run_evaluation
from eagle3_assets.evaluation.evaluation_report import write_report
from eagle3_assets.evaluation.online_metrics import OnlineConfig
from eagle3_assets.evaluation.prompt_sets import PROMPT_SETS, parse_prompt_sets
from eagle3_assets.local.reasoning import check_reasoning_parser


def _partition_key(value: str) -> str:
    try:
        return check_partition_key(value)
    except InvalidPartitionKeyError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


# --NAME sets the OnlineConfig field NAME (its default and type are the field's)
ONLINE_FLAGS: tuple[tuple[str, str], ...] = (
    ("prompts", "held-out prompts sent online (default %(default)s)"),
    ("humaneval_prompts", "HumanEval problems sent online (0: all 164; default %(default)s)"),
    ("max_tokens", "max_tokens per online request (default %(default)s)"),
    ("concurrency", "requests in flight per server for acceptance (default %(default)s)"),
    (
        "sampled_temperature",
        "the trained draft's acceptance batch again at this temperature (vLLM's rejection sampling); 0: greedy only "
        "(default %(default)g)",
    ),
    (
        "speed_prompts",
        "batch-1 speed-up on each set's first N prompts, each sent to the plain verifier and to the draft one request "
        "at a time, alternating which goes first: the median ratio, its 95%% bootstrap interval and whether the draft "
        "pays; 0: none (default %(default)s)",
    ),
    (
        "request_timeout_s",
        "each online request, its whole reply, within this many seconds; a request past it is counted as failed "
        "(default %(default)g)",
    ),
)
# --NAME overrides the EvaluationServersSettings setting NAME (EAGLE3_EVAL_*); empty: the server is started here
SERVER_FLAGS = ("plain_url", "draft_url", "served_model_name")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle3 evaluate", description=__doc__.splitlines()[0])
    p.add_argument("--draft", required=True, type=Path, help="speculators EAGLE-3 draft folder (config.json)")
    p.add_argument("--verifier", type=Path, default=None, help="verifier folder (default: the one the draft names)")
    p.add_argument("--data-dir", default=None, help="data directory (default: EAGLE3_DATA_DIR)")
    p.add_argument(
        "--partition",
        default=None,
        type=_partition_key,
        help="held-out partition (default: the one the draft held out, the last hidden_states one whose checks passed)",
    )
    p.add_argument("--k", type=int, default=OnlineConfig.k, help="num_speculative_tokens (default %(default)s)")
    p.add_argument(
        "--prompt-sets",
        default=None,
        help=f"prompt sets, comma-separated ({', '.join(PROMPT_SETS)}; default: EAGLE3_EVAL_PROMPT_SETS)",
    )
    for name, help_text in ONLINE_FLAGS:
        default = getattr(OnlineConfig, name)
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default, help=help_text)
    p.add_argument(
        "--reasoning-parser",
        default=None,
        help="vLLM reasoning parser of the servers started: auto, none or a name (default: EAGLE3_REASONING_PARSER)",
    )
    p.add_argument("--offline-only", action="store_true", help="no vLLM: simulate from stored hidden states only")
    p.add_argument("--online-only", action="store_true", help="skip the offline simulation")
    p.add_argument("--no-untrained", action="store_true", help="skip the untrained-draft baseline")
    p.add_argument("--max-samples", type=int, default=256, help="stored samples simulated offline (0: all)")
    p.add_argument("--plain-url", default=None, help="running plain verifier server (default: EAGLE3_EVAL_PLAIN_URL)")
    p.add_argument(
        "--draft-url",
        default=None,
        help="running server with the verifier + this draft, started with --per-request-spec-decode-metrics "
        "summary (default: EAGLE3_EVAL_DRAFT_URL)",
    )
    p.add_argument("--served-model-name", default=None, help="model id on those servers (default: EAGLE3_EVAL_MODEL)")
    p.add_argument("--vllm-python", type=Path, default=None, help="vLLM interpreter for local servers")
    p.add_argument("--out", type=Path, default=None, help="report folder (default DATA_DIR/draft_evaluation)")
    p.add_argument("--json", action="store_true", help="print report.json instead of the table")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    # lazy: the settings models and the evaluation import every stage (~2 s), which only this path needs
    from eagle3_assets.environment import env_value
    from eagle3_assets.evaluation.evaluate import missing_states_extraction
    from eagle3_assets.evaluation.evaluation_settings import EvaluationServersSettings
    from eagle3_assets.local.verifier_settings import VerifierSettings

    if args.offline_only and args.online_only:
        print("eagle3 evaluate: --offline-only and --online-only exclude each other", file=sys.stderr)
        return 2
    if not args.request_timeout_s > 0:  # also NaN
        print(f"eagle3 evaluate: --request-timeout-s {args.request_timeout_s:g}: must be a positive number of seconds",
              file=sys.stderr)  # fmt: skip
        return 2
    layout = DataLayout.at(args.data_dir or env_value("EAGLE3_DATA_DIR"))
    settings.check_environ(EvaluationServersSettings)  # a bad EAGLE3_EVAL_* value: the error naming it
    settings.check_environ(VerifierSettings)
    servers = EvaluationServersSettings.from_env()
    try:
        prompt_sets = parse_prompt_sets("--prompt-sets", args.prompt_sets or servers.prompt_sets)
        parser = check_reasoning_parser(
            "--reasoning-parser", args.reasoning_parser or env_value("EAGLE3_REASONING_PARSER")
        )
    except ValueError as error:
        print(f"eagle3 evaluate: {error}", file=sys.stderr)
        return 2
    options = EvaluationOptions(
        k=args.k,
        online=not args.offline_only,
        offline=not args.online_only,
        untrained=not args.no_untrained,
        partition=args.partition,
        offline_max_samples=args.max_samples or None,
        device=env_value("EAGLE3_DEVICE"),
        online_config=OnlineConfig(
            **{name: getattr(args, name) for name, _help in ONLINE_FLAGS},
            **{name: getattr(args, name) or getattr(servers, name) or None for name in SERVER_FLAGS},
            prompt_sets=tuple(prompt_sets),
            reasoning_parser=parser,
            python=args.vllm_python,
            api_key=servers.api_key(),
            log_dir=layout.evaluation_dir / "_logs",
        ),
        extraction=missing_states_extraction(VerifierSettings.from_env()),
    )
    try:
        report = run_evaluation(
            layout,
            args.draft,
            args.verifier,
            options,
            log=lambda s: print(s, file=sys.stderr, flush=True),
            write=args.out is None,
        )
    except (FileNotFoundError, ValueError) as error:
        print(f"eagle3 evaluate: {error}", file=sys.stderr)
        return 1
    if args.out is not None:
        write_report(report, args.out)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
