"""One evaluation run: offline and (optionally) online acceptance of a draft and its untrained twin, one report.

Shared by the ``draft_evaluation`` asset and ``eagle3 evaluate``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from eagle3_assets.core import lineage
from eagle3_assets.core.precision import AUTO
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.evaluation.evaluation_report import AcceptanceStats, EvaluationReport, OnlineRun, write_report
from eagle3_assets.evaluation.offline import draft_verifier_path, evaluate_offline, load_draft, save_untrained_draft
from eagle3_assets.evaluation.online_metrics import OnlineConfig
from eagle3_assets.evaluation.prompt_sets import HELD_OUT, fitting_prompts, load_prompt_set
from eagle3_assets.hidden_states import publish, versions
from eagle3_assets.local.verifier_settings import VerifierSettings
from eagle3_assets.training.online_states import OnlineExtraction, extraction_side

logger = logging.getLogger(__name__)

UNTRAINED_DIR = "untrained_draft"
# |online - offline| mean acceptance length the report calls agreement. Offline simulates exactly the greedy-
# consistent windows of the stored data; the remaining gap comes from the other positions (sequence ends, windows
# crossing a re-tokenization difference), other prompts (online uses the first N held-out prompts, offline the
# stored samples) and float32 vs stored-dtype hidden states.
DEFAULT_TOLERANCE = 0.3


@dataclass
class EvaluationOptions:
    k: int = OnlineConfig.k
    online: bool = True
    offline: bool = True
    untrained: bool = True
    partition: str | None = None  # held-out hidden_states / raw_prompts partition; None: lineage.held_out_partition
    offline_max_samples: int | None = None
    untrained_seed: int = 0
    # the untrained baseline's init (TrainConfig.init); None: the one recorded in the draft's training history
    untrained_init: str | None = None
    tolerance: float = DEFAULT_TOLERANCE
    device: str = AUTO  # where the offline simulation runs the drafts (EAGLE3_DEVICE, as training)
    online_config: OnlineConfig = field(default_factory=OnlineConfig)
    # where the states of held-out samples the partition does not store are computed (a partition built for online
    # training: training.online.extraction_side); None: the offline evaluation reads stored states only
    extraction: OnlineExtraction | None = None


def training_init(draft_dir: Path) -> str | None:
    """The init the draft at ``draft_dir`` (``<draft_model>/final``) was trained from, if its history says."""

    # lazy: loads pydantic (heavy), which only this path needs
    from eagle3_assets.training.checkpoints import HISTORY_FILE

    try:
        history = json.loads((draft_dir.parent / HISTORY_FILE).read_text())
    except (OSError, ValueError):
        return None
    init = (history.get("config") or {}).get("init") if isinstance(history, dict) else None
    return init if isinstance(init, str) else None


def _online(
    layout: DataLayout,
    partition: str | None,
    draft_dir: Path,
    untrained_dir: Path,
    verifier_path: Path,
    options: EvaluationOptions,
    say: Callable[[str], None],
    notes: list[str],
) -> tuple[list[AcceptanceStats], list[OnlineRun]]:
    """The drafts in vLLM on every named prompt set."""
    # lazy: looked up when called, so a test can replace it
    from eagle3_assets.evaluation.online_metrics import evaluate_online

    cfg = options.online_config
    cfg.k = options.k
    names = list(cfg.prompt_sets)
    if partition is None and HELD_OUT in names and len(names) > 1:
        names.remove(HELD_OUT)
        notes.append(f"online {HELD_OUT} skipped: no hidden_states partition to hold out")
    prompt_sets = {name: load_prompt_set(name, layout, partition, cfg.prompts, cfg.humaneval_prompts) for name in names}
    for name, prompts in prompt_sets.items():  # a prompt longer than the servers' context is left out, and said
        prompt_sets[name], dropped = fitting_prompts(prompts, verifier_path, cfg.max_model_len - cfg.max_tokens)
        if dropped:
            notes.append(
                f"online {name}: {len(dropped)} of {len(prompts)} prompts left out, longer than the servers' context "
                f"({cfg.max_model_len} tokens) less max_tokens {cfg.max_tokens}: {', '.join(dropped[:5])}"
            )
    drafts = {"trained": draft_dir}
    if options.untrained and cfg.draft_url:
        # a draft server given by URL is a deployment: nothing is started for the untrained baseline beside it
        notes.append("untrained baseline: offline only (the trained draft's server is given by EAGLE3_EVAL_DRAFT_URL)")
    elif options.untrained:
        drafts["untrained"] = untrained_dir
    result = evaluate_online(verifier_path, drafts, prompt_sets, cfg, say)
    runs = []
    for name, prompts in prompt_sets.items():
        baseline = result.baseline[name]
        speed = baseline.speed  # the plain verifier's side of every draft's paired speed batch
        speed_failed = len(speed.failures) if speed is not None else 0
        runs.append(
            OnlineRun(
                prompts=len(prompts),
                max_tokens=cfg.max_tokens,
                baseline_output_tokens=speed.output_tokens if speed is not None else 0,
                # its answered requests' seconds; with one failed, no tokens/s (the stricter rule, as the drafts')
                baseline_seconds=speed.seconds if speed is not None and not speed_failed else 0.0,
                mismatches=result.mismatches[name],
                server_startup_s=result.startup_s,
                prompt_set=name,
                concurrency=cfg.concurrency,
                speed_prompts=min(cfg.speed_prompts, len(prompts)) if speed is not None else 0,
                failed=len(baseline.failures),
                speed_failed=speed_failed,
            )
        )
    if any(run.speed_failed for run in runs) or any(s.speed_failed for s in result.stats):
        notes.append(
            "online speed: a speed-up only from paired speed requests all answered on both sides, and tok/s only from "
            "a side whose every speed request was answered; where one failed, its prompt is left out of the ratios, "
            "that tok/s and the speed-ups over it are withheld (not computed from the surviving pairs), and the rows "
            "say how many failed"
        )
    return result.stats, runs


def _ordered(stats: list[AcceptanceStats], sets: list[str], notes: list[str]) -> list[AcceptanceStats]:
    """By prompt set, the trained draft first, online before offline; the offline coverage note added."""
    order = {"online": 0, "offline": 1}

    def rank(s: AcceptanceStats) -> tuple[int, bool, int]:
        return (sets.index(s.prompt_set) if s.prompt_set in sets else len(sets), s.label != "trained", order[s.method])

    stats = sorted(stats, key=rank)
    for s in stats:
        if s.method == "offline" and "coverage" in s.extra:
            notes.append(
                f"offline ({s.label}): {s.extra['samples']} stored samples, {s.extra['coverage']:.1%} of assistant "
                f"anchors greedy-consistent; every-position mean acceptance length "
                f"{s.extra['every_position_mean_acceptance_length']:.3f}"
            )
            break
    return stats


@contextlib.contextmanager
def _missing_states(
    layout: DataLayout,
    partition: str,
    folder: Path,
    verifier: Path,
    extraction: OnlineExtraction | None,
    notes: list[str],
) -> Iterator[Any]:
    """What computes the held-out samples' states the partition's pinned version ``folder`` does not store (None:
    none missing, or no extraction side given: the stored ones are evaluated, and the notes say how many)."""
    # lazy: loads polars (heavy), which only this path needs
    import polars as pl

    # lazy: loads pydantic (heavy), which only this path needs
    from eagle3_assets.hidden_states.state_checks import version_index_path

    index = pl.read_parquet(version_index_path(layout, partition, folder), columns=["file"])
    missing = index["file"].null_count()
    if missing == 0:
        yield None
        return
    if extraction is None:
        notes.append(f"offline: {index.height - missing} of {index.height} held-out samples store states; only those")
        yield None
        return
    # lazy: loads pydantic (heavy), which only this path needs
    from eagle3_assets.hidden_states.state_checks import read_meta
    from eagle3_assets.training.online_states import ONLINE_TRANSFER_DIR, fetching, for_partition

    notes.append(f"offline: {missing} of {index.height} held-out samples' states computed by the "
                 f"{extraction.backend} backend (the partition was built for online training)")  # fmt: skip
    aimed = for_partition(replace(extraction, verifier_path=str(verifier)), read_meta(layout, partition, folder))
    with fetching(aimed, layout.evaluation_dir / ONLINE_TRANSFER_DIR) as fetch:
        yield fetch


def _offline(
    layout: DataLayout,
    partition: str,
    models: dict[str, Any],
    verifier_path: Path,
    options: EvaluationOptions,
    say: Callable[[str], None],
    notes: list[str],
) -> list[AcceptanceStats]:
    """The drafts simulated on the held-out partition: one version of it, pinned while it is read, and refused
    when its lineage is stale for these drafts (other responses, another verifier, other layers than the
    trained draft consumes)."""
    trained = models["trained"]
    current = {
        "verifier": lineage.verifier_fingerprint(verifier_path, cache_dir=layout.asset_dir("hidden_states")),
        "layer_ids": [int(i) for i in trained.target_layer_ids],
    }
    with publish.pinned(layout, [partition]) as dirs:
        versions.require_current_hidden_states(layout, [partition], current, dirs, "evaluation (offline)")
        args = (layout, partition, options.k, verifier_path, options.offline_max_samples, say)
        with _missing_states(layout, partition, dirs[partition], verifier_path, options.extraction, notes) as fetch:
            return evaluate_offline(models, *args, device=options.device, fetch=fetch, data_dir=dirs[partition])


def run_evaluation(
    layout: DataLayout,
    draft_dir: Path,
    verifier: Path | None = None,
    options: EvaluationOptions | None = None,
    log: Callable[[str], None] | None = None,
    write: bool = True,
) -> EvaluationReport:
    options = options or EvaluationOptions()
    say = log or logger.info
    draft_dir = Path(draft_dir).expanduser().resolve()
    if not (draft_dir / "config.json").is_file():
        raise FileNotFoundError(f"no speculators draft at {draft_dir} (config.json missing): train draft_model first")
    if options.k <= 0:
        raise ValueError(f"k={options.k}: must be a positive integer")
    partition = lineage.held_out_partition(layout, options.partition)
    notes: list[str] = []

    trained = load_draft(draft_dir, verifier)
    verifier_path = Path(verifier).expanduser().resolve() if verifier is not None else draft_verifier_path(trained)
    models = {"trained": trained}
    untrained_dir = layout.evaluation_dir / UNTRAINED_DIR
    if options.untrained:
        # lazy: looked up when called, so a test can replace it
        from eagle3_assets.evaluation.offline import build_untrained_like

        init = options.untrained_init or training_init(draft_dir)
        models["untrained"] = build_untrained_like(trained, options.untrained_seed, init)
        notes.append(f"untrained baseline: the same shape, init {init or 'default'!r}, seed {options.untrained_seed}")
        if options.online and not options.online_config.draft_url:
            save_untrained_draft(trained, untrained_dir, options.untrained_seed, init)

    stats = []
    if options.offline:
        if partition is None:
            notes.append(
                f"offline skipped: no hidden_states partition under {layout.root} whose checks passed (the one "
                "hold-out rule, lineage.held_out_partition); name one with --partition (EvaluationOptions.partition)"
            )
        elif not layout.hidden_states_index_path(partition).exists():
            notes.append(f"offline skipped: no hidden_states partition {partition!r} under {layout.root}")
        else:
            stats += _offline(layout, partition, models, verifier_path, options, say, notes)
    online_runs: list[OnlineRun] = []
    if options.online:
        online_stats, online_runs = _online(
            layout, partition, draft_dir, untrained_dir, verifier_path, options, say, notes
        )
        stats += online_stats
    stats = _ordered(stats, list(options.online_config.prompt_sets), notes)
    report = EvaluationReport(
        draft_dir=str(draft_dir),
        verifier=str(verifier_path),
        k=options.k,
        held_out_partition=partition,
        stats=stats,
        online=online_runs or None,
        tolerance=options.tolerance,
        notes=notes,
    )
    if write:
        json_path, md_path = write_report(report, layout)
        say(f"evaluation report: {json_path} and {md_path}")
    return report


def missing_states_extraction(verifier: VerifierSettings) -> OnlineExtraction:
    """Where the offline evaluation computes the states a held-out partition built for online training does not
    store: as online training does, with EAGLE3_HIDDEN_STATES_* (the verifier path is filled in when it runs)."""
    return extraction_side(
        verifier.hidden_states_backend, "", verifier.hidden_states_urls(), verifier.hidden_states_storage or None,
        verifier.hidden_states_outage_budget_s, verifier.device, verifier.precision,
    )  # fmt: skip
