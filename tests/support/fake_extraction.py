"""A fake vLLM extraction server (``extract_hidden_states`` + a hidden-states connector) that can lie.

It answers ``POST /v1/completions`` (``max_tokens=1``, ``prompt`` = token ids) the way vLLM does in extraction mode:
it writes one safetensors file per request into its storage folder (deterministic states: every value is the
token id) and names it in ``kv_transfer_params.hidden_states_path``. ``GET /v1/models`` lists its model.

``mode`` picks a fault for every request:

- ``ok``: an honest answer (file ``eagle3-hs-N.safetensors``);
- ``status``: HTTP ``status`` with vLLM's error body (500/503: an outage, 401/403: a refused key);
- ``escape``: names ``target`` (a path outside the storage folder, e.g. a file the client must never delete);
- ``symlink``: names ``eagle3-hs-N.safetensors`` in the storage folder, a symbolic link to ``target``;
- ``garbage``: a file of random bytes (not safetensors);
- ``wrong_ids``: a well-formed file carrying other token ids;
- ``no_kv``: a 200 completion without ``kv_transfer_params`` (malformed);
- ``weights``: names ``target``'s file name, which lies in the storage folder (model weights beside the files);
- ``trickle`` / ``endless``: a 200 whose body never ends, on every route (``/v1/completions``, ``/v1/models`` and a
  ``/metrics`` page): a byte every ``trickle_interval_s`` (under any idle timeout, with an ordinary Content-Length),
  or, chunked, as fast as the client reads; for ``hang_s`` at most (issue 31's bounded bodies).

``GET /metrics`` otherwise answers a small Prometheus page (vLLM's two scheduler gauges at 0).

Run in a thread (:func:`serve_extraction`) or as a process (``python -m support.fake_extraction --storage DIR``,
first stdout line ``READY <port>``; :class:`ExtractionServerProcess`), so a test can kill it like a crashed server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL = "m"
# the modes whose 200 body never ends
NEVER_ENDING_MODES = ("trickle", "endless")
METRICS_PAGE = "vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n"


@dataclass
class ExtractionFake:
    storage: Path
    hidden: int = 64
    n_states: int = 4
    mode: str = "ok"
    status: int = 500
    target: str = ""
    basic_auth: str | None = None  # "user:password": /v1/* requires that Authorization: Basic header
    api_key: str | None = None  # /v1/* requires "Authorization: Bearer <api_key>" (vLLM's --api-key)
    requests: int = 0
    trickle_interval_s: float = 1.0  # "trickle": seconds between the body's bytes
    hang_s: float = 3600.0  # how long a never-ending body lasts at most

    def _refused(self, request: Any) -> Any:
        import base64

        from aiohttp import web

        wanted = "Basic " + base64.b64encode((self.basic_auth or "").encode()).decode()
        if self.basic_auth and request.headers.get("Authorization") != wanted:
            return web.json_response({"error": {"message": "Unauthorized", "code": 401}}, status=401)
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "Unauthorized", "code": 401}}, status=401)
        return None

    async def completions(self, request: Any) -> Any:
        from aiohttp import web

        self.requests += 1
        number = self.requests  # before any await: requests run concurrently
        if (refused := self._refused(request)) is not None:
            return refused
        body = await request.json()
        if self.mode in NEVER_ENDING_MODES:
            return await self._never_ending(request)
        if self.mode == "status":
            error = {"error": {"message": "fake failure", "type": "x", "code": self.status}}
            return web.json_response(error, status=self.status)
        ids = [int(i) for i in body["prompt"]]
        path = self.storage / f"eagle3-hs-{number}-{os.getpid()}.safetensors"
        if self.mode in ("ok", "wrong_ids"):
            self._write(path, ids if self.mode == "ok" else [i + 1 for i in ids])
        elif self.mode == "garbage":
            path.write_bytes(os.urandom(64))
        elif self.mode == "symlink":
            path.symlink_to(self.target)
        elif self.mode in ("escape", "weights"):
            path = Path(self.target)
        choice = {"index": 0, "text": "x", "finish_reason": "length", "logprobs": None, "prompt_token_ids": ids}
        reply: dict[str, Any] = {"id": "c", "object": "text_completion", "created": 0, "model": MODEL}
        reply["choices"] = [choice]
        if self.mode != "no_kv":
            reply["kv_transfer_params"] = {"hidden_states_path": str(path)}
        return web.json_response(reply)

    def _write(self, path: Path, ids: list[int]) -> None:
        import torch
        from safetensors.torch import save_file

        states = torch.tensor(ids, dtype=torch.float32)[:, None, None].expand(len(ids), self.n_states, self.hidden)
        save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(ids)}, str(path))

    async def models(self, request: Any) -> Any:
        from aiohttp import web

        if (refused := self._refused(request)) is not None:
            return refused
        if self.mode in NEVER_ENDING_MODES:
            return await self._never_ending(request)
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def metrics(self, request: Any) -> Any:
        from aiohttp import web

        if self.mode in NEVER_ENDING_MODES:
            return await self._never_ending(request)
        return web.Response(text=METRICS_PAGE, content_type="text/plain")

    async def _never_ending(self, request: Any) -> Any:
        """A 200 that starts like a JSON reply and never ends (until the client goes away, or ``hang_s``)."""
        from aiohttp import web

        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        if self.mode == "trickle":
            response.content_length = 4096  # an ordinary length: a small, whole reply that is slow to arrive
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        ends = loop.time() + self.hang_s
        with contextlib.suppress(ConnectionError):  # the client gave up: what it should do
            await response.write(b'{"id":"c","object":"text_completion","choices":[{"index":0,"text":"')
            while loop.time() < ends:
                if self.mode == "trickle":
                    await response.write(b"x")
                    await asyncio.sleep(self.trickle_interval_s)
                else:  # write() waits while the client's socket is full: only as fast as it reads
                    await response.write(b"endless " * 8192)
        # the body was never whole: cut the connection rather than end a chunked body properly
        if request.transport is not None:
            request.transport.close()
        return response

    def app(self) -> Any:
        from aiohttp import web

        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        return app


@contextlib.contextmanager
def serve_extraction(fake: ExtractionFake) -> Iterator[str]:
    """The fake on a background thread's loop; yields its base URL (``http://127.0.0.1:P/v1``)."""
    from aiohttp import web

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(fake.app())
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="fake-extraction")
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


