"""Every real-model stage beside its bare engine, in one run: generation, hidden-state extraction, training.

    python benchmarks/engine_ratio.py --data data-real --verifier data-real/_models/smollm2-135m-instruct \\
        [--partition 00000] [--prompts 128] [--extract-samples 120] [--train-steps 20] [--out FILE.jsonl]

It reads a data directory ``make demo-real`` filled (raw prompts, responses, hidden states, vocab mapping: ShareGPT
first turns answered by SmolLM2) and sets each stage of the project beside what a bare script would do with the
same engine (``bare_engines.py``), alternating bare, project, bare so drift on a shared machine hits both sides:

- generation: on one local vLLM serving the verifier (prefix caching off, so no run answers from another's cache),
  the first ``--prompts`` prompts of ``--partition`` at demo-real's settings (greedy, 256 tokens, 64 in flight), by
  a bare ``AsyncOpenAI`` client and by ``generate_partition`` (journal, fsyncs and Parquet included) into a fresh
  folder each time; output tokens over wall time, and the server's fullness during each;
- extraction: the ``hf`` backend's ``extract_partition`` on the first ``--extract-samples`` answers of the
  partition against transformers' forward pass over the same token sequences and batches, same precision and
  threads (the project's own extraction seconds: model load excluded on both sides);
- training: ``train_draft`` (demo-real's recipe: 2,048-token steps, lr 1e-3, ``loss_on=all``, the data's vocab
  mapping) against speculators' step loop on the same packed batches, wall seconds per step.

Prints tokens/s (or s/step) of each side and the project/bare ratio, with the targets of issue 33 (generation
>= 0.95, extraction >= 0.9, training >= 0.9); ``--out`` appends the figures as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
from bare_engines import bare_forward, bare_generation, bare_training
from eagle3_assets.operations.demo_runs import REAL_ENV

TARGETS = {"generation": 0.95, "extraction": 0.9, "training": 0.9}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="a data dir make demo-real filled")
    parser.add_argument("--verifier", type=Path, required=True)
    parser.add_argument("--partition", default="00000")
    parser.add_argument("--prompts", type=int, default=128, help="generation: the partition's first N prompts")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=int(REAL_ENV["EAGLE3_CONCURRENCY"]))
    parser.add_argument("--extract-samples", type=int, default=120)
    parser.add_argument("--train-steps", type=int, default=20)
    parser.add_argument("--stages", default="generation,extraction,training")
    parser.add_argument("--out", type=Path, default=None, help="append the figures as one JSON line")
    return parser.parse_args()


def side_by_side(bare: Any, project: Any) -> tuple[list[float], float]:
    """bare, project, bare; returns the two bare figures and the project's."""
    first = bare()
    ours = project()
    return [first, bare()], ours


