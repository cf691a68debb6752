"""Hidden states at scale, side by side on one real model's data: bf16 vs FP8 storage, stored vs online training.

Given a data dir whose ``synthetic_responses`` partitions a real verifier answered (``benchmarks/learning_curve.py``
leaves one: training partitions ``00000``.., held-out ``90000``, HumanEval ``90001``), one run prints

1. bytes per token of bf16 and FP8 sample files against the (aux + 1) x H x dtype floor;
2. offline mean acceptance length (k=3) of drafts trained from bf16 and from FP8 states with the same seed and
   recipe, beside the seed-to-seed spread of the bf16 draft (a second seed), so an FP8 difference can be read
   against noise;
3. training tokens/s from stored states vs online (states computed by the ``hf`` backend in a loader worker while
   training), the online run's time split (computing states, waiting for a batch, training) and its acceptance.

Every draft is evaluated on the same bf16 held-out and HumanEval partitions. Each variant works in its own copy of
the responses (``<work>/<variant>``), so the data dir's own partitions are never touched.

    python benchmarks/hidden_states_at_scale.py --verifier DIR --data /path/lc-data --train-keys 00000,00001 \\
        --epochs 2 --precision bfloat16 --reuse-bf16-states
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from eagle3_assets.core.verifier import SPECULATIVE_TOKENS
from eagle3_assets.operations.demo_runs import REAL_ASSET_CONFIG
from eagle3_assets.training.vocab import RECIPE_DRAFT_VOCAB_SIZE

RECIPE_TRAINING = REAL_ASSET_CONFIG["draft_model"]

HELD_OUT_KEY, HUMANEVAL_KEY = "90000", "90001"


def _layout_with_responses(data: Path, work: Path, keys: list[str]) -> Any:
    from eagle3_assets.core.storage import DataLayout

    src, layout = DataLayout.at(data), DataLayout.at(work)
    for key in keys:
        target = layout.responses_path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src.responses_path(key), target)
    return layout


def _relink(src: str, dst: str) -> str:
    """Hard-link ``src`` at ``dst``, replacing what a previous run of this benchmark left there (a re-run resumes)."""
    if os.path.lexists(dst):
        if os.path.samefile(src, dst):
            return dst
        os.unlink(dst)
    os.link(src, dst)
    return dst


def _link_states(src_data: Path, layout: Any, keys: list[str]) -> None:
    """Hard-link another data dir's finished partitions (same responses, dtype and precision) into ``layout``:
    extraction then finds them complete and only totals them (saves an extraction pass; ``extract_s`` is then the
    check's time, not an extraction's)."""
    src = src_data / "hidden_states"
    dst = layout.asset_dir("hidden_states")
    dst.mkdir(parents=True, exist_ok=True)
    for key in keys:
        for entry in src.glob(f"{key}*"):
            if entry.is_dir():
                shutil.copytree(entry, dst / entry.name, copy_function=_relink, dirs_exist_ok=True)
            else:
                (dst / entry.name).unlink(missing_ok=True)  # a re-run: a copy (or link) an earlier run left
                shutil.copy2(entry, dst / entry.name)


def _extract(layout: Any, keys: list[str], verifier: Path, dtype: str, args: Any) -> dict[str, float]:
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition

    tokens = bytes_ = 0
    started = time.perf_counter()
    for key in keys:
        result = extract_partition(
            layout,
            key,
            verifier,
            HiddenStatesConfig(
                dtype=dtype, precision=args.precision, layer_ids=args.layer_ids, num_threads=args.threads
            ),
            log=lambda _m: None,
        )
        tokens, bytes_ = tokens + result.tokens, bytes_ + result.bytes
        hidden, n_states = result.hidden_size, len(result.layer_ids) + 1
    from eagle3_assets.hidden_states.storage_format import bytes_per_token

    floor = bytes_per_token(dtype, n_states, hidden)
    return {
        "tokens": tokens,
        "bytes_per_token": bytes_ / tokens,
        "floor": floor,
        "extract_s": time.perf_counter() - started,
    }


def _train_and_measure(layout: Any, eval_layout: Any, keys: list[str], verifier: Path, args: Any, **over: Any) -> dict:
    from transformers import AutoConfig

    from eagle3_assets.evaluation.offline import evaluate_offline, load_draft
    from eagle3_assets.training import TrainConfig, build_vocab_mapping, train_draft

    vocab = AutoConfig.from_pretrained(verifier).vocab_size
    build_vocab_mapping(layout, keys, args.draft_vocab, target_vocab_size=vocab)
    shutil.rmtree(layout.draft_model_dir, ignore_errors=True)
    config = TrainConfig(
        epochs=args.epochs, lr=args.lr, tokens_per_batch=args.tokens_per_batch, device="cpu", max_val_batches=16,
        keep_checkpoints=1, precision=args.precision, loss_on=args.loss_on, num_threads=args.threads, **over,
    )  # fmt: skip
    result = train_draft(layout, keys, HELD_OUT_KEY, verifier, config, log=lambda _m: None)
    draft = load_draft(result.final_dir, verifier)
    accept = {}
    for label, key in (("held_out", HELD_OUT_KEY), ("humaneval", HUMANEVAL_KEY)):
        stats = evaluate_offline(
            {"d": draft},
            eval_layout,
            key,
            k=SPECULATIVE_TOKENS,
            verifier=verifier,
            log=lambda _m: None,
            num_threads=args.threads,
        )
        accept[label] = round(stats[0].mean_acceptance_length, 3)
    seconds = result.hidden_states["wait_s"] + result.hidden_states["train_s"]
    return {**accept, "tokens_per_s": round(result.tokens_trained / seconds, 1), **result.hidden_states}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--verifier", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="a data dir holding the responses partitions")
    parser.add_argument("--work", type=Path, help="where the variants are built (default: <data>/_scale_bench)")
    parser.add_argument("--train-keys", default="00000")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=RECIPE_TRAINING["lr"])  # the recipe in docs/real_model.md
    parser.add_argument("--tokens-per-batch", type=int, default=RECIPE_TRAINING["tokens_per_batch"])
    parser.add_argument("--loss-on", default="all", help="training loss positions: assistant|all (TrainConfig)")
    parser.add_argument("--draft-vocab", type=int, default=RECIPE_DRAFT_VOCAB_SIZE)
    parser.add_argument("--precision", default="float32", help="hidden-state compute and training autocast")
    parser.add_argument(
        "--threads", type=int,
        help="torch threads on CPU for extraction, training and offline evaluation; default: all cores but one",
    )  # fmt: skip
    parser.add_argument("--skip-online", action="store_true")
    parser.add_argument(
        "--layer-ids", type=lambda v: [int(x) for x in v.split(",")], help="default: the verifier's (EAGLE-3's rule)"
    )
    parser.add_argument(
        "--reuse-bf16-states", action="store_true",
        help="hard-link --data's bfloat16 hidden states (extracted at --precision) instead of extracting them again",
    )  # fmt: skip
    args = parser.parse_args()
    keys = args.train_keys.split(",")
    work = args.work or args.data / "_scale_bench"
    eval_keys = [HELD_OUT_KEY, HUMANEVAL_KEY]
    rows: dict[str, dict[str, Any]] = {}

    layouts = {dtype: _layout_with_responses(args.data, work / dtype, [*keys, *eval_keys])
               for dtype in ("bfloat16", "float8_e4m3fn")}  # fmt: skip
    if args.reuse_bf16_states:
        _link_states(args.data, layouts["bfloat16"], [*keys, *eval_keys])
    sizes = {}
    for dtype, layout in layouts.items():
        sizes[dtype] = _extract(layout, [*keys, *eval_keys], args.verifier, dtype, args)
        print(f"{dtype}: {json.dumps(sizes[dtype])}", flush=True)
    bf16, fp8 = layouts["bfloat16"], layouts["float8_e4m3fn"]
    variants: dict[str, tuple[Any, dict[str, Any]]] = {
        "bf16 stored, seed 0": (bf16, {"seed": 0}),
        "bf16 stored, seed 1": (bf16, {"seed": 1}),
        "fp8 stored, seed 0": (fp8, {"seed": 0}),
    }
    if not args.skip_online:
        online = {"seed": 0, "hidden_states_source": "online", "online_backend": "hf", "online_workers": 1}
        variants["online (hf worker), seed 0"] = (bf16, online)
    for name, (layout, over) in variants.items():
        rows[name] = _train_and_measure(layout, bf16, keys, args.verifier, args, **over)
        print(f"{name}: {json.dumps(rows[name])}", flush=True)  # each draft as it is measured: a stop loses no row

    print("\n| storage | bytes/token | floor | ratio |\n|---|---|---|---|")
    for dtype, size in sizes.items():
        print(f"| {dtype} | {size['bytes_per_token']:,.0f} | {size['floor']:,} | "
              f"{size['bytes_per_token'] / size['floor']:.3f} |")  # fmt: skip
    print("\n| draft | held-out acc. len | HumanEval acc. len | train tokens/s | fetch s | wait s | train s |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['held_out']:.3f} | {r['humaneval']:.3f} | {r['tokens_per_s']:.0f} | {r['fetch_s']:.0f} "
              f"| {r['wait_s']:.0f} | {r['train_s']:.0f} |")  # fmt: skip
    spread = abs(rows["bf16 stored, seed 0"]["humaneval"] - rows["bf16 stored, seed 1"]["humaneval"])
    delta = rows["fp8 stored, seed 0"]["humaneval"] - rows["bf16 stored, seed 0"]["humaneval"]
    print(f"\nFP8 - bf16 (HumanEval, seed 0): {delta:+.3f}; bf16 seed-to-seed spread: {spread:.3f}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
