"""``eagle3 tables``: the docs' tables of measured figures, rendered from the measurement files of single runs.

A rendered table sits between two comments in a Markdown file; the first names the view and the file (relative to
``docs/``, as the figures marker does) and is the table's figures marker too::

    <!-- figures: measurements/demo-real_625eae5.json --><!-- rendered: stages -->
    | stage | partitions | seconds | server fullness |
    ...
    <!-- end rendered -->

``eagle3 tables README.md docs/*.md`` rewrites every such block from its file; ``--check`` changes nothing and exits
1 naming each block that differs (``tests/unit/test_docs_figures.py`` runs it), so a figure edited by hand, or a file
re-measured without re-rendering, fails. Views: ``run`` (which run, where, when), ``stages`` (every stage's seconds,
the server's fullness while generating), ``training`` and ``evaluation`` (every online and offline row).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from eagle3_assets.core.settings import REPO_ROOT
from eagle3_assets.core.storage import write_bytes_atomic

DOCS = REPO_ROOT / "docs"
BLOCK = re.compile(
    r"(?P<open><!--\s*figures:\s*(?P<file>\S+)\s*--><!--\s*rendered:\s*(?P<view>\w+)\s*-->\n)"
    r"(?P<body>.*?)"
    r"(?P<close><!--\s*end rendered\s*-->)",
    re.DOTALL,
)


def _row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    return "\n".join([_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)])


def _num(value: object, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def render_run(record: dict[str, Any]) -> str:
    machine = record.get("machine") or {}
    gpus = ", ".join(machine.get("gpus") or []) or "none"
    rows = [
        ["run", f"`{record['run']}` at commit `{record['commit']}`"],
        ["machine", f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, GPUs: {gpus}"],
        ["started / ended", f"{record.get('started', '-')} / {record.get('ended', '-')}"],
        ["complete", "yes" if record.get("complete") else "no (stopped before the end)"],
        ["seconds, all stages", _num(record.get("seconds_total"), 1)],
    ]
    return _table(["", ""], rows)


def render_stages(record: dict[str, Any]) -> str:
    rows = []
    # a resumed run's stages carry their attempt: a column then, so a re-run's seconds are not read as the work's
    attempts = len({stage.get("attempt", 1) for stage in record.get("stages", [])}) > 1
    for stage in record.get("stages", []):
        fullness = stage.get("server_fullness")
        full = (
            f"{fullness['mean_running']:.1f} of {fullness['target']} running ({fullness['share']:.0%}), "
            f"{fullness['mean_waiting']:.1f} waiting"
            if fullness
            else "-"
        )
        attempt = [stage.get("attempt", 1)] if attempts else []
        rows.append([stage["stage"], *attempt, stage["partitions"], _num(stage["seconds"], 1), full])
    return _table(["stage", *(["attempt"] if attempts else []), "partitions", "seconds", "server fullness"], rows)


def render_training(record: dict[str, Any]) -> str:
    training = record.get("training") or {}
    val_loss = training.get("val_loss")
    rows = [
        ["training samples", training.get("train_samples", "-")],
        ["optimizer steps", training.get("steps", "-")],
        ["tokens trained", training.get("tokens_trained", "-")],
        ["epochs", training.get("epochs", (training.get("config") or {}).get("epochs", "-"))],
        ["validation loss, last epoch", _num(val_loss[-1] if isinstance(val_loss, list) else val_loss)],
        ["validation loss, untrained draft", _num(training.get("val_loss_untrained"))],
    ]
    return _table(["", ""], rows)


def _sampled(report: dict[str, Any]) -> dict[tuple[str, str], str]:
    """(prompt set, "draft (method)") -> the mean acceptance length of its sampled batch, "at T" (none: greedy only)."""
    out = {}
    for stats in report.get("stats") or []:
        sampled = (stats.get("extra") or {}).get("sampled")
        if sampled and sampled.get("mean_acceptance_length") is not None:
            where = (stats["prompt_set"], f"{stats['label']} ({stats['method']})")
            out[where] = f"{sampled['mean_acceptance_length']:.3f} at {sampled['temperature']:g}"
    return out


def render_evaluation(record: dict[str, Any]) -> str:
    report = record.get("evaluation") or {}
    sampled = _sampled(report)
    rows = []
    for prompt_set, drafts in (report.get("summary") or {}).items():
        for name, figures in drafts.items():
            interval = figures.get("speedup_interval")
            speed = "-"
            if figures.get("speedup") is not None:
                bounds = f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else ""
                speed = f"{figures['speedup']:.2f}{bounds} {figures.get('speedup_verdict') or ''}".rstrip()
            positions = ", ".join(_num(x) for x in figures.get("acceptance_rate_per_position") or [])
            greedy = _num(figures.get("mean_acceptance_length"))
            sampled_text = sampled.get((prompt_set, name), "-")
            rows.append([prompt_set, name, figures.get("drafts", "-"), greedy, sampled_text, positions or "-", speed,
                         figures.get("failed", 0)])  # fmt: skip
    header = ["prompt set", "draft (method)", "drafts", "mean acc. len", "sampled", "acc. per position",
              "speed-up [95%]", "failed"]  # fmt: skip
    return _table(header, rows)


VIEWS: dict[str, Callable[[dict[str, Any]], str]] = {
    "run": render_run,
    "stages": render_stages,
    "training": render_training,
    "evaluation": render_evaluation,
}


def render(view: str, measurement: Path) -> str:
    """The ``view`` table of one measurement file."""
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r} (one of {', '.join(VIEWS)})")
    return VIEWS[view](json.loads(measurement.read_text()))


def rerendered(text: str, docs: Path = DOCS) -> tuple[str, list[str]]:
    """``text`` with every rendered block redrawn from its file, and the blocks that changed (``file view``)."""
    changed: list[str] = []

    def redraw(match: re.Match[str]) -> str:
        body = render(match["view"], docs / match["file"]) + "\n"
        if body != match["body"]:
            changed.append(f"{match['file']} {match['view']}")
        return match["open"] + body + match["close"]

    return BLOCK.sub(redraw, text), changed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3 tables", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="Markdown files holding rendered blocks")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a block is stale")
    parser.add_argument("--docs", type=Path, default=DOCS, help="folder the blocks' file names are relative to")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stale = []
    for path in args.files:
        text, changed = rerendered(path.read_text(), args.docs)
        stale += [f"{path}: {block}" for block in changed]
        if changed and not args.check:
            write_bytes_atomic(text.encode(), path)  # a stop mid-write leaves the old page, not half of it
    for line in stale:
        print(("stale: " if args.check else "rendered: ") + line)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
