"""Issue 31, clause 12 ("shared hosts"), against the stand-in vLLM of tests/support/stand_in_vllm.py (seconds):

- server logs, pid files and reuse markers live in a per-user folder (``$TMPDIR/eagle3-vllm-UID``, 0700), not in a
  folder every user shares (``/tmp/eagle3-vllm``);
- a symbolic link planted where a log, a pid file, the log folder or the marker folder goes is refused, naming it,
  and nothing is written through it; a log folder another user owns is refused too;
- a running server is reused only when its process and its listening socket belong to the current user (the uid
  lookups are stubbed: the tests run as root, which owns every process they could start).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from eagle3_assets.core import process_guard
from eagle3_assets.local import vllm_cli
from eagle3_assets.local import vllm_server as vs
from eagle3_assets.net.ports import find_free_port
from support.stand_in_vllm import group_gone, stand_in_config

VICTIM_TEXT = "precious: must not be truncated or overwritten\n"
OTHER_UID = 65534  # nobody


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp dir of this test standing in for the shared /tmp (where the per-user folders are made)."""
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    monkeypatch.delenv(vs.ENV_LOG_DIR, raising=False)
    return shared


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim" / "precious.txt"
    victim.parent.mkdir(parents=True, exist_ok=True)
    victim.write_text(VICTIM_TEXT)
    return victim


def test_logs_and_markers_live_in_a_private_per_user_folder(
    private_tmp: Path, tmp_path: Path, model_dir: Path, fake_env: dict[str, str]
) -> None:
    config = stand_in_config(tmp_path, model_dir, fake_env, log_dir=None)
    with vs.LocalVLLMServer(config) as server:
        assert server.log_path is not None
        folder = private_tmp / f"eagle3-vllm-{os.getuid()}"
        assert server.log_path.parent == folder  # before: /tmp/eagle3-vllm, shared by every user
        assert process_guard.marker_path(config.host, config.port).is_file()
        for path in (folder, folder / "servers"):
            info = path.lstat()
            assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
        assert stat.S_IMODE(server.log_path.stat().st_mode) == 0o600


def test_a_symlink_planted_where_the_log_goes_is_refused_and_nothing_is_written_through_it(
    tmp_path: Path, model_dir: Path, fake_env: dict[str, str]
) -> None:
    config = stand_in_config(tmp_path, model_dir, fake_env)
    victim = _victim(tmp_path)
    assert config.log_dir is not None
    config.log_dir.mkdir()
    planted = config.log_dir / f"vllm-{config.port}.log"
    planted.symlink_to(victim)
    server = vs.LocalVLLMServer(config)
    with pytest.raises(vs.VLLMServerError, match="symbolic link") as refused:
        server.start()  # before: the log was opened through the link, truncating the victim
    assert str(planted) in str(refused.value)
    assert victim.read_text() == VICTIM_TEXT and server.process is None


def test_a_symlink_planted_as_the_log_folder_is_refused(
    private_tmp: Path, tmp_path: Path, model_dir: Path, fake_env: dict[str, str]
) -> None:
    victim_dir = _victim(tmp_path).parent
    planted = private_tmp / f"eagle3-vllm-{os.getuid()}"
    planted.symlink_to(victim_dir, target_is_directory=True)
    (private_tmp / "eagle3-vllm").symlink_to(victim_dir, target_is_directory=True)  # the folder's old, shared name
    server = vs.LocalVLLMServer(stand_in_config(tmp_path, model_dir, fake_env, log_dir=None))
    with pytest.raises(vs.VLLMServerError, match="symbolic link") as refused:
        server.start()  # before: the log went into the victim's folder through the link
    assert str(planted) in str(refused.value) and server.process is None
    assert sorted(p.name for p in victim_dir.iterdir()) == ["precious.txt"]


@pytest.mark.skipif(os.getuid() != 0, reason="making a folder another user's needs root")
def test_a_log_folder_owned_by_another_user_is_refused(
    tmp_path: Path, model_dir: Path, fake_env: dict[str, str]
) -> None:
    config = stand_in_config(tmp_path, model_dir, fake_env)
    assert config.log_dir is not None
    config.log_dir.mkdir(mode=0o777)
    os.chown(config.log_dir, OTHER_UID, OTHER_UID)  # someone else made it first (e.g. in /tmp)
    server = vs.LocalVLLMServer(config)
    with pytest.raises(vs.VLLMServerError, match=rf"belongs to .*uid {OTHER_UID}") as refused:
        server.start()  # before: the log was written into it
    assert str(config.log_dir) in str(refused.value)
    assert list(config.log_dir.iterdir()) == [] and server.process is None


