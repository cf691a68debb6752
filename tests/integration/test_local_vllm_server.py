"""Process management of `LocalVLLMServer` and its CLI, against a stand-in `vllm` package (seconds, no vLLM).

The stand-in is a `vllm.entrypoints.openai.api_server` module put on PYTHONPATH: it parses the same flags and
answers GET /v1/models, so start-up, health checks, failure reporting, reuse and the SIGINT -> SIGTERM -> SIGKILL
stop path all run for real. The real server is covered by tests/e2e/test_vllm_local.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3_assets.local import vllm_cli
from eagle3_assets.local import vllm_server as vs
from eagle3_assets.net.ports import find_free_port, port_in_use
from support.stand_in_vllm import group_gone, stand_in_config


def test_context_manager_starts_healthy_and_stops_gracefully(
    tmp_path: Path, model_dir: Path, fake_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    # Relative interpreter and draft paths are taken relative to the caller's cwd, not the server's (the log dir).
    relative_python = Path(os.path.relpath(sys.executable))
    # an explicit parser is passed as given (`auto` would find no tokenizer in this empty folder: no parser)
    config = stand_in_config(
        tmp_path,
        model_dir,
        fake_env,
        python=relative_python,
        speculative_config={"method": "eagle3", "model": "draft"},
        reasoning_parser="deepseek_r1",
    )
    # A process started from a background shell job inherits SIGINT *ignored*: the shim must restore it, or the
    # graceful stop would silently fall through to SIGTERM.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        server = vs.LocalVLLMServer(config).start()
    finally:
        signal.signal(signal.SIGINT, previous)
    with server:
        assert server.healthy()
        assert vs.list_models(server.base_url) == ["tiny"]
        pid = server.process.pid
        assert os.getpgid(pid) == pid  # own process group
        assert server.startup_s is not None and server.startup_s < 30
    assert group_gone(pid)
    log = (tmp_path / "logs" / f"vllm-{config.port}.log").read_text()
    assert "graceful shutdown" in log  # stopped by SIGINT, not killed
    argv = json.loads(log.split("fake vllm argv ", 1)[1].split(" cwd ", 1)[0])
    assert argv[argv.index("--model") + 1] == str(model_dir.resolve())
    for flag in ("--enforce-eager", "--reasoning-parser", "--dtype", "--max-model-len", "--speculative-config"):
        assert flag in argv
    assert json.loads(argv[argv.index("--speculative-config") + 1])["model"] == str(cwd / "draft")
    assert "env 1 1" in log
    assert "sigint handler <built-in function default_int_handler>" in log
    assert list(cwd.iterdir()) == []  # nothing written to the caller's cwd


def test_crash_during_startup_fails_fast_with_log_tail(
    tmp_path: Path, model_dir: Path, fake_env: dict[str, str]
) -> None:
    server = vs.LocalVLLMServer(stand_in_config(tmp_path, model_dir, {**fake_env, "FAKE_VLLM_MODE": "crash"}))
    started = time.monotonic()
    with pytest.raises(vs.VLLMServerError, match="exited with code 3") as info:
        server.start()
    assert "fake engine failed to start" in str(info.value)
    assert time.monotonic() - started < 20


def test_startup_timeout_kills_the_server(tmp_path: Path, model_dir: Path, fake_env: dict[str, str]) -> None:
    config = stand_in_config(tmp_path, model_dir, {**fake_env, "FAKE_VLLM_MODE": "hang"}, startup_timeout_s=3.0)
    server = vs.LocalVLLMServer(config)
    with pytest.raises(vs.VLLMServerError, match="did not answer"):
        server.start()
    assert server.process is None


def _signal_state(pid: int) -> dict[str, str]:
    """Blocked / ignored / caught signal masks of a live process (for failure messages)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError as error:
        return {"error": str(error)}
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines) if k in ("SigBlk", "SigIgn", "SigCgt")}


def test_stop_escalates_when_sigint_is_ignored(tmp_path: Path, model_dir: Path, fake_env: dict[str, str]) -> None:
    server = vs.LocalVLLMServer(stand_in_config(tmp_path, model_dir, {**fake_env, "FAKE_VLLM_MODE": "ignore-sigint"}))
    server.start()
    pid = server.process.pid
    signals = _signal_state(pid)
    started = time.monotonic()
    code = server.stop(grace_s=1.0)
    assert code == -signal.SIGTERM, f"server's signal state before the stop: {signals}"
    assert group_gone(pid) and time.monotonic() - started < 15


def test_port_in_use_and_reuse(tmp_path: Path, model_dir: Path, fake_env: dict[str, str]) -> None:
    config = stand_in_config(tmp_path, model_dir, fake_env)
    with vs.LocalVLLMServer(config) as first:
        with pytest.raises(vs.VLLMServerError, match="already used by a vLLM server"):
            vs.LocalVLLMServer(config).start()
        reused = vs.LocalVLLMServer(
            stand_in_config(tmp_path, model_dir, fake_env, port=config.port, reuse_existing=True)
        )
        with reused:
            assert reused.reused
        assert first.healthy()  # leaving the reusing context does not stop someone else's server
        other = stand_in_config(
            tmp_path, model_dir, fake_env, port=config.port, reuse_existing=True, served_model_name="x"
        )
        with pytest.raises(vs.VLLMServerError, match="not 'x'"):
            vs.LocalVLLMServer(other).start()


