"""GPU check: bf16 hf extraction, vllm extraction (when a CUDA vLLM is installed) and 2-process training, one table.

    benchmarks/gpu_check.sh            (sets up the interpreter and runs this)
    .venv/bin/python benchmarks/gpu_check.py [--samples 400] [--hidden-size 256] [--layers 8]

Everything runs on the tiny verifier (built locally, no download) under a temporary folder, on a CUDA machine:

* ``hf bf16``: the hf backend with ``EAGLE3_DEVICE=auto`` (bf16, ``device_map="auto"`` over the visible GPUs),
  bfloat16 storage; peak memory is ``torch.cuda.max_memory_allocated`` of this process;
* ``vllm``: the vllm backend against a CUDA vLLM extraction server started here from ``$EAGLE3_VLLM_PYTHON``
  (skipped, with the reason, when that interpreter has no vLLM or sees no GPU); peak memory from ``nvidia-smi``
  (the server's process);
* ``train 2 ranks``: ``draft_model``'s torchrun launcher, 2 ranks on the visible GPUs (NCCL when each rank has a
  GPU of its own, else gloo), 2 epochs; peak memory from ``nvidia-smi`` sampled during the run.

Columns: tokens/s (extraction: tokens through the verifier per second, start-up excluded; training: trained tokens
per second of training steps), seconds, peak GPU memory (MiB).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import _common

LAYERS = [1, 2, 3]


def _partition(root: Path, samples: int) -> object:
    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.prompts.sample_data import fabricate_responses

    layout = DataLayout.at(root)
    for key in ("00000", "00001", "00002"):
        fabricate_responses(layout, key, samples, min_words=60, max_words=200)
    return layout


def check_hf(verifier: Path, root: Path, samples: int) -> tuple[str, float, float, float]:
    import torch

    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition

    layout = _partition(root, samples)
    torch.cuda.reset_peak_memory_stats()
    config = HiddenStatesConfig(layer_ids=LAYERS, dtype="bfloat16", device="auto")
    results = [
        extract_partition(layout, key, verifier, config, log=lambda _m: None) for key in ("00000", "00001", "00002")
    ]
    tokens = sum(r.tokens_computed for r in results)
    seconds = sum(r.extract_seconds for r in results)
    peak = sum(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())) / 2**20
    return "hf bf16", tokens / seconds, seconds, peak


def check_vllm(verifier: Path, root: Path, samples: int) -> tuple[str, float, float, float] | str:
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
    from eagle3_assets.hidden_states.vllm_backend import VLLMBackendOptions
    from eagle3_assets.local.extraction_server import start_extraction_server
    from eagle3_assets.local.vllm_server import default_vllm_python

    python = default_vllm_python()
    if not python.exists():  # seen on a GPU machine without the vLLM venv: Popen raised instead of skipping
        return f"vllm: skipped, no interpreter at {python} (set EAGLE3_VLLM_PYTHON)"
    probe = subprocess.run(
        [str(python), "-c", "import torch, vllm; assert torch.cuda.is_available(), 'no GPU visible'"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if probe.returncode != 0:
        return f"vllm: skipped, no CUDA vLLM at {python} ({probe.stderr.strip().splitlines()[-1:]})"
    layout = _partition(root, samples)
    storage = root / "transfer"
    with _common.GpuMemory() as memory:
        server = start_extraction_server(verifier, LAYERS, storage, dtype="bfloat16", max_model_len=2049)
        try:
            options = VLLMBackendOptions(urls=(server.base_url,), storage_path=str(storage), concurrency=64)
            config = HiddenStatesConfig(layer_ids=LAYERS, dtype="bfloat16", backend="vllm", vllm=options)
            keys = ("00000", "00001", "00002")
            results = [extract_partition(layout, key, verifier, config, log=lambda _m: None) for key in keys]
        finally:
            server.stop()
    tokens = sum(r.tokens_computed for r in results)
    seconds = sum(r.extract_seconds for r in results)
    return "vllm bf16", tokens / seconds, seconds, float(memory.peak or 0.0)


def check_training(verifier: Path, root: Path, samples: int) -> tuple[str, float, float, float]:
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
    from eagle3_assets.training import TrainConfig, build_vocab_mapping
    from eagle3_assets.training.launch import TrainSpec, run_training_processes

    layout = _partition(root, samples)
    keys = ["00000", "00001", "00002"]
    for key in keys:
        extract_partition(layout, key, verifier, HiddenStatesConfig(layer_ids=LAYERS), log=lambda _m: None)
    build_vocab_mapping(layout, keys[:2], draft_vocab_size=512, target_vocab_size=4096)
    config = TrainConfig(epochs=2, tokens_per_batch=8192, device="cuda")
    spec = TrainSpec(str(layout.root), keys[:2], keys[2], str(verifier), asdict(config), str(root / "result.json"))
    with _common.GpuMemory() as memory:
        result = run_training_processes(spec, 2, root)
    seconds = result.seconds_per_step * result.steps
    return f"train {result.ranks} ranks", result.tokens_trained / seconds, seconds, float(memory.peak or 0.0)


def main() -> int:
    parser = _common.tiny_model_parser(__doc__, samples=400, layers=8)  # 3 partitions
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device visible: this check needs a GPU machine", file=sys.stderr)
        return 2

    verifier = _common.tiny_model(args)
    rows, notes = [], []
    with tempfile.TemporaryDirectory(prefix="eagle3-gpu-check-") as tmp:
        for name, check in (("hf", check_hf), ("vllm", check_vllm), ("train", check_training)):
            outcome = check(verifier, Path(tmp) / name, args.samples)
            (notes if isinstance(outcome, str) else rows).append(outcome)
    gpus = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    print(f"GPUs: {gpus}; tiny verifier {args.layers} layers, hidden {args.hidden_size}; {args.samples} samples x 3")
    print("| check | tokens/s | seconds | peak GPU MiB |\n|---|---|---|---|")
    for name, rate, seconds, peak in rows:
        print(f"| {name} | {rate:,.0f} | {seconds:.1f} | {peak:,.0f} |")
    for note in notes:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
