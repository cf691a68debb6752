"""The ``eagle3`` console script. Each subcommand imports what it needs when it runs."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from eagle3_assets import settings


def _layout(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from eagle3_assets.storage import DataLayout

    return DataLayout.at(args.data_dir or settings.read_env("EAGLE3_DATA_DIR"))


def cmd_counts(args: argparse.Namespace) -> int:
    from eagle3_assets import storage

    layout = _layout(args)
    rows = storage.partition_row_counts(layout)
    status = storage.response_status_counts(layout)
    if args.json:
        print(json.dumps({"data_dir": str(layout.root), "rows": rows, "synthetic_responses": status}, indent=2))
        return 0
    if not rows:
        print(f"nothing materialized yet under {layout.root} (no partition files)")
        return 0
    keys = sorted({key for per_asset in rows.values() for key in per_asset})
    assets = list(rows)
    header = ["partition", *assets, "ok", "failed", "truncated", "completion_tokens"]
    table = [header]
    for key in keys:
        s = status.get(key, {})
        table.append(
            [key, *(str(rows[a].get(key, "-")) for a in assets)]
            + [str(s.get(k, "-")) for k in ("ok", "failed", "truncated", "completion_tokens")]
        )
    totals = ["total", *(str(sum(rows[a].values())) for a in assets)] + [
        str(sum(s.get(k, 0) for s in status.values())) for k in ("ok", "failed", "truncated", "completion_tokens")
    ]
    table.append(totals)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    print(f"data: {layout.root}")
    for row in table:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    if args.markdown:
        print(settings.settings_markdown())
        return 0
    for key, setting in settings.ENV_SETTINGS.items():
        value = "***" if setting.secret and settings.read_env(key) else settings.read_env(key)
        print(f"{key}={value}")
    return 0


def cmd_sample_data(args: argparse.Namespace) -> int:
    from eagle3_assets.sample_data import write_sample

    print(write_sample(Path(args.out), args.count, args.seed))
    return 0


def _forward(module: str, function: str = "main") -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        import importlib

        result = getattr(importlib.import_module(module), function)(args.rest)
        return int(result or 0)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3", description="Operate the eagle3-assets pipeline.")
    sub = parser.add_subparsers(dest="command", required=True)

    counts = sub.add_parser("counts", help="rows per partition of every partitioned asset (DuckDB)")
    counts.add_argument("--data-dir", help="default: EAGLE3_DATA_DIR")
    counts.add_argument("--json", action="store_true", help="machine-readable output")
    counts.set_defaults(func=cmd_counts)

    config = sub.add_parser("config", help="print the effective EAGLE3_* settings (secrets masked)")
    config.add_argument("--markdown", action="store_true", help="the README's configuration table")
    config.set_defaults(func=cmd_config)

    sample = sub.add_parser("sample-data", help="rebuild the shipped sample prompt dataset")
    sample.add_argument("out")
    sample.add_argument("--count", type=int, default=3000)
    sample.add_argument("--seed", type=int, default=0)
    sample.set_defaults(func=cmd_sample_data)

    for name, module, help_text in [
        ("tiny-model", "eagle3_assets.local.tiny_model", "build the tiny local verifier (model + tokenizer)"),
        ("serve-local", "eagle3_assets.local.vllm_server", "run the embedded CPU vLLM server"),
        ("demo", "eagle3_assets.demo", "materialize the whole pipeline on the sample data"),
    ]:
        forward = sub.add_parser(name, help=help_text, add_help=False)
        forward.add_argument("rest", nargs=argparse.REMAINDER)
        forward.set_defaults(func=_forward(module))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except settings.ConfigError as error:
        print(f"eagle3: configuration error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