def test_a_symlink_planted_where_the_pid_file_goes_is_refused(
    tmp_path: Path,
    model_dir: Path,
    fake_env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    victim = _victim(tmp_path)
    logs = tmp_path / "cli-logs"
    logs.mkdir()
    port = find_free_port()
    (logs / f"vllm-{port}.pid").symlink_to(victim)
    monkeypatch.setenv(vs.ENV_PYTHON, sys.executable)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([fake_env["PYTHONPATH"], os.environ.get("PYTHONPATH", "")]))
    try:
        code = vllm_cli.main(
            ["start", "--model", str(model_dir), "--port", str(port), "--served-model-name", "tiny",
             "--log-dir", str(logs), "--startup-timeout", "30"]
        )  # fmt: skip
    finally:
        with contextlib.suppress(ValueError, KeyError):  # a detached server whose record went through the link
            vs.stop_process_group(int(json.loads(victim.read_text())["pid"]), grace_s=1.0)
    assert code == 1  # before: 0, the pid record written over the victim and the server left running
    assert "symbolic link" in capsys.readouterr().err
    assert victim.read_text() == VICTIM_TEXT
    assert vs.list_models(f"http://127.0.0.1:{port}/v1") is None  # the server it started is stopped again


# ------------------------------------------------------------------------------- reuse of a running server


def _stranger(model_dir: Path, fake_env: dict[str, str], port: int) -> subprocess.Popen[bytes]:
    """A server on ``port`` with vLLM's command line for ``model_dir``, not started through eagle3."""
    args = ["--model", str(model_dir.resolve()), "--served-model-name", "tiny", "--host", "127.0.0.1", "--port"]
    stranger = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args, str(port)],
        env={**os.environ, **fake_env},
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 20
    while vs.list_models(f"http://127.0.0.1:{port}/v1") is None:
        assert time.monotonic() < deadline and stranger.poll() is None, "the stranger's server did not start"
        time.sleep(0.1)
    return stranger


def test_a_marker_folder_planted_as_a_symlink_is_never_read(
    private_tmp: Path, tmp_path: Path, model_dir: Path, fake_env: dict[str, str]
) -> None:
    port = find_free_port()
    stranger = _stranger(model_dir, fake_env, port)
    try:
        # someone else's folder, full of markers that vouch for their server
        planted_markers = tmp_path / "planted"
        record = {"pid": stranger.pid, "port": port, "model": str(model_dir.resolve()), "served_name": "tiny"}
        for folder in (planted_markers, planted_markers / "servers"):
            folder.mkdir(exist_ok=True)
            (folder / f"127.0.0.1-{port}.json").write_text(json.dumps(record))
        uid = os.getuid()
        (private_tmp / f"eagle3-vllm-{uid}").symlink_to(planted_markers, target_is_directory=True)
        (private_tmp / f"eagle3-vllm-servers-{uid}").symlink_to(planted_markers, target_is_directory=True)  # old
        reuse = stand_in_config(tmp_path, model_dir, fake_env, port=port, reuse_existing=True)
        with pytest.raises(vs.VLLMServerError, match=r"cannot reuse .*symbolic link"):
            vs.LocalVLLMServer(reuse).start()  # before: the planted marker was believed and the server reused
    finally:
        vs.stop_process_group(stranger.pid, grace_s=1.0, process=stranger)


@pytest.mark.parametrize("lookup", ["process_owner", "listener_owners"])
def test_a_server_of_another_user_is_not_reused(
    private_tmp: Path,
    tmp_path: Path,
    model_dir: Path,
    fake_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    lookup: str,
) -> None:
    config = stand_in_config(tmp_path, model_dir, fake_env)
    with vs.LocalVLLMServer(config) as ours:
        reuse = stand_in_config(tmp_path, model_dir, fake_env, port=config.port, reuse_existing=True)
        assert vs.LocalVLLMServer(reuse).start().reused  # ours: reused
        # the recorded pid (recycled) or the socket on the port now belongs to another user: stub the one uid lookup
        owner = {"process_owner": lambda _pid: OTHER_UID, "listener_owners": lambda _port: {OTHER_UID}}[lookup]
        monkeypatch.setattr(process_guard, lookup, owner, raising=False)
        with pytest.raises(vs.VLLMServerError, match=rf"cannot reuse .*belongs to .*uid {OTHER_UID}"):
            vs.LocalVLLMServer(reuse).start()  # before: reused (only the command line was looked at)
        pid = ours.process.pid if ours.process else None
    assert pid is not None and group_gone(pid)


@pytest.mark.skipif(os.getuid() == 0, reason="pid 1 is another user's only when the tests do not run as root")
def test_a_marker_naming_pid_1_is_refused(
    private_tmp: Path, tmp_path: Path, model_dir: Path, fake_env: dict[str, str]
) -> None:
    config = stand_in_config(tmp_path, model_dir, fake_env)
    with vs.LocalVLLMServer(config):
        process_guard.write_marker(config.host, config.port, 1, model_dir, "tiny")
        reuse = stand_in_config(tmp_path, model_dir, fake_env, port=config.port, reuse_existing=True)
        with pytest.raises(vs.VLLMServerError, match=r"cannot reuse .*process 1 .*belongs to"):
            vs.LocalVLLMServer(reuse).start()
