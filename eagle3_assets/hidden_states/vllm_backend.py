"""The ``vllm`` hidden-states backend: the verifier runs inside vLLM servers, this process only sends token ids.

How it works (vLLM's ``extract_hidden_states`` speculative method plus a hidden-states KV connector):

1. each extraction server serves the verifier with ``--speculative-config '{"method": "extract_hidden_states",
   ...eagle_aux_hidden_state_layer_ids...}'`` and ``--kv-transfer-config`` naming a hidden-states connector that
   writes one safetensors file per request into a ``shared_storage_path`` (see
   :mod:`eagle3_assets.local.extraction` for the exact arguments, and docs/scaling.md for a multi-GPU server);
2. every sample's STORED token ids (prompt + completion, as the generating server returned them) go out as a
   Completions request with ``prompt`` = the ids and ``max_tokens=1``, through speculators'
   ``generate_hidden_states_async`` (which also checks the echoed prompt ids); many requests are in flight at
   once, spread over the servers by least outstanding requests, with retries and benching of failing servers
   (the generation engine's :class:`~eagle3_assets.generation.endpoints.EndpointPool`);
3. the file the response names (``kv_transfer_params.hidden_states_path``) is read once the connector releases
   its ``.lock``, checked (token ids equal to the ids sent, shape ``[T, n_aux + 1, H]``, finite values), converted
   to the storage dtype, and deleted with its lock file whatever the outcome.

The caller (:func:`eagle3_assets.hidden_states.extract.extract_partition`) writes the returned tensors exactly as
it writes the ``hf`` backend's, so the on-disk layout, resuming and kill-safety are shared.

With no server URL, :func:`start_embedded_server` starts the local CPU vLLM in extraction mode on the verifier
folder, and the backend stops it on ``close()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_assets.settings import ConfigError

if TYPE_CHECKING:
    import torch

    from eagle3_assets.local.vllm_server import LocalVLLMServer

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "eagle3-verifier"


class ExtractionError(RuntimeError):
    """An extraction server answered with something unusable (wrong token ids, shape, NaN) or kept failing."""


@dataclass(frozen=True)
class VLLMBackendOptions:
    """How to reach the extraction servers (see ``EAGLE3_HIDDEN_STATES_*`` in the README)."""

    urls: tuple[str, ...] = ()  # empty: start the embedded CPU vLLM on the verifier
    model: str | None = None  # served model name; None: the servers' only model
    # Where THIS process finds the connector's files: the shared volume's local mount. None: the path the server
    # reports is readable here as is (same machine, or the volume mounted at the same path).
    storage_path: str | None = None
    api_key: str | None = None
    concurrency: int = 32  # requests in flight over all servers
    timeout_s: float = 600.0  # per request
    max_attempts: int = 4  # per sample, over all servers
    bench_s: float = 10.0  # first bench of a failing server
    max_model_len: int = 2049  # embedded server only: max_seq_len + the one generated token
    startup_timeout_s: float = 600.0  # embedded server only


def local_file(server_path: str, storage_path: str | None) -> Path:
    """The connector's file as seen from this process: under ``storage_path`` when the volume is mounted elsewhere."""
    if storage_path is None:
        return Path(server_path)
    return Path(storage_path) / Path(server_path).name


