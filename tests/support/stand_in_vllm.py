"""A stand-in ``vllm`` package for the process-management tests of ``LocalVLLMServer`` (seconds, no vLLM): a
``vllm.entrypoints.openai.api_server`` module put on PYTHONPATH that parses the same flags and answers GET
/v1/models. Its fixtures (``fake_env``, ``model_dir``) are registered for every test by ``tests/conftest.py``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from eagle3_assets.local import vllm_server as vs
from eagle3_assets.net.ports import find_free_port

FAKE_API_SERVER = """
import argparse, json, os, signal, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--model"); parser.add_argument("--served-model-name"); parser.add_argument("--host")
parser.add_argument("--port", type=int)
args, rest = parser.parse_known_args()
print("fake vllm argv", json.dumps(sys.argv[1:]), "cwd", os.getcwd(), flush=True)
print("env", os.environ.get("VLLM_CPU_KVCACHE_SPACE"), os.environ.get("HF_HUB_OFFLINE"), flush=True)
mode = os.environ.get("FAKE_VLLM_MODE", "ok")
if mode == "crash":
    print("RuntimeError: fake engine failed to start", flush=True)
    sys.exit(3)
if mode == "ignore-sigint":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
print("sigint handler", signal.getsignal(signal.SIGINT), flush=True)
if mode == "hang":
    time.sleep(3600)

required = os.environ.get("FAKE_VLLM_REQUIRED_KEY")  # like vLLM's AuthenticationMiddleware on /v1/*

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if required and self.path.startswith("/v1") and self.headers.get("Authorization") != f"Bearer {required}":
            self.send_response(401); self.end_headers(); self.wfile.write(b'{"error": "Unauthorized"}')
            return
        body = json.dumps({"object": "list", "data": [{"id": args.served_model_name}]}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Type", "application/json"); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a):
        pass

time.sleep(float(os.environ.get("FAKE_VLLM_DELAY_S", "0.5")))
server = ThreadingHTTPServer((args.host, args.port), Handler)
try:
    server.serve_forever()
except KeyboardInterrupt:
    print("graceful shutdown", flush=True)
"""


@pytest.fixture
def fake_env(tmp_path: Path) -> dict[str, str]:
    pkg = tmp_path / "fakevllm" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for folder in (pkg, pkg.parent, pkg.parent.parent):
        (folder / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(FAKE_API_SERVER)
    return {"PYTHONPATH": str(tmp_path / "fakevllm")}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    return path


def stand_in_config(tmp_path: Path, model_dir: Path, env: dict[str, str], **overrides: object) -> vs.VLLMServerConfig:
    values: dict[str, object] = {
        "model": model_dir,
        "served_model_name": "tiny",
        "port": find_free_port(),
        "python": Path(sys.executable),
        "extra_env": env,
        "log_dir": tmp_path / "logs",
        "startup_timeout_s": 30.0,
    }
    values.update(overrides)
    return vs.VLLMServerConfig(**values)  # type: ignore[arg-type]


def group_gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return vs.only_zombies(pid)
