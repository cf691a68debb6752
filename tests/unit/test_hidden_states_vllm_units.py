"""The vllm hidden-states backend's pieces that need no server: the connector-file check, path mapping, the stale
file sweep, the extraction server's arguments, and the new settings' errors."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from eagle3_assets.core import settings
from eagle3_assets.hidden_states.connector_files import (
    ExtractionError,
    local_file,
    read_connector_file,
    sweep_stale_files,
)


def _connector_file(path: Path, ids: list[int], shape: tuple[int, ...], nan: bool = False) -> Path:
    import torch
    from safetensors.torch import save_file

    states = torch.randn(*shape)
    if nan:
        states[0, 0, 0] = float("nan")
    save_file({"hidden_states": states, "token_ids": torch.tensor(ids)}, str(path))
    path.with_name(path.name + ".lock").write_bytes(b"")
    return path


def test_a_good_connector_file_is_returned_and_deleted_with_its_lock(tmp_path: Path) -> None:
    path = _connector_file(tmp_path / "req.safetensors", [5, 6, 7], (3, 4, 8))
    states = read_connector_file(path, [5, 6, 7], 4, 8)
    assert tuple(states.shape) == (3, 4, 8)
    assert list(tmp_path.iterdir()) == []


def test_a_file_with_other_token_ids_is_not_this_requests_answer_and_is_left_alone(tmp_path: Path) -> None:
    path = _connector_file(tmp_path / "req.safetensors", [5, 6, 8], (3, 4, 8))
    with pytest.raises(ExtractionError, match="token_ids differ"):
        read_connector_file(path, [5, 6, 7], 4, 8)
    assert path.is_file()  # the reply does not decide what is deleted: only this request's own answer is


@pytest.mark.parametrize(
    ("ids", "shape", "nan", "why"),
    [
        ([5, 6, 7], (3, 3, 8), False, r"shape \(3, 3, 8\) != \(3, 4, 8\)"),
        ([5, 6, 7], (3, 4, 8), True, "NaN or Inf"),
    ],
)
def test_a_bad_connector_file_fails_naming_why_and_is_deleted(
    tmp_path: Path, ids: list[int], shape: tuple[int, ...], nan: bool, why: str
) -> None:
    path = _connector_file(tmp_path / "req.safetensors", ids, shape, nan)
    with pytest.raises(ExtractionError, match=why):
        read_connector_file(path, [5, 6, 7], 4, 8)
    assert list(tmp_path.iterdir()) == []


def test_a_file_missing_here_points_at_the_storage_setting(tmp_path: Path) -> None:
    with pytest.raises(ExtractionError, match="EAGLE3_HIDDEN_STATES_STORAGE"):
        read_connector_file(tmp_path / "elsewhere.safetensors", [1], 4, 8)


def test_a_read_error_on_the_file_is_this_machines_error_not_a_bad_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EIO reading the connector's file propagates as the OSError it is (the backend reports it as a local storage
    error and stops), never as "not a readable safetensors file" (the server's fault, retried); the file is kept."""
    import errno

    from eagle3_assets.hidden_states import connector_files

    path = _connector_file(tmp_path / "eagle3-hs-x.safetensors", [1, 2], (2, 4, 8))

    def failing_read(target: Path) -> bytes:
        raise OSError(errno.EIO, "Input/output error", str(target))

    monkeypatch.setattr(connector_files, "_read_bytes", failing_read)
    with pytest.raises(OSError) as raised:
        read_connector_file(path, [1, 2], 4, 8)
    assert raised.value.errno == errno.EIO and not isinstance(raised.value, ExtractionError)
    assert path.exists()


def test_server_paths_map_onto_the_local_mount() -> None:
    assert local_file("/mnt/server/x.safetensors", "/data/hs") == Path("/data/hs/x.safetensors")
    assert local_file("../../etc/x.safetensors", "/data/hs") == Path("/data/hs/x.safetensors")  # never leaves it
    for bad in ("/etc/passwd", "/mnt/server/", "/mnt/.hidden.safetensors"):
        with pytest.raises(ExtractionError, match="not a connector file"):
            local_file(bad, "/data/hs")