def read_connector_file(path: Path, token_ids: Sequence[int], n_states: int, hidden_size: int) -> torch.Tensor:
    """Wait for the connector's write lock, load the file, check it, and delete it (and its lock) in any case."""
    import torch
    from safetensors.torch import load_file

    lock = Path(f"{path}.lock")
    try:
        with contextlib.suppress(FileNotFoundError), lock.open("rb") as handle:
            fcntl.flock(handle, fcntl.LOCK_SH)  # the connector holds LOCK_EX until the file is written whole
        if not path.exists():
            raise ExtractionError(
                f"the server named {path} but it does not exist here: is the connector's shared_storage_path "
                "mounted at this path (set EAGLE3_HIDDEN_STATES_STORAGE to its local mount)?"
            )
        tensors = load_file(str(path))
    finally:
        path.unlink(missing_ok=True)
        lock.unlink(missing_ok=True)
    states, stored_ids = tensors.get("hidden_states"), tensors.get("token_ids")
    if states is None or stored_ids is None:
        raise ExtractionError(f"{path.name}: keys {sorted(tensors)}, expected hidden_states and token_ids")
    if stored_ids.tolist() != list(token_ids):
        raise ExtractionError(f"{path.name}: token_ids differ from the {len(token_ids)} ids sent")
    expected = (len(token_ids), n_states, hidden_size)
    if tuple(states.shape) != expected:
        raise ExtractionError(
            f"{path.name}: hidden_states shape {tuple(states.shape)} != {expected} (does the server extract the same "
            "eagle_aux_hidden_state_layer_ids?)"
        )
    if not bool(torch.isfinite(states).all()):
        raise ExtractionError(f"{path.name}: hidden states contain NaN or Inf")
    return states


def sweep_stale_files(storage: Path, older_than_s: float) -> int:
    """Delete connector files (and locks) older than ``older_than_s``: what killed clients left in a shared folder.

    Safe next to live clients: a client waits at most its request timeout for the answer and reads the file at once,
    so a file older than twice the timeout has no reader left.
    """
    import time

    cutoff = time.time() - older_than_s
    removed = 0
    for entry in storage.glob("*.safetensors*"):
        with contextlib.suppress(FileNotFoundError):
            if entry.stat().st_mtime < cutoff:
                entry.unlink()
                removed += 1
    return removed


