"""``eagle3 plan``: predict a run (samples and tokens per partition, stage times, hidden-state bytes, disk) before it.

    eagle3 plan [--demo-real] [--dataset PATH | --samples N --prompt-tokens MEAN] [--model DIR|config.json]
                [--completion-tokens MEAN|FILE|DIR] [--generation-rate TOK_S|FILE] [--extract-rate TOK_S|FILE]
                [--train-rate TOK_S|FILE] [--measured-partitions KEYS] [--compare FILE ...] [--json]

Defaults are the effective settings (``eagle3 config``); ``--demo-real`` takes ``make demo-real``'s. A rate is a
number (stated) or a measurement file: an ``eagle3 demo`` output (docs/measurements/demo_real_*.txt) or a
learning-curve JSONL (training only). The formulas are in ``eagle3_assets/planning/__init__.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3_assets import planning
from eagle3_assets.core.settings import parse_layer_ids
from eagle3_assets.hidden_states import HiddenStatesConfig
from eagle3_assets.local import real_verifier
from eagle3_assets.operations import demo_runs
from eagle3_assets.training.train_config import TrainConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle3 plan", description=__doc__.splitlines()[0])
    p.add_argument("--demo-real", action="store_true", help="plan `make demo-real` (its dataset, sizes and epochs)")
    what = p.add_argument_group("the dataset (default: EAGLE3_PROMPTS_PATH, read as raw_prompts reads it)")
    what.add_argument("--dataset", help="prompt dataset path or package:NAME")
    what.add_argument("--limit", type=int, help="rows read (default: EAGLE3_PROMPTS_LIMIT)")
    what.add_argument("--samples", type=int, help="no dataset: this many samples ...")
    what.add_argument("--prompt-tokens", type=float, help="... of this many prompt tokens on average (stated)")
    model = p.add_argument_group("the verifier (default: EAGLE3_VERIFIER_PATH)")
    model.add_argument("--model", help="model folder or its config.json (hidden size, layers, vocabulary)")
    model.add_argument("--hidden-size", type=int, help="stated hidden size (overrides the config)")
    model.add_argument("--num-layers", type=int, help="stated number of decoder layers")
    model.add_argument("--vocab-size", type=int, help="stated vocabulary size")
    model.add_argument("--layer-ids", help="auxiliary layer ids (default: EAGLE3_LAYER_IDS, else [2, N//2, N-3])")
    model.add_argument("--tokenizer", help="tokenizer folder for prompt tokens (default: the model folder)")
    model.add_argument("--chars-per-token", type=float, help="without a tokenizer: prompt characters per token")
    model.add_argument("--tokenize-max", type=int, default=20_000, help="prompts tokenized (default %(default)s)")
    sizes = p.add_argument_group("sizes (defaults: the settings and the run configs' defaults)")
    sizes.add_argument("--partition-size", type=int, help="default: EAGLE3_PARTITION_SIZE")
    sizes.add_argument("--max-tokens", type=int, help="default: EAGLE3_MAX_TOKENS")
    sizes.add_argument("--max-seq-len", type=int, help="hidden_states max_seq_len")
    sizes.add_argument("--max-model-len", type=int, help="the server's context: longer prompts fail (default: none)")
    sizes.add_argument("--dtype", help="hidden_states storage dtype")
    sizes.add_argument("--epochs", type=int, help="draft_model epochs")
    rates = p.add_argument_group("measured or stated figures")
    rates.add_argument(
        "--completion-tokens",
        help="mean completion tokens per ok sample: a number, a measurement file, or a previous run's data dir "
        "(synthetic_responses); default: max_tokens, an upper bound",
    )
    rates.add_argument("--generation-rate", help="output tokens/s of the server(s): a number or a measurement file")
    rates.add_argument("--extract-rate", help="hidden-state tokens/s: a number or a measurement file")
    rates.add_argument("--train-rate", help="training tokens/s: a number or a measurement file")
    rates.add_argument("--measured-partitions", help="take per-partition figures from these keys only (e.g. 00000)")
    rates.add_argument("--data-dir", help="where the free disk is measured (default: EAGLE3_DATA_DIR)")
    rates.add_argument("--free-disk-gb", type=float, help="stated free disk in GB instead")
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        help="a measurement file whose figures are printed beside the plan's (repeatable): an eagle3 demo output, "
        "a learning-curve JSONL, a hidden_states_at_scale output (bytes per token)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def _settings(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """(env_value reading the effective settings, with `make demo-real`'s on top for --demo-real; run-config values)."""
    # lazy: the settings models import every stage (~1.6 s), which only this path needs
    from eagle3_assets.environment import env_value

    run_config: dict[str, Any] = {
        "epochs": TrainConfig.epochs,
        "max_seq_len": HiddenStatesConfig.max_seq_len,
        "dtype": HiddenStatesConfig.dtype,
        "max_model_len": None,
    }
    environ = dict(os.environ)
    if args.demo_real:
        # demo.main: os.environ.setdefault for each, so a variable already set wins
        environ = {**demo_runs.REAL_ENV, "EAGLE3_PROMPTS_LIMIT": str(demo_runs.REAL_SAMPLES), **environ}
        for asset in ("hidden_states", "draft_model"):
            run_config.update({k: v for k, v in demo_runs.REAL_ASSET_CONFIG.get(asset, {}).items() if k in run_config})
        run_config["max_model_len"] = demo_runs.REAL_MAX_MODEL_LEN
    return (lambda key: env_value(key, environ)), run_config


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _rate(value: str | None, stage: str, keys: list[str] | None) -> planning.Rate:
    if value is None:
        return planning.NO_RATE
    number = _number(value)
    if number is not None:
        return planning.stated_rate(number)
    return planning.measured_rate(planning.read_measured(value), stage, keys)


def _completion(value: str | None, max_tokens: int, keys: list[str] | None) -> planning.Completion:
    if value is None:
        return planning.Completion(float(max_tokens), "max_tokens: an upper bound", upper_bound=True)
    number = _number(value)
    if number is not None:
        return planning.Completion(number, "stated")
    if Path(value).is_dir():
        return planning.responses_completion(value)
    return planning.measured_completion(planning.read_measured(value), keys)


def _verifier_sources(args: argparse.Namespace, env: Any) -> tuple[Path | None, Any]:
    """(the model folder or config, a GGUF to read when it is not built yet: `make demo-real`'s verifier)."""
    if args.model:
        return Path(args.model), None
    configured = env("EAGLE3_VERIFIER_PATH")
    if configured:
        return Path(configured), None
    if args.demo_real:
        folder = real_verifier.default_folder(args.data_dir or env("EAGLE3_DATA_DIR"))
        if (folder / "config.json").is_file():
            return folder, None
        return None, real_verifier.locate_gguf()  # the same model and tokenizer `eagle3 build-verifier` writes
    return None, None


def _model_and_tokenizer(args: argparse.Namespace, env: Any) -> tuple[planning.ModelShape, Any, str]:
    folder, gguf = _verifier_sources(args, env)
    layer_ids = (
        parse_layer_ids("--layer-ids", args.layer_ids)
        if args.layer_ids
        else parse_layer_ids("EAGLE3_LAYER_IDS", env("EAGLE3_LAYER_IDS") or "")
    )
    stated = {"hidden_size": args.hidden_size, "num_layers": args.num_layers, "vocab_size": args.vocab_size}
    tokenizer, name = None, ""
    if gguf is not None:
        # lazy: loads transformers (heavy), which only this path needs
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        from_gguf = {"hidden_size": config.hidden_size, "num_layers": config.num_hidden_layers,
                     "vocab_size": config.vocab_size}  # fmt: skip
        shape = planning.model_shape(None, layer_ids=layer_ids, **{k: stated[k] or v for k, v in from_gguf.items()})
        shape = planning.ModelShape(*[getattr(shape, f) for f in ("hidden_size", "num_layers", "vocab_size")],
                                    shape.layer_ids, f"{gguf.name} (not built yet)")  # fmt: skip
    else:
        shape = planning.model_shape(folder, layer_ids=layer_ids, **stated)
    if args.samples is not None:
        return shape, None, ""
    source = Path(args.tokenizer) if args.tokenizer else (folder if folder is not None and folder.is_dir() else None)
    if source is not None or gguf is not None:
        # lazy: loads transformers (heavy), which only this path needs
        from transformers import AutoTokenizer

        try:
            if source is not None:
                tokenizer, name = AutoTokenizer.from_pretrained(str(source)), source.name
            else:
                tokenizer, name = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), gguf.name
        except (OSError, ValueError) as error:
            if not args.chars_per_token:
                raise planning.PlanError(f"no tokenizer at {source} ({error}); give --chars-per-token") from None
    return shape, tokenizer, name