def test_a_server_that_refuses_the_key_fails_at_once_without_showing_it(
    tmp_path: Path,
    model_dir: Path,
    fake_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The health check sends the server's VLLM_API_KEY (from extra_env over the caller's environment; --api-key in
    extra_args is refused); a 401 fails start() at once with "the server requires an API key", never with the key
    and not after the start-up timeout; the same for reusing a server on the port and for the status command."""
    sent, required = "sk-sent-0123456789", "sk-required-0123456789"
    monkeypatch.setenv("VLLM_API_KEY", sent)
    enforcing = {**fake_env, "FAKE_VLLM_REQUIRED_KEY": required}
    server = vs.LocalVLLMServer(stand_in_config(tmp_path, model_dir, enforcing, startup_timeout_s=60.0))
    started = time.monotonic()
    with pytest.raises(vs.VLLMServerError, match="the server requires an API key") as info:
        server.start()
    assert time.monotonic() - started < 20 and server.process is None
    assert "refused the key" in str(info.value) and sent not in str(info.value) and required not in str(info.value)

    config = stand_in_config(tmp_path, model_dir, {**enforcing, "VLLM_API_KEY": required})
    assert config.api_key() == required
    for extra in (["--api-key", "k1"], ["--api-key=k2"]):  # never on a command line: refused, value not repeated
        with pytest.raises(vs.VLLMServerError, match="--api-key is refused") as refused:
            stand_in_config(tmp_path, model_dir, enforcing, extra_args=extra)
        assert "k1" not in str(refused.value) and "k2" not in str(refused.value)
    with vs.LocalVLLMServer(config) as running:
        assert running.healthy()
        assert vs.list_models(running.base_url) is None
        assert vs.list_models(running.base_url, api_key=required) == ["tiny"]
        reuse = stand_in_config(tmp_path, model_dir, fake_env, port=config.port, reuse_existing=True)  # sends `sent`
        with pytest.raises(vs.VLLMServerError, match=r"cannot reuse .* requires an API key") as info:
            vs.LocalVLLMServer(reuse).start()
        assert sent not in str(info.value)
        with pytest.raises(vs.VLLMServerError, match="already used by a server that answers 401"):
            vs.LocalVLLMServer(stand_in_config(tmp_path, model_dir, fake_env, port=config.port)).start()
        assert vllm_cli.main(["status", "--port", str(config.port)]) == 1
        assert "the server requires an API key" in capsys.readouterr().out
        monkeypatch.setenv("VLLM_API_KEY", required)
        assert vllm_cli.main(["status", "--port", str(config.port)]) == 0
    log = (tmp_path / "logs" / f"vllm-{config.port}.log").read_text()
    assert sent not in log and required not in log


def test_missing_interpreter_and_model(tmp_path: Path, model_dir: Path, fake_env: dict[str, str]) -> None:
    with pytest.raises(vs.VLLMNotInstalledError, match="make install-vllm"):
        vs.LocalVLLMServer(stand_in_config(tmp_path, model_dir, fake_env, python=tmp_path / "nope" / "python")).start()
    with pytest.raises(vs.VLLMServerError, match="does not exist"):
        vs.LocalVLLMServer(stand_in_config(tmp_path, tmp_path / "no-model", fake_env)).start()


def _cli_env(fake_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(fake_env)
    env[vs.ENV_PYTHON] = sys.executable
    env[vs.ENV_LOG_DIR] = str(tmp_path / "cli-logs")
    return env


def test_cli_start_status_stop(tmp_path: Path, model_dir: Path, fake_env: dict[str, str]) -> None:
    env = _cli_env(fake_env, tmp_path)
    port = str(find_free_port())
    base = [sys.executable, "-m", "eagle3_assets.local.vllm_cli"]
    start = subprocess.run(
        [*base, "start", "--model", str(model_dir), "--port", port, "--served-model-name", "tiny"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert start.returncode == 0, start.stderr
    pid_file = tmp_path / "cli-logs" / f"vllm-{port}.pid"
    pid = json.loads(pid_file.read_text())["pid"]
    assert subprocess.run([*base, "status", "--port", port], env=env, timeout=30).returncode == 0
    stop = subprocess.run([*base, "stop", "--port", port], env=env, capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0, stop.stderr
    assert not pid_file.exists()
    assert group_gone(pid)
    assert subprocess.run([*base, "status", "--port", port], env=env, timeout=30).returncode == 1
    again = subprocess.run([*base, "stop", "--port", port], env=env, capture_output=True, text=True, timeout=30)
    assert again.returncode == 0 and "nothing to stop" in again.stdout


SERVE = [sys.executable, "-m", "eagle3_assets.local.vllm_cli", "serve"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_serve_stops_the_server_on_signal(
    tmp_path: Path, model_dir: Path, fake_env: dict[str, str], sig: signal.Signals
) -> None:
    env = _cli_env(fake_env, tmp_path)
    port = find_free_port()
    proc = subprocess.Popen(
        [*SERVE, "--model", str(model_dir), "--port", str(port), "--served-model-name", "tiny"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "ready at" in line:
            break
    else:
        pytest.fail(f"serve exited early with {proc.wait()}")
    assert vs.list_models(f"http://127.0.0.1:{port}/v1") == ["tiny"]
    signals = _signal_state(proc.pid)
    proc.send_signal(sig)  # what Ctrl-C (SIGINT) or a supervisor (SIGTERM) does
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"serve ignored {sig.name} for 60 s; signal state before: {signals}, now: {_signal_state(proc.pid)}"
        )
    assert code == 0
    assert not port_in_use("127.0.0.1", port)