def test_only_stale_connector_files_are_swept(tmp_path: Path) -> None:
    old, new = tmp_path / "eagle3-hs-a.safetensors", tmp_path / "eagle3-hs-b.safetensors"
    weights = tmp_path / "model.safetensors"
    for path in (old, new, tmp_path / "eagle3-hs-a.safetensors.lock", tmp_path / "other.txt", weights):
        path.write_bytes(b"x")
    long_ago = time.time() - 3600
    for path in (old, tmp_path / "eagle3-hs-a.safetensors.lock", weights):
        os.utime(path, (long_ago, long_ago))
    assert sweep_stale_files(tmp_path, 600) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eagle3-hs-b.safetensors", "model.safetensors", "other.txt"]


def test_extraction_server_arguments(tmp_path: Path) -> None:
    from eagle3_assets.local.extraction_server import PLUGIN_DIR, extraction_server_config
    from support.hidden_states_data import cached_tiny_verifier

    config = extraction_server_config(cached_tiny_verifier(), [1, 2, 3], tmp_path, port=8123, die_with_parent=True)
    command = config.command(Path("python"))
    spec = json.loads(command[command.index("--speculative-config") + 1])
    # the aux layers, then the verifier's layer count (4): the last layer's output before the final norm
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3, 4]
    transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "CPUHiddenStatesConnector"
    assert transfer["kv_connector_module_path"] == "eagle3_hs_connector"
    assert transfer["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path.resolve())
    assert config.environment()["PYTHONPATH"].split(os.pathsep)[0] == str(PLUGIN_DIR)
    assert (PLUGIN_DIR / "eagle3_hs_connector.py").is_file()
    assert "prctl" in command[2] and config.environment()["EAGLE3_VLLM_PARENT_PID"] == str(os.getpid())  # dies with us
    assert config.max_model_len == 2048  # capped at the tiny verifier's max_position_embeddings


def test_new_settings_defaults() -> None:
    from eagle3_assets.defs.resources import VerifierResource
    from eagle3_assets.environment import env_value

    env: dict[str, str] = {}
    assert env_value("EAGLE3_HIDDEN_STATES_BACKEND", env) == "hf"
    assert env_value("EAGLE3_HIDDEN_STATES_URL", env) == ""
    assert env_value("EAGLE3_DEVICE", env) == "auto"
    assert env_value("EAGLE3_TRAIN_PROCS", env) == 1
    urls = "http://hs-0:8000/v1,http://hs-1:8000/v1"
    verifier = VerifierResource.from_env({"EAGLE3_HIDDEN_STATES_URL": urls, "EAGLE3_TRAIN_PROCS": "2"})
    assert verifier.hidden_states_urls() == urls.split(",") and verifier.train_procs == 2


def test_hf_backend_device_options() -> None:
    import torch

    from eagle3_assets.hidden_states.hf_backend import load_options

    assert load_options("cpu", "float32") == ({"dtype": torch.float32}, False)
    assert load_options("cpu", "bfloat16") == ({"dtype": torch.bfloat16}, False)
    with pytest.raises(settings.ConfigError, match="EAGLE3_DEVICE='tpu'"):
        load_options("tpu")
    if not torch.cuda.is_available():
        assert load_options("auto", "float32") == ({"dtype": torch.float32}, False)
        with pytest.raises(settings.ConfigError, match="EAGLE3_DEVICE='cuda:1': no CUDA device"):
            load_options("cuda:1")
    else:
        options, on_gpu = load_options("auto")
        assert on_gpu and options == {"dtype": torch.bfloat16, "device_map": "auto"}


class _FakeExtractionServer:
    """A stand-in for a vLLM extraction server: answers Completions with max_tokens=1 by writing a connector file
    (deterministic states from the token ids) and naming it in ``kv_transfer_params``; or fails with a status."""

    def __init__(self, storage: Path, hidden: int, n_states: int, fail_status: int | None = None) -> None:
        self.storage, self.hidden, self.n_states, self.fail_status = storage, hidden, n_states, fail_status
        self.requests = 0

    async def completions(self, request):  # type: ignore[no-untyped-def]
        import torch
        from aiohttp import web
        from safetensors.torch import save_file

        self.requests += 1
        number = self.requests  # before any await: requests run concurrently
        body = await request.json()
        if self.fail_status is not None:
            return web.json_response({"error": {"message": "down", "type": "x", "code": 0}}, status=self.fail_status)
        ids = list(body["prompt"])
        states = torch.tensor(ids, dtype=torch.float32)[:, None, None].expand(len(ids), self.n_states, self.hidden)
        path = self.storage / f"eagle3-hs-{number}-{id(self)}.safetensors"
        save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(ids)}, str(path))
        choice = {"index": 0, "text": "x", "finish_reason": "length", "logprobs": None, "prompt_token_ids": ids}
        return web.json_response(
            {"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [choice],
             "kv_transfer_params": {"hidden_states_path": str(path)}}
        )  # fmt: skip


