"""The ``vllm`` hidden-states backend against the real CPU vLLM (extraction mode) on the tiny verifier.

Tolerance: both backends compute in float32 here (the hf backend on a CPU, the embedded vLLM with ``--dtype
float32``) and the comparison stores float32, so the only differences are the kernels' summation orders:
measured max |vllm - hf| / max |hf| over 200 samples 4e-7 (benchmarks/hidden_states_backends.py); the test
allows 1e-4 of each sample's scale.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.hidden_states import HiddenStatesConfig, check_finite, check_token_ids, extract_partition
from eagle3_assets.hidden_states.vllm_backend import VLLMBackendOptions

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

KEY = "00000"
LAYERS = [1, 2, 3]
RELATIVE_TOLERANCE = 1e-4


def test_vllm_backend_matches_hf_sample_by_sample(tmp_path: Path, vllm_tiny_verifier: Path) -> None:
    """One partition through the embedded extraction server (no URL) equals the hf backend's, and the
    connector's files are gone afterwards."""
    import torch
    from safetensors.torch import load_file

    from support.hidden_states_data import fabricate_responses

    layouts = {}
    for backend in ("hf", "vllm"):
        layout = DataLayout.at(tmp_path / backend)
        fabricate_responses(layout, KEY, 16, failed_every=8, min_words=20, max_words=60)
        layouts[backend] = layout
    transfer = tmp_path / "transfer"
    hf = extract_partition(
        layouts["hf"],
        KEY,
        vllm_tiny_verifier,
        HiddenStatesConfig(layer_ids=LAYERS, dtype="float32", precision="float32"),
    )
    vllm_config = HiddenStatesConfig(
        layer_ids=LAYERS, dtype="float32", backend="vllm", vllm=VLLMBackendOptions(storage_path=str(transfer))
    )
    vllm = extract_partition(layouts["vllm"], KEY, vllm_tiny_verifier, vllm_config)
    assert vllm.samples == hf.samples == 14 and vllm.stored == 14
    assert list(transfer.iterdir()) == []  # every connector file (and its .lock) deleted after reading
    for row in range(hf.samples):
        ours = load_file(hf.data_dir / "hidden_states" / f"hs_{row}.safetensors")
        theirs = load_file(vllm.data_dir / "hidden_states" / f"hs_{row}.safetensors")
        assert torch.equal(ours["token_ids"], theirs["token_ids"]), row
        scale = ours["hidden_states"].abs().max()
        error = (theirs["hidden_states"] - ours["hidden_states"]).abs().max()
        assert error <= RELATIVE_TOLERANCE * scale, (row, float(error), float(scale))
    assert check_token_ids(layouts["vllm"], KEY).passed and check_finite(layouts["vllm"], KEY).passed


def _vllm_pids(port: int) -> list[int]:
    """Live processes of a vLLM server started on ``port`` (its API server; the engine core is its child)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if (
            state != "Z"
            and b"--port" in cmdline
            and str(port).encode() in cmdline
            and b"--speculative-config" in cmdline
        ):
            found.append(int(entry.name))
    return found


def test_a_killed_run_takes_its_embedded_server_down_and_the_next_run_resumes(
    tmp_path: Path, vllm_tiny_verifier: Path
) -> None:
    """SIGKILL the process extracting with the embedded server (no URL) once the server is up: the kernel stops the
    server (no vLLM left running), and the next run (hf here) completes the partition and sweeps the connector
    folder the killed run left in the partition."""
    import re
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    from support.common import child_env
    from support.hidden_states_data import fabricate_responses

    layout = DataLayout.at(tmp_path / "data")
    fabricate_responses(layout, KEY, 12, min_words=20, max_words=60)
    logs = tmp_path / "logs"
    script = textwrap.dedent(
        f"""
        import sys
        from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
        from eagle3_assets.core.storage import DataLayout
        extract_partition(DataLayout.at({str(layout.root)!r}), {KEY!r}, {str(vllm_tiny_verifier)!r},
                          HiddenStatesConfig(layer_ids={LAYERS!r}, backend="vllm"), log=lambda m: print(m, flush=True))
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        env=child_env(EAGLE3_VLLM_LOG_DIR=str(logs)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    port = None
    try:
        assert child.stdout is not None
        for line in child.stdout:
            match = re.search(r"extraction server ready at http://127\.0\.0\.1:(\d+)/v1", line)
            if match:
                port = int(match.group(1))
                break
        assert port is not None, "the embedded server never became ready"
        assert _vllm_pids(port), "no server process found"
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and _vllm_pids(port):
        time.sleep(0.5)
    assert not _vllm_pids(port), "the embedded vLLM server outlived the killed run"

    result = extract_partition(layout, KEY, vllm_tiny_verifier, HiddenStatesConfig(layer_ids=LAYERS))
    assert result.samples == 12 and check_token_ids(layout, KEY).passed
    assert not (result.data_dir / ".vllm-transfer").exists()