def generation(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    import polars as pl

    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.generation import GenerationConfig, generate_partition, partition_prompts
    from eagle3_assets.generation.fullness import ServerFullness
    from eagle3_assets.local import accelerator
    from eagle3_assets.local.vllm_server import LocalVLLMServer

    data = DataLayout.at(args.data)
    # the prompts the demo got an answer to: a prompt past the server's context is refused (HTTP 400) on both sides
    answered = set(
        pl.read_parquet(data.responses_path(args.partition)).filter(pl.col("status") == "ok")["sample_id"].to_list()
    )
    prompts = [p for p in partition_prompts(data, args.partition) if p.sample_id in answered][: args.prompts]
    build = accelerator.vllm_build()
    server = LocalVLLMServer(
        model=args.verifier, served_model_name="verifier", max_model_len=2048, kv_cache_gib=2,
        dtype=accelerator.server_dtype(build), log_dir=scratch / "logs",
        extra_args=[
            "--max-num-seqs", str(args.concurrency), "--no-enable-prefix-caching",
            *accelerator.server_memory_args(build, 2),
        ],
    )  # fmt: skip
    fullness: list[str] = []
    runs = iter(range(10))
    with server:
        url = server.base_url
        bare_generation(url, "verifier", [p.messages for p in prompts[:8]], 8, 16)  # warm-up, not measured

        def bare() -> float:
            with ServerFullness(url, args.concurrency) as watch:
                tokens, seconds = bare_generation(
                    url, "verifier", [p.messages for p in prompts], args.concurrency, args.max_tokens
                )
            fullness.append(f"bare: {watch.report.share:.0%}" if watch.report else "bare: -")
            return tokens / seconds

        def project() -> float:
            layout = DataLayout.at(scratch / f"generation-{next(runs)}")
            config = GenerationConfig(
                base_urls=(url,), max_tokens=args.max_tokens, temperature=0.0, concurrency=args.concurrency
            )
            with ServerFullness(url, args.concurrency) as watch:
                started = time.perf_counter()
                result = generate_partition(prompts, args.partition, layout, config, log=lambda _s: None)
                seconds = time.perf_counter() - started
            assert result.ok == len(prompts), (result.ok, result.failed, result.top_errors)
            fullness.append(f"project: {watch.report.share:.0%}" if watch.report else "project: -")
            return result.new_completion_tokens / seconds

        bares, ours = side_by_side(bare, project)
    return {"unit": "output tokens/s", "bare": bares, "project": ours, "prompts": len(prompts), "fullness": fullness}


def _meta(layout: Any, key: str) -> dict[str, Any]:
    from eagle3_assets.hidden_states.state_checks import META_FILE

    return json.loads((layout.hidden_states_dir(key) / META_FILE).read_text())


def extraction(args: argparse.Namespace, scratch: Path, precision: str) -> dict[str, Any]:
    import polars as pl
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
    from eagle3_assets.hidden_states.backends import plan_batches
    from eagle3_assets.hidden_states.samples import read_ok_responses, render_rows

    data = DataLayout.at(args.data)
    meta = _meta(data, args.partition)
    source = pl.read_parquet(data.responses_path(args.partition))
    subset = source.filter(pl.col("status") == "ok").sort("sample_id").head(args.extract_samples)
    layout = DataLayout.at(scratch / "extraction")
    layout.responses_path(args.partition).parent.mkdir(parents=True, exist_ok=True)
    subset.write_parquet(layout.responses_path(args.partition))
    model = AutoModelForCausalLM.from_pretrained(
        str(args.verifier), dtype=getattr(torch, precision), attn_implementation="sdpa"
    ).eval()
    ok, _failed = read_ok_responses(layout, args.partition)
    rows, _served = render_rows(ok, args.verifier, 2048, model.config.vocab_size, args.partition)
    ids = [row.input_ids for row in rows]
    config = HiddenStatesConfig(layer_ids=list(meta["layer_ids"]), precision=precision, dtype="bfloat16")
    batches = plan_batches([len(x) for x in ids], config.batch_tokens)
    bare_forward(model, ids, batches[:2], config.num_threads)  # warm-up, not measured

    def project() -> float:
        shutil.rmtree(layout.asset_dir("hidden_states"), ignore_errors=True)  # every sample computed again
        result = extract_partition(layout, args.partition, args.verifier, config, log=lambda _s: None)
        return result.tokens_per_s

    bares, ours = side_by_side(lambda: bare_forward(model, ids, batches, config.num_threads), project)
    tokens = sum(len(x) for x in ids)
    return {"unit": "tokens/s", "bare": bares, "project": ours, "samples": len(ids), "tokens": tokens}


def training(args: argparse.Namespace, scratch: Path, precision: str) -> dict[str, Any]:
    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.operations.demo_runs import REAL_ASSET_CONFIG
    from eagle3_assets.training import TrainConfig, train_draft
    from eagle3_assets.training.vocab import read_vocab_mapping

    data = DataLayout.at(args.data)
    keys = sorted(p.stem for p in data.asset_dir("synthetic_responses").glob("*.parquet"))[:3]
    # a data dir of its own that reads the demo's hidden states and vocab mapping (symlinked folders) and trains
    # into a scratch draft_model folder
    root = scratch / "training"
    root.mkdir()
    for asset in ("hidden_states", "vocab_mapping"):
        (root / asset).symlink_to(data.asset_dir(asset).resolve())
    layout = DataLayout.at(root)
    # demo-real's recipe (threads included), one epoch of --train-steps, one validation batch (outside the steps)
    recipe = {**REAL_ASSET_CONFIG["draft_model"], "epochs": 1, "max_val_batches": 1}
    config = TrainConfig(**recipe, max_steps_per_epoch=args.train_steps, precision=precision)
    loaded = read_vocab_mapping(layout)
    mapping = (loaded.d2t, loaded.t2d) if loaded is not None else None
    dirs = [layout.hidden_states_dir(k) for k in keys[:2]]
    meta = _meta(layout, keys[0])

    def bare() -> float:
        wall, _cpu = bare_training(
            args.verifier, dirs, meta, config, args.train_steps, mapping, bf16=precision == "bfloat16"
        )
        return 1.0 / wall  # steps/s: higher is better on every row

    def project() -> float:
        shutil.rmtree(layout.draft_model_dir, ignore_errors=True)
        result = train_draft(layout, keys[:2], keys[2], args.verifier, config, log=lambda _s: None)
        return 1.0 / result.seconds_per_step

    bares, ours = side_by_side(bare, project)
    return {"unit": "steps/s", "bare": bares, "project": ours, "steps": args.train_steps}


def main() -> int:
    args = parse_args()
    from eagle3_assets.core.precision import fastest_cpu_precision

    precision = fastest_cpu_precision()  # what make demo-real computes in on this CPU
    stages = [s for s in args.stages.split(",") if s]
    commit = subprocess.run(
        ["git", "-C", str(_common.ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="eagle3-engine-ratio-") as tmp:
        scratch = Path(tmp)
        if "generation" in stages:
            figures["generation"] = generation(args, scratch)
        if "extraction" in stages:
            figures["extraction"] = extraction(args, scratch, precision)
        if "training" in stages:
            figures["training"] = training(args, scratch, precision)
    print(f"engine ratio at commit {commit}, {platform.node()}, precision {precision}, data {args.data}")
    print(f"{'stage':<12}{'bare (1st, 2nd)':>28}{'project':>14}  {'ratio':>6}  target")
    for stage, row in figures.items():
        bare_mean = sum(row["bare"]) / len(row["bare"])
        row["ratio"] = row["project"] / bare_mean
        verdict = "OK" if row["ratio"] >= TARGETS[stage] else "BELOW TARGET"
        bares = ", ".join(f"{b:,.2f}" for b in row["bare"])
        print(
            f"{stage:<12}{bares:>28}{row['project']:>14,.2f}  {row['ratio']:>6.3f}  >= {TARGETS[stage]} {verdict}"
            f"  ({row['unit']})"
        )
    if "generation" in figures:
        print(f"server fullness (mean running / concurrency): {', '.join(figures['generation']['fullness'])}")
    if args.out is not None:
        with args.out.open("a") as out:
            out.write(json.dumps({"commit": commit, "precision": precision, **figures}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
