"""Issue 14, processes and secrets: the embedded vLLM dies with its parent, only a server this project started for
the same model is reused, a key never travels on a command line or survives a cut, the launchpad cannot pick the
variable the key is read from. Against the stand-in vLLM of tests/support/stand_in_vllm.py (seconds, no vLLM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eagle3_assets.generation import GenerationConfig
from eagle3_assets.local import vllm_server as vs
from eagle3_assets.net.ports import find_free_port
from support.common import child_env
from support.stand_in_vllm import group_gone, stand_in_config

SERVE_ARGS = ("--served-model-name", "tiny", "--host", "127.0.0.1", "--port")


def test_the_server_dies_when_its_parent_is_killed(tmp_path: Path, model_dir: Path, fake_env: dict[str, str]) -> None:
    config = stand_in_config(tmp_path, model_dir, fake_env)
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            from pathlib import Path
            from eagle3_assets.local import vllm_server as vs
            server = vs.LocalVLLMServer(vs.VLLMServerConfig(
                model=Path({str(model_dir)!r}), served_model_name="tiny", port={config.port},
                python=Path(sys.executable), extra_env={fake_env!r}, log_dir=Path({str(tmp_path / "logs")!r}),
                startup_timeout_s=30.0))
            server.start()
            print(server.process.pid, flush=True)
            time.sleep(3600)
            """
        )
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=child_env())
    assert parent.stdout is not None
    server_pid = int(parent.stdout.readline())
    try:
        assert not group_gone(server_pid)
        parent.send_signal(signal.SIGKILL)  # no cleanup code of the parent runs
        parent.wait(10)
        deadline = time.monotonic() + 20
        while not group_gone(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert group_gone(server_pid), "the server outlived its parent"
    finally:
        if not group_gone(server_pid):
            vs.stop_process_group(server_pid, grace_s=1.0)
        parent.stdout.close()


def test_only_a_server_this_project_started_for_the_same_model_is_reused(
    tmp_path: Path, model_dir: Path, fake_env: dict[str, str]
) -> None:
    port = find_free_port()
    stranger = subprocess.Popen(  # a server on the port that serves the right name but was not started by eagle3
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), *SERVE_ARGS, str(port)],
        env={**os.environ, **fake_env},
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        while vs.list_models(f"http://127.0.0.1:{port}/v1") is None and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(vs.VLLMServerError, match=r"cannot reuse .* not started by eagle3"):
            vs.LocalVLLMServer(stand_in_config(tmp_path, model_dir, fake_env, port=port, reuse_existing=True)).start()
    finally:
        vs.stop_process_group(stranger.pid, grace_s=1.0, process=stranger)

    other_model = tmp_path / "other-model"
    other_model.mkdir()
    config = stand_in_config(tmp_path, model_dir, fake_env)
    with vs.LocalVLLMServer(config):
        # same served name, another model folder: not the same model
        same_name = stand_in_config(tmp_path, other_model, fake_env, port=config.port, reuse_existing=True)
        with pytest.raises(vs.VLLMServerError, match="serves the model folder"):
            vs.LocalVLLMServer(same_name).start()
        reused = vs.LocalVLLMServer(
            stand_in_config(tmp_path, model_dir, fake_env, port=config.port, reuse_existing=True)
        )
        assert reused.start().reused


def test_an_api_key_in_extra_args_is_refused_before_anything_starts(tmp_path: Path, model_dir: Path) -> None:
    for extra in (["--api-key", "sk-secret-123456"], ["--api-key=sk-secret-123456"]):
        with pytest.raises(vs.VLLMServerError, match="--api-key is refused") as refused:
            stand_in_config(tmp_path, model_dir, {}, extra_args=extra)
        assert "sk-secret" not in str(refused.value)


def test_a_key_cut_off_by_truncation_is_still_redacted() -> None:
    key = "sk-live-0123456789abcdef0123456789"
    config = GenerationConfig(base_urls=["http://127.0.0.1:9/v1"], api_key=key)
    error = ("401 Unauthorized: bad bearer " + key)[:40]  # an error text cut in the middle of the key
    redacted = config.redact(error)
    assert key[:12] not in redacted and redacted.endswith("***")
    assert config.redact(f"x {key} y") == "x *** y"
    assert config.redact("sk-live is a prefix too short to be the key") == "sk-live is a prefix too short to be the key"


def test_the_launchpad_cannot_choose_the_variable_the_key_comes_from(monkeypatch: pytest.MonkeyPatch) -> None:
    from eagle3_assets.defs.inference import InferenceServerResource, LocalVLLMResource, RemoteVLLMResource

    for resource in (InferenceServerResource, RemoteVLLMResource, LocalVLLMResource):
        assert "api_key_env" not in resource.model_fields
    launchpad_fields = RemoteVLLMResource.to_config_schema().as_field().config_type.fields  # what the UI may set
    assert "api_key_env" not in launchpad_fields and "model" in launchpad_fields
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-for-the-server")
    monkeypatch.setenv("EAGLE3_API_KEY", "the-server-key")
    assert RemoteVLLMResource().api_key() == "the-server-key"
