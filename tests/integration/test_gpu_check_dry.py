"""The real-model GPU check's dry path runs in `make test`, so the script cannot rot before a GPU runs it (issue 35).

``ACCEL=cpu benchmarks/gpu_check.sh --real``: the same stages as on a GPU (generation through the project's engine,
hidden states from the hf and the vllm backends, the recipe's training, offline acceptance on HumanEval) on the tiny
verifier, the fake vLLM and the fake extraction server, a few dozen samples; ~30 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STAGES = [
    "verifier",
    "vLLM start-up (plain)",
    "generate",
    "hidden states hf",
    "hidden states vllm",
    "vocab + train",
    "offline acceptance",
]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpu_check_real_dry_path(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    env = {**os.environ, "ACCEL": "cpu", "PYTHON": sys.executable, "TMPDIR": os.environ.get("TMPDIR", "/tmp")}
    done = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--real", "--json", str(report_path),
         "--data", str(tmp_path / "data")],
        capture_output=True, text=True, env=env, timeout=280, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["mode"] == "dry" and report["device"] == "cpu"
    rows = {row["stage"]: row for row in report["rows"]}
    assert list(rows) == STAGES
    for name in ("generate", "hidden states hf", "hidden states vllm", "vocab + train"):
        assert rows[name]["tokens"] > 0, name
    # both backends ran over the same responses
    assert rows["hidden states hf"]["tokens"] == rows["hidden states vllm"]["tokens"]
    assert "offline_humaneval" in report["results"]
    # one table, the CPU recipe's figures beside, and where they come from
    table = done.stdout[done.stdout.index("GPU check on the real model (dry)") :]
    assert "| stage | seconds | tokens | tokens/s | peak GPU MiB | 2-core CPU recipe: seconds |" in table
    assert "| generate |" in table and "| 2,544 | 195 |" in table
    assert "docs/measurements/learning_curve_2000x4_b91113d.jsonl" in table
    assert "online: not in the dry path" in table


def test_gpu_path_servers_get_bf16_a_share_of_the_gpu_and_cuda_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpu_check_real

    from eagle3_assets.local import accelerator, vllm_server

    configs = []

    class Recorded:
        def __init__(self, config: vllm_server.VLLMServerConfig) -> None:
            configs.append(config)

        def start(self) -> Recorded:
            return self

    monkeypatch.setattr(vllm_server, "LocalVLLMServer", Recorded)
    monkeypatch.setattr(accelerator, "vllm_build", lambda python=None: accelerator.CUDA)
    gpu_check_real.start_plain_server(Path("/models/smollm2"), Path("/tmp"), 256, eager=False)
    gpu_check_real.start_draft_server(Path("/models/smollm2"), Path("/drafts/d"), Path("/tmp"), eager=True)
    plain, draft = (c.command(Path("python")) for c in configs)
    for command in (plain, draft):
        assert command[command.index("--dtype") + 1] == "bfloat16"
        assert command[command.index("--gpu-memory-utilization") + 1] == str(accelerator.GPU_SHARE)
    assert "--enforce-eager" not in plain and "--enforce-eager" in draft  # --quick: eager start-ups
    spec = json.loads(draft[draft.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": "/drafts/d", "num_speculative_tokens": 3}
    assert "--per-request-spec-decode-metrics" in draft


def test_gpu_path_online_speed_up_is_paired_per_repeat_beside_the_mean_of_the_repeats(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import types

    import gpu_check_real

    from eagle3_assets.evaluation import online_metrics as online_module
    from eagle3_assets.evaluation.evaluation_report import PAYS, AcceptanceStats, pair_record

    class Server:
        base_url = "http://127.0.0.1:2/v1"

        def stop(self) -> None:
            pass

    rates = iter([(100.0, 120.0), (100.0, 150.0), (80.0, 80.0)])  # (plain, draft) tokens/s per repeat

    def evaluate(verifier, drafts, prompt_sets, config, log=None):
        assert config.plain_url == "http://127.0.0.1:1/v1" and config.draft_url == Server.base_url
        assert config.speed_prompts == 8 and config.k == 3
        plain, draft = next(rates)
        stats = AcceptanceStats(
            label="trained", method="online", k=3, drafts=10, draft_tokens=30, accepted_tokens=8,
            accepted_per_position=[5, 2, 1], output_tokens=int(draft * 10), seconds=10.0, prompt_set="humaneval",
            speed_pairs=[pair_record(f"s{i}", "plain", (100, 1.0), (100, plain / draft)) for i in range(8)],
        )  # fmt: skip
        speed = types.SimpleNamespace(output_tokens=int(plain * 10), seconds=10.0)  # the batch-1 run, plain
        return types.SimpleNamespace(
            stats=[stats], baseline={"humaneval": types.SimpleNamespace(speed=speed)},
            mismatches={"humaneval": {"trained": []}},
        )  # fmt: skip

    monkeypatch.setattr(online_module, "evaluate_online", evaluate)
    monkeypatch.setattr(gpu_check_real, "start_draft_server", lambda *a, **k: Server())
    args = types.SimpleNamespace(data=tmp_path, humaneval=164, speed_prompts=8, repeats=3, quick=False)
    report = gpu_check_real.Report(mode="full", device="H100")
    row = gpu_check_real.Row("online", 0.0)
    gpu_check_real.online(args, Path("/v"), Path("/d"), "http://127.0.0.1:1/v1", report, row)
    mean, low, high = report.results["speed_up"]
    assert (round(mean, 3), low, high) == (round((1.2 + 1.5 + 1.0) / 3, 3), 1.0, 1.5)
    assert report.results["online_humaneval"] == pytest.approx(1 + 8 / 10)
    row.seconds = 30.0
    text = gpu_check_real.table(report)
    assert "| batch-1 speed-up (mean; lowest..highest of the repeats) | 1.23 (1.00..1.50)" in text
    # each repeat's paired batch: 8 prompts of the same ratio, so the interval is that ratio and the verdict follows
    assert [round(m, 3) for m, _low, _high in report.results["speed_up_paired"]] == [1.2, 1.5, 1.0]
    assert report.results["speed_up_verdicts"] == [PAYS, PAYS, "inconclusive"]
    assert "repeat 2 (median [95% interval], verdict) | 1.50 [1.50, 1.50], pays | - |" in text