class ExtractionServerProcess:
    """The fake in a subprocess, shaped like ``LocalVLLMServer`` where the backend looks (``process``, ``base_url``,
    ``startup_s``, ``log_path``, ``stop``): a stand-in for the embedded extraction server that a test can kill."""

    def __init__(
        self,
        storage: Path,
        log_path: Path,
        mode: str = ExtractionFake.mode,
        trickle_interval_s: float = ExtractionFake.trickle_interval_s,
        hang_s: float = ExtractionFake.hang_s,
    ) -> None:
        tests_dir = Path(__file__).resolve().parent.parent
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests_dir.parent), str(tests_dir)])}
        self.log_path = log_path
        fault = ["--mode", mode, "--trickle-interval-s", str(trickle_interval_s), "--hang-s", str(hang_s)]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "support.fake_extraction", "--storage", str(storage), *fault],
            stdout=subprocess.PIPE,
            stderr=log_path.open("wb"),
            text=True,
            env=env,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.startswith("READY "):
            self.stop()
            raise RuntimeError(f"fake extraction server did not start: {line!r}")
        self.base_url = f"http://127.0.0.1:{int(line.split()[1])}/v1"
        self.startup_s = 0.0

    def __enter__(self) -> ExtractionServerProcess:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


def main() -> None:
    from aiohttp import web

    parser = argparse.ArgumentParser(prog="python -m support.fake_extraction")
    parser.add_argument("--storage", type=Path, required=True)
    parser.add_argument("--mode", default=ExtractionFake.mode, choices=("ok", *NEVER_ENDING_MODES))
    parser.add_argument("--trickle-interval-s", type=float, default=ExtractionFake.trickle_interval_s)
    parser.add_argument("--hang-s", type=float, default=ExtractionFake.hang_s)
    args = parser.parse_args()
    fake = ExtractionFake(args.storage, mode=args.mode, trickle_interval_s=args.trickle_interval_s, hang_s=args.hang_s)

    async def run() -> None:
        runner = web.AppRunner(fake.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(f"READY {site._server.sockets[0].getsockname()[1]}", flush=True)  # type: ignore[union-attr]
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()