class VLLMBackend:
    """Hidden states from vLLM extraction servers; see the module docstring."""

    name = "vllm"

    def __init__(
        self,
        verifier_path: str | Path,
        layer_ids: list[int],
        store_dtype: str = "bfloat16",
        device: str = "auto",
        batch_tokens: int = 8192,
        options: VLLMBackendOptions | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        import torch

        from eagle3_assets.hidden_states.backends import verifier_shape

        self.options = options or VLLMBackendOptions()
        self.layer_ids = list(layer_ids)
        self.hidden_size = verifier_shape(verifier_path).hidden_size
        self.store_dtype = getattr(torch, store_dtype)
        # many sequences per call so the servers always have `concurrency` requests to work on
        self.batch_tokens = max(batch_tokens, 4 * self.options.concurrency * 1024)
        self._say = log or logger.info
        self._server: LocalVLLMServer | None = None
        self._tmp_storage: Path | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hs-vllm-client", daemon=True)
        self._thread.start()
        try:
            urls, storage = list(self.options.urls), self.options.storage_path
            if not urls:
                urls, storage = self._start_embedded(Path(verifier_path))
            elif storage is not None and Path(storage).is_dir():
                swept = sweep_stale_files(Path(storage), 2 * self.options.timeout_s)
                if swept:
                    self._say(f"hidden_states: removed {swept} stale connector file(s) from {storage}")
            self._storage = storage
            self._pool, self._clients, self._model = self._connect(urls)
        except BaseException:
            self.close()
            raise

    def _start_embedded(self, verifier_path: Path) -> tuple[list[str], str]:
        from eagle3_assets.local.extraction import start_extraction_server

        if self.options.storage_path:
            storage = Path(self.options.storage_path)
            storage.mkdir(parents=True, exist_ok=True)
        else:
            storage = self._tmp_storage = Path(tempfile.mkdtemp(prefix="eagle3-hs-transfer-"))
        self._say(f"hidden_states: starting the embedded CPU vLLM in extraction mode on {verifier_path} ...")
        self._server = start_extraction_server(
            verifier_path,
            self.layer_ids,
            storage,
            served_model_name=EMBEDDED_MODEL_NAME,
            max_model_len=self.options.max_model_len,
            startup_timeout_s=self.options.startup_timeout_s,
            die_with_parent=True,  # a SIGKILLed run must not leave a vLLM server behind
        )
        self._say(
            f"hidden_states: extraction server ready at {self._server.base_url} in {self._server.startup_s:.0f} s"
        )
        return [self._server.base_url], str(storage)

    def _connect(self, urls: list[str]) -> tuple[Any, dict[str, Any], str]:
        import openai

        from eagle3_assets.generation.endpoints import EndpointPool
        from eagle3_assets.local.vllm_server import list_models

        model = self.options.model
        if model is None:
            served = list_models(urls[0], api_key=self.options.api_key)
            if not served:
                raise ConfigError(f"EAGLE3_HIDDEN_STATES_URL={urls[0]!r}: no model list at {urls[0]}/models")
            model = served[0]
        pool = EndpointPool(urls, cap=self.options.concurrency, bench_s=self.options.bench_s, log=self._say)

        async def make_clients() -> dict[str, Any]:
            # max_retries=0: retries go through the pool, which can move a sample to another server
            return {
                url: openai.AsyncOpenAI(base_url=url, api_key=self.options.api_key or "EMPTY", max_retries=0)
                for url in urls
            }

        clients = asyncio.run_coroutine_threadsafe(make_clients(), self._loop).result()
        return pool, clients, model

    def extract(self, batch: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        import concurrent.futures

        future = asyncio.run_coroutine_threadsafe(self._extract_all([list(ids) for ids in batch]), self._loop)
        try:
            while not future.done():  # woken up regularly so a signal's handler runs (see eagle3_assets/interrupts.py)
                concurrent.futures.wait([future], timeout=0.2)
            return future.result()
        except BaseException:
            future.cancel()  # a stop request: cancel the requests in flight (the sweep removes their files)
            raise

    async def _extract_all(self, batch: list[list[int]]) -> list[torch.Tensor]:
        gate = asyncio.Semaphore(self.options.concurrency)

        async def one(ids: list[int]) -> torch.Tensor:
            async with gate:
                return await self._extract_one(ids)

        # Every request runs to its end even when one fails: a cancelled request would still make the server
        # write a file that nobody reads and deletes.
        results = await asyncio.gather(*(one(ids) for ids in batch), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)  # type: ignore[arg-type]

    async def _acquire(self) -> Any:
        while True:
            endpoint = self._pool.acquire()
            if endpoint is not None:
                return endpoint
            wait = self._pool.next_change_in()
            await asyncio.sleep(min(wait, 1.0) if wait is not None else 0.05)

    async def _extract_one(self, ids: list[int]) -> torch.Tensor:
        import openai

        from eagle3_assets.speculators_adapter import hidden_states_client

        client = hidden_states_client()

        last: BaseException | None = None
        for _attempt in range(self.options.max_attempts):
            endpoint = await self._acquire()
            failed = True
            try:
                path, _params = await client.generate_hidden_states_async(
                    self._clients[endpoint.url],
                    self._model,
                    {"input_ids": ids},
                    timeout=self.options.timeout_s,
                    max_retries=0,
                )
                states = await asyncio.to_thread(
                    read_connector_file,
                    local_file(path, self._storage),
                    ids,
                    len(self.layer_ids) + 1,
                    self.hidden_size,
                )
                failed = False
                return states.to(self.store_dtype)
            except (client.InvalidResponseError, ExtractionError) as error:
                failed = False  # the request's own answer is wrong: another server would not help
                raise ExtractionError(f"{endpoint.url}: {error}") from error
            except openai.BadRequestError as error:
                failed = False
                raise ExtractionError(f"{endpoint.url} refused a {len(ids)}-token sample: {error}") from error
            except (openai.APIError, TimeoutError, OSError) as error:
                last = error
            finally:
                self._pool.release(endpoint, server_failure=failed)
        raise ExtractionError(
            f"a {len(ids)}-token sample failed {self.options.max_attempts} times over {list(self._clients)}: "
            f"{type(last).__name__}: {last}"
        )

    def close(self) -> None:
        clients = getattr(self, "_clients", {})
        if self._loop.is_running():
            for client in clients.values():
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(client.close(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if self._server is not None:
            self._say("hidden_states: stopping the embedded extraction server")
            self._server.stop()
            self._server = None
        if self._tmp_storage is not None:
            shutil.rmtree(self._tmp_storage, ignore_errors=True)
            self._tmp_storage = None