def make_plan(args: argparse.Namespace) -> planning.Plan:
    env, run_config = _settings(args)
    keys = [k.strip() for k in args.measured_partitions.split(",")] if args.measured_partitions else None
    shape, tokenizer, name = _model_and_tokenizer(args, env)
    max_tokens = args.max_tokens or env("EAGLE3_MAX_TOKENS")
    if args.samples is not None:
        if args.prompt_tokens is None:
            raise planning.PlanError("--samples needs --prompt-tokens (the mean prompt length, stated)")
        prompts = planning.stated_prompts(args.samples, args.prompt_tokens)
    else:
        prompts = planning.dataset_prompts(
            args.dataset or env("EAGLE3_PROMPTS_PATH"),
            max_prompt_chars=env("EAGLE3_MAX_PROMPT_CHARS"),
            truncated=env("EAGLE3_PROMPTS_TRUNCATED"),
            turns=env("EAGLE3_PROMPTS_TURNS"),
            limit=args.limit if args.limit is not None else env("EAGLE3_PROMPTS_LIMIT"),
            count_tokens=planning.chat_token_counter(tokenizer) if tokenizer is not None else None,
            tokenizer_name=name,
            tokenize_max=args.tokenize_max,
            chars_per_token=args.chars_per_token,
        )
    if args.free_disk_gb is not None:
        free, free_source = int(args.free_disk_gb * 1e9), "stated"
    else:
        free, free_source = planning.free_at(args.data_dir or env("EAGLE3_DATA_DIR"))
    return planning.build_plan(
        shape,
        prompts,
        _completion(args.completion_tokens, max_tokens, keys),
        partition_size=args.partition_size or env("EAGLE3_PARTITION_SIZE"),
        max_tokens=max_tokens,
        max_seq_len=args.max_seq_len or run_config["max_seq_len"],
        max_model_len=args.max_model_len or run_config["max_model_len"],
        epochs=args.epochs or run_config["epochs"],
        dtype=args.dtype or run_config["dtype"],
        generation=_rate(args.generation_rate, "generation", keys),
        extraction=_rate(args.extract_rate, "extraction", keys),
        training=_rate(args.train_rate, "training", keys),
        free=free,
        free_source=free_source,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv or []))
    try:
        plan = make_plan(args)
        comparisons = [c for path in args.compare for c in planning.compare(plan, planning.read_measured(path))]
    except (OSError, ValueError) as error:  # PlanError, a bad setting, a dataset that cannot be read
        print(f"eagle3 plan: {error}", file=sys.stderr)
        return 2
    if args.json:
        out = plan.as_dict()
        out["compared"] = [{**vars(c), "ratio": c.ratio} for c in comparisons]
        print(json.dumps(out, indent=2, default=str))
    else:
        print(planning.render(plan, comparisons))
    return 0
