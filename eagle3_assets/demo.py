"""``eagle3 demo``: the whole pipeline end to end on the shipped sample and the embedded tiny model.

Builds the tiny verifier, starts the local CPU vLLM on it, materializes every asset of the definitions
(every partition of the partitioned ones) into the Dagster instance at DAGSTER_HOME, so ``make dev``
shows the runs afterwards, prints the DuckDB counts and a timing table, and stops the server.
Paths come from EAGLE3_DATA_DIR (data, the tiny model, server logs) and DAGSTER_HOME.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path

from eagle3_assets import settings

# Sized so the demo ends in minutes on 2 cores: the tiny model answers in ~90 tokens on average, greedy
# so the trained draft is measured on the outputs it was trained to predict.
DEMO_ENV = {
    "EAGLE3_MAX_TOKENS": "384",
    "EAGLE3_CONCURRENCY": "64",
    "EAGLE3_TEMPERATURE": "0",
    "EAGLE3_REQUEST_TIMEOUT_S": "600",
    # The tiny verifier has 4 layers: EAGLE-3's default [2, N//2, N-3] would repeat layer 2.
    "EAGLE3_LAYER_IDS": "1,2,3",
}

# Per-asset run config for the demo: training sized to a few CPU minutes (see docs/local_vllm.md for what
# a longer run buys on the tiny verifier).
DEMO_ASSET_CONFIG: dict[str, dict[str, object]] = {
    # the ~2k most frequent of the tiny verifier's 4k tokens cover 97% of its answers, at half the LM-head cost
    "vocab_mapping": {"draft_vocab_size": 2048},
    "draft_model": {
        "epochs": 2,
        "max_steps_per_epoch": 80,
        "tokens_per_batch": 1024,
        "lr": 3e-3,
        "max_val_batches": 16,
        # nothing else runs while the draft trains: use both cores
        "num_threads": 2,
    },
    # Two vLLM start-ups (trained and untrained draft) dominate; keep the generation short. The plain verifier
    # is the demo's own server (plain_url, set at run time).
    "draft_evaluation": {"prompts": 16, "max_tokens": 96, "offline_max_samples": 64},
}


def demo_asset_config(name: str, base_url: str, served_model_name: str) -> dict[str, object] | None:
    config = DEMO_ASSET_CONFIG.get(name)
    if name == "draft_evaluation" and config is not None:
        config = {**config, "plain_url": base_url, "served_model_name": served_model_name}
    return config


def _print_table(rows: list[tuple[str, str, float]]) -> None:
    width = max(len(name) for name, _, _ in rows)
    print(f"\n{'stage'.ljust(width)}  {'partitions':>10}  {'seconds':>8}")
    for name, partitions, seconds in rows:
        print(f"{name.ljust(width)}  {partitions:>10}  {seconds:8.1f}")
    print(f"{'total'.ljust(width)}  {'':>10}  {sum(s for _, _, s in rows):8.1f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3 demo", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=int(os.environ.get("EAGLE3_DEMO_PORT", "8000")))
    parser.add_argument("--keep-server", action="store_true", help="leave the vLLM server running")
    args = parser.parse_args(list(argv or []))

    import dagster as dg

    from eagle3_assets.defs.resources import env_value
    from eagle3_assets.local.tiny_model import build_tiny_model
    from eagle3_assets.local.vllm_server import LocalVLLMServer

    for key, value in DEMO_ENV.items():
        os.environ.setdefault(key, value)
    data_dir = Path(env_value("EAGLE3_DATA_DIR")).resolve()
    verifier = Path(env_value("EAGLE3_VERIFIER_PATH") or data_dir / "_models" / "tiny-verifier")
    os.environ["EAGLE3_VERIFIER_PATH"] = str(verifier)
    os.environ.setdefault("EAGLE3_VLLM_BASE_URL", f"http://127.0.0.1:{args.port}/v1")
    if "DAGSTER_HOME" not in os.environ:
        raise settings.ConfigError("DAGSTER_HOME='': set it (the Makefile uses ./dagster_home)")

    timings: list[tuple[str, str, float]] = []
    started = time.monotonic()
    if not (verifier / "config.json").exists():
        build_tiny_model(verifier, seed=0)
    timings.append(("tiny verifier", "-", time.monotonic() - started))
    print(f"verifier: {verifier}")

    started = time.monotonic()
    server = LocalVLLMServer(
        model=verifier, port=args.port, log_dir=data_dir / "_logs", reuse_existing=True, served_model_name="tiny"
    )
    server.start()
    timings.append(("vLLM start-up", "-", time.monotonic() - started))
    print(f"vLLM serving {server.model_name} at {server.base_url} (log: {server.log_path})")

    from eagle3_assets.definitions import build_definitions
    from eagle3_assets.defs.partitions import PROMPT_PARTITIONS

    try:
        defs = build_definitions()
        graph = defs.resolve_asset_graph()
        assets = list(defs.assets or [])
        instance = dg.DagsterInstance.get()
        for key in graph.toposorted_asset_keys:
            node = graph.get(key)
            name = key.to_user_string()
            started = time.monotonic()
            asset_config = demo_asset_config(name, server.base_url, server.model_name)
            run_config = {"ops": {name: {"config": asset_config}}} if asset_config is not None else None
            if node.partitions_def is None:
                result = dg.materialize(
                    assets, selection=[key], instance=instance, resources=defs.resources, run_config=run_config
                )
                partitions = "-"
                ok = result.success
            else:
                keys = instance.get_dynamic_partitions(PROMPT_PARTITIONS.name)
                ok = True
                for partition_key in keys:
                    print(f"materializing {name} partition {partition_key}")
                    result = dg.materialize(
                        assets,
                        selection=[key],
                        partition_key=partition_key,
                        instance=instance,
                        resources=defs.resources,
                        raise_on_error=False,
                    )
                    ok = ok and result.success
                partitions = str(len(keys))
            timings.append((name, partitions, time.monotonic() - started))
            print(f"{name}: {'ok' if ok else 'FAILED'} in {timings[-1][2]:.1f} s")
            if not ok:
                raise SystemExit(f"{name} failed; see the run in the UI (make dev) and fix, then re-run make demo")
    finally:
        if not args.keep_server:
            server.stop()

    print(f"\nrows per partition (DuckDB over {data_dir}):")
    from eagle3_assets.cli import main as cli_main

    cli_main(["counts", "--data-dir", str(data_dir)])
    evaluation = data_dir / "draft_evaluation" / "report.md"
    if evaluation.exists():
        print("\n" + evaluation.read_text())
    _print_table(timings)
    print(f"\nOpen the UI on this data: make dev  (http://127.0.0.1:3000, DAGSTER_HOME={os.environ['DAGSTER_HOME']})")
    return 0
