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