def _serve(handler: _FakeExtractionServer) -> tuple[str, object]:
    """Run the fake server on 127.0.0.1 in a thread; returns (base URL, stop function)."""
    import asyncio
    import threading

    from aiohttp import web

    from eagle3_assets.net.ports import find_free_port

    port = find_free_port()
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/completions", handler.completions)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    return f"http://127.0.0.1:{port}/v1", stop


def test_requests_spread_over_servers_and_a_failing_one_is_benched_and_retried_elsewhere(tmp_path: Path) -> None:
    """Two servers, one answering 500: every sample comes back from the healthy one, right and in order; the failing
    one is benched after a few failures, and every connector file is deleted after reading."""
    from eagle3_assets.hidden_states.vllm_backend import VLLMBackend, VLLMBackendOptions
    from support.hidden_states_data import cached_tiny_verifier

    verifier = cached_tiny_verifier()  # hidden size 64
    good = _FakeExtractionServer(tmp_path, 64, 4)
    bad = _FakeExtractionServer(tmp_path, 64, 4, fail_status=500)
    (good_url, stop_good), (bad_url, stop_bad) = _serve(good), _serve(bad)
    notes: list[str] = []
    try:
        options = VLLMBackendOptions(
            urls=(bad_url, good_url), model="m", storage_path=str(tmp_path), concurrency=8, bench_s=60.0, max_attempts=4
        )
        backend = VLLMBackend(verifier, [1, 2, 3], "float32", options=options, log=notes.append)
        try:
            batch = [[i, i + 1, i + 2] for i in range(1, 41)]
            states = backend.extract(batch)
        finally:
            backend.close()
    finally:
        stop_good()
        stop_bad()
    assert [int(s[0, 0, 0]) for s in states] == [ids[0] for ids in batch]  # each sample its own answer, in order
    assert all(tuple(s.shape) == (3, 4, 64) for s in states)
    assert good.requests == 40 and 1 <= bad.requests <= 8  # benched after its failures, not asked 40 times
    assert any("benched" in note for note in notes)
    assert list(tmp_path.iterdir()) == []  # connector files read and deleted


def test_a_sample_that_fails_everywhere_raises_after_its_attempts(tmp_path: Path) -> None:
    from eagle3_assets.hidden_states.vllm_backend import ExtractionError, VLLMBackend, VLLMBackendOptions
    from support.hidden_states_data import cached_tiny_verifier

    bad = _FakeExtractionServer(tmp_path, 64, 4, fail_status=503)
    url, stop = _serve(bad)
    try:
        options = VLLMBackendOptions(urls=(url,), model="m", storage_path=str(tmp_path), bench_s=0.05, max_attempts=3)
        backend = VLLMBackend(cached_tiny_verifier(), [1, 2, 3], "float32", options=options)
        try:
            with pytest.raises(ExtractionError, match="failed 3 times"):
                backend.extract([[1, 2, 3]])
        finally:
            backend.close()
    finally:
        stop()
    assert bad.requests == 3
