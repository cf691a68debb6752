"""A stand-in vLLM that will not stop (issue 31, "bounded waits"): it ignores SIGINT and SIGTERM, and starts a helper
in its own session (out of the server's process group, like a daemonized child) that ignores them too. With
``STUBBORN_VLLM_LOADING=1`` it never gets past "loading the model" (it never listens).

``stubborn_python(root)`` writes the stand-in package and an interpreter wrapper that puts it on the server's
``PYTHONPATH`` only (``$EAGLE3_VLLM_PYTHON`` / ``VLLMServerConfig.python``): the process that starts the server
never sees the stand-in ``vllm`` package. No tests here."""

from __future__ import annotations

import re
import sys
from pathlib import Path

API_SERVER = """
import argparse, json, os, signal, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

for stop in (signal.SIGINT, signal.SIGTERM):
    signal.signal(stop, signal.SIG_IGN)
parser = argparse.ArgumentParser()
parser.add_argument("--served-model-name"); parser.add_argument("--host"); parser.add_argument("--port", type=int)
args, _rest = parser.parse_known_args()
ignore = "import signal, time; [signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)]; "
helper = subprocess.Popen([sys.executable, "-c", ignore + "time.sleep(3600)"], start_new_session=True)
print(f"STUBBORN helper {helper.pid}", flush=True)
if os.environ.get("STUBBORN_VLLM_LOADING") == "1":
    print("STUBBORN loading the model", flush=True)
    time.sleep(3600)

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": args.served_model_name}]}).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json"); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass

ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
"""


def stubborn_python(root: Path) -> Path:
    """An interpreter (a wrapper script) whose ``-m vllm.entrypoints.openai.api_server`` is the stubborn stand-in."""
    package = root / "stubborn-vllm"
    module = package / "vllm" / "entrypoints" / "openai"
    module.mkdir(parents=True, exist_ok=True)
    for folder in (module, module.parent, module.parent.parent):
        (folder / "__init__.py").write_text("")
    (module / "api_server.py").write_text(API_SERVER)
    wrapper = root / "stubborn-python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{package}:$PYTHONPATH" exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def helper_pid(log: Path) -> int | None:
    """The pid of the helper the stand-in started (from its log), None before it is written."""
    found = re.search(r"STUBBORN helper (\d+)", log.read_text(errors="replace")) if log.exists() else None
    return int(found.group(1)) if found else None


# A ``sitecustomize`` that stalls every transformers model load for $SLOW_LOAD_S seconds (a large verifier read from a
# slow disk), printing "SLOW LOAD started" first: a signal can then be sent while the model loads.
SLOW_LOAD = """
import importlib.abc, importlib.util, os, sys, time


class _SlowLoad(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "transformers.modeling_utils":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            load = module.PreTrainedModel.from_pretrained.__func__

            def stalled(cls, *args, **kwargs):
                print("SLOW LOAD started", flush=True)
                time.sleep(float(os.environ["SLOW_LOAD_S"]))
                return load(cls, *args, **kwargs)

            module.PreTrainedModel.from_pretrained = classmethod(stalled)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("SLOW_LOAD_S"):
    sys.meta_path.insert(0, _SlowLoad())
"""


def slow_load_path(root: Path) -> Path:
    """A folder holding the stalling ``sitecustomize`` (put it first on a child's PYTHONPATH, set SLOW_LOAD_S)."""
    folder = root / "slow-load"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SLOW_LOAD)
    return folder
