"""The ``vllm`` hidden-states backend: the verifier runs inside vLLM servers, this process only sends token ids.

How it works (vLLM's ``extract_hidden_states`` speculative method plus a hidden-states KV connector):

1. each extraction server serves the verifier with ``--speculative-config '{"method": "extract_hidden_states",
   ...eagle_aux_hidden_state_layer_ids...}'`` and ``--kv-transfer-config`` naming a hidden-states connector that
   writes one safetensors file per request into a ``shared_storage_path`` (see
   :mod:`eagle3_assets.local.extraction_server` for the exact arguments, and docs/scaling.md for a multi-GPU server);
2. every sample's STORED token ids (prompt + completion, as the generating server returned them) go out as a
   Completions request with ``prompt`` = the ids and ``max_tokens=1``, through speculators'
   ``generate_hidden_states_async`` (which also checks the echoed prompt ids); many requests are in flight at
   once, spread over the servers by least outstanding requests, with retries and benching of failing servers
   (the generation engine's :class:`~eagle3_assets.net.endpoints.EndpointPool`);
3. the file the response names (``kv_transfer_params.hidden_states_path``) is read once the connector releases
   its ``.lock``, checked (token ids equal to the ids sent, shape ``[T, n_aux + 1, H]``, finite values), converted
   to the storage dtype, and deleted with its lock file whatever the outcome.

The caller (:func:`eagle3_assets.hidden_states.extract.extract_partition`) writes the returned tensors exactly as
it writes the ``hf`` backend's, so the on-disk layout, resuming and kill-safety are shared.

With no server URL, :func:`start_embedded_server` starts the local CPU vLLM in extraction mode on the verifier
folder, and the backend stops it on ``close()``.

Each request is bounded in time (the whole request, every byte of the reply, within ``timeout_s``: a server or
proxy that trickles the body stays under any per-read timeout; retried as an outage) and its reply in size (the
honest one is a small JSON naming a file, echoing the prompt's ids: a body past the limit of a one-token reply
is retried, never benches the server, so a body that never ends cannot fill this process's memory).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_assets.core.settings import OUTAGE_BUDGET_S, ConfigError
from eagle3_assets.core.storage import pid_alive
from eagle3_assets.core.verifier import verifier_shape
from eagle3_assets.hidden_states.connector_files import (
    ExtractionError,
    ExtractionStopped,
    LocalStorageError,
    local_file,
    read_connector_file,
    sweep_stale_files,
)
from eagle3_assets.hidden_states.hf_backend import BATCH_TOKENS
from eagle3_assets.local.vllm_probe import probe_models
from eagle3_assets.local.vllm_server import DEFAULT_STARTUP_TIMEOUT_S
from eagle3_assets.net.bounded_http import ReplyTooLarge, capped_openai_http_client
from eagle3_assets.net.credentials import display_url, split_credentials
from eagle3_assets.net.endpoints import EndpointPool
from eagle3_assets.net.reply_limits import reply_limit
from eagle3_assets.speculators_adapter import hidden_states_client

if TYPE_CHECKING:
    import torch

    from eagle3_assets.local.vllm_server import LocalVLLMServer

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "eagle3-verifier"


@dataclass(frozen=True)
class VLLMBackendOptions:
    """How to reach the extraction servers (see ``EAGLE3_HIDDEN_STATES_*`` in the README)."""

    urls: tuple[str, ...] = ()  # empty: start the embedded CPU vLLM on the verifier
    model: str | None = None  # served model name; None: the servers' only model
    # Where THIS process finds the connector's files: the shared volume's local mount. Required with urls (the
    # client never reads or deletes a path a reply names outside it); None with the embedded server (a temp folder).
    storage_path: str | None = None
    api_key: str | None = None
    concurrency: int = 32  # requests in flight over all servers
    timeout_s: float = 600.0  # per request
    max_attempts: int = 4  # per sample, over all servers
    bench_s: float = 10.0  # first bench of a failing server
    outage_budget_s: float = OUTAGE_BUDGET_S  # every server down this long: the run stops
    max_model_len: int = 2049  # embedded server only: max_seq_len + the one generated token
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S  # embedded server only
    # an embedded server another process started (online training's loader workers: the trainer started it), watched
    # by pid so that its death stops the run at once, as the embedded server's own backend does, not after the budget
    embedded_pid: int | None = None
    embedded_log: str | None = None


def process_gone(pid: int) -> bool:
    """Whether a process this one did not start (no handle to poll) has exited: no ``/proc`` entry, or a zombie
    its parent has not reaped yet. Without ``/proc``, ``kill(pid, 0)`` (a zombie then still looks alive)."""
    stat = Path(f"/proc/{pid}/stat")
    if not stat.parent.parent.is_dir():
        return not pid_alive(pid)
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


class _Outage(Exception):
    """An attempt failed because the server is down (its cause is the error)."""


class _Retry(Exception):
    """An attempt failed with a status that says the server is up (its cause is the error)."""


class VLLMBackend:
    """Hidden states from vLLM extraction servers; see the module docstring."""

    name = "vllm"

    def __init__(
        self,
        verifier_path: str | Path,
        layer_ids: list[int],
        store_dtype: str,
        batch_tokens: int = BATCH_TOKENS,  # the servers place the model: no device here, unlike the hf backend
        options: VLLMBackendOptions | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        # lazy: loads torch (heavy), which only this path needs
        import torch

        self.options = options or VLLMBackendOptions()
        self.layer_ids = list(layer_ids)
        self.hidden_size = verifier_shape(verifier_path).hidden_size
        self.store_dtype = getattr(torch, store_dtype)
        # many sequences per call so the servers always have `concurrency` requests to work on
        self.batch_tokens = max(batch_tokens, 4 * self.options.concurrency * 1024)
        self._say = log or logger.info
        self._server: LocalVLLMServer | None = None
        self._fatal: ExtractionStopped | None = None  # set once: every sample still waiting stops with it
        self._last_outage = "none recorded"
        self._tmp_storage: Path | None = None
        self._closing = threading.Event()  # ends the waits for connector locks of requests nobody waits for any more
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hs-vllm-client", daemon=True)
        self._thread.start()
        try:
            urls, storage = list(self.options.urls), self.options.storage_path
            if not urls:
                urls, storage = self._start_embedded(Path(verifier_path))
            elif not storage:
                raise ConfigError(
                    "EAGLE3_HIDDEN_STATES_STORAGE is empty: with extraction servers (EAGLE3_HIDDEN_STATES_URL) set "
                    "it to this machine's mount of the servers' shared_storage_path; the client reads and deletes "
                    "files only under it, never wherever a reply points"
                )
            elif Path(storage).is_dir():
                swept = sweep_stale_files(Path(storage), 2 * self.options.timeout_s)
                if swept:
                    self._say(f"hidden_states: removed {swept} stale connector file(s) from {storage}")
            self._storage = storage
            self._pool, self._clients, self._model = self._connect(urls)
        except BaseException:
            self.close()
            raise

    def _start_embedded(self, verifier_path: Path) -> tuple[list[str], str]:
        # lazy: looked up when called, so a test can replace it
        from eagle3_assets.local.extraction_server import start_extraction_server

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
        # lazy: loads openai (heavy), which only this path needs
        import openai

        # credentials inside a URL become its Authorization header; the URL itself is used (and shown) without them
        auth = dict(split_credentials(url) for url in urls)
        urls = list(auth)
        model = self.options.model
        if model is None:
            served, status = probe_models(urls[0], 5.0, self.options.api_key, authorization=auth[urls[0]])
            if status in (401, 403):
                raise ConfigError(
                    f"EAGLE3_HIDDEN_STATES_URL: {display_url(urls[0])}/models answered HTTP {status}: the extraction "
                    "server refused the API key; check EAGLE3_API_KEY (the servers' --api-key / VLLM_API_KEY)"
                )
            if not served:
                why = f"HTTP {status}" if status else "no answer"
                raise ConfigError(f"EAGLE3_HIDDEN_STATES_URL: no model list at {display_url(urls[0])}/models ({why})")
            model = served[0]
        pool = EndpointPool(urls, cap=self.options.concurrency, bench_s=self.options.bench_s, log=self._say)
        self._names = {url: display_url(url) for url in urls}

        # a one-token completion echoing the prompt's ids (and the connector's file name)
        limit = reply_limit(1, stream=False, extra_sampling={})

        async def make_clients() -> dict[str, Any]:
            # max_retries=0: retries go through the pool, which can move a sample to another server
            return {
                url: openai.AsyncOpenAI(
                    base_url=url,
                    api_key=self.options.api_key or "EMPTY",
                    max_retries=0,
                    default_headers={"Authorization": auth[url]} if auth[url] else None,
                    http_client=capped_openai_http_client(lambda request: limit.bytes_for(request.content)),
                )
                for url in urls
            }

        clients = asyncio.run_coroutine_threadsafe(make_clients(), self._loop).result()
        return pool, clients, model

    def extract(self, batch: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        future = asyncio.run_coroutine_threadsafe(self._extract_all([list(ids) for ids in batch]), self._loop)
        try:
            while (
                not future.done()
            ):  # woken up regularly so a signal's handler runs (see eagle3_assets/core/interrupts.py)
                concurrent.futures.wait([future], timeout=0.2)
            return future.result()
        except BaseException:
            future.cancel()  # a stop request: cancel the requests in flight (the sweep removes their files)
            raise

    async def _extract_all(self, batch: list[list[int]]) -> list[torch.Tensor]:
        gate = asyncio.Semaphore(self.options.concurrency)

        async def one(index: int, ids: list[int]) -> torch.Tensor:
            async with gate:
                return await self._extract_one(index, ids)

        # Every request runs to its end even when one fails: a cancelled request would still make the server
        # write a file that nobody reads and deletes. A fatal error stops the waiting ones at once (_acquire).
        results = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(batch)), return_exceptions=True)
        if self._fatal is not None:
            raise self._fatal
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)  # type: ignore[arg-type]

    def _stop(self, error: ExtractionStopped) -> ExtractionStopped:
        if self._fatal is None:
            self._fatal = error
        return self._fatal

    def _check_alive(self) -> None:
        """The embedded server's process still runs; else stop the run with its exit code and log."""
        process = getattr(self._server, "process", None)
        code = process.poll() if process is not None else None
        if code is not None:
            log = getattr(self._server, "log_path", None)
            what = f"the embedded extraction server (pid {process.pid}) exited with code {code}"
            raise self._stop(ExtractionStopped(f"{what}; log: {log}"))
        pid = self.options.embedded_pid
        if process is None and pid is not None and process_gone(pid):
            what = f"the run's embedded extraction server (pid {pid}) is gone"
            raise self._stop(ExtractionStopped(f"{what}; log: {self.options.embedded_log}"))

    async def _acquire(self) -> Any:
        while True:
            if self._fatal is not None:
                raise self._fatal
            self._check_alive()
            down = self._pool.down_for()
            if down > self.options.outage_budget_s:
                urls = ", ".join(self._names.values())
                raise self._stop(
                    ExtractionStopped(
                        f"every extraction server ({urls}) has been down for {down:.0f} s, beyond the outage budget of "
                        f"{self.options.outage_budget_s:g} s (EAGLE3_HIDDEN_STATES_OUTAGE_BUDGET_S); last error: "
                        f"{self._last_outage}. Samples already stored are kept: run the partition again once the "
                        "servers answer."
                    )
                )
            endpoint = self._pool.acquire()
            if endpoint is not None:
                return endpoint
            wait = self._pool.next_change_in()
            await asyncio.sleep(min(wait, 0.25) if wait is not None else 0.05)

    async def _extract_one(self, index: int, ids: list[int]) -> torch.Tensor:
        last: BaseException | None = None
        for _attempt in range(self.options.max_attempts):
            endpoint = await self._acquire()
            outage = False
            try:
                return await self._request(endpoint.url, index, ids)
            except _Outage as error:
                outage, last = True, error.__cause__
                self._last_outage = f"{self._names[endpoint.url]}: {type(last).__name__}: {last}"
                self._check_alive()  # a reset connection from a server that just died: say so at once
            except _Retry as error:
                last = error.__cause__
            finally:
                self._pool.release(endpoint, server_failure=outage)
        raise ExtractionError(
            f"a {len(ids)}-token sample failed {self.options.max_attempts} times over "
            f"{list(self._names.values())}: {type(last).__name__}: {last}",
            index,
        )

    async def _request(self, url: str, index: int, ids: list[int]) -> torch.Tensor:
        """One attempt; a failure is classified: malformed (fails the sample now, never benches), refused key (stops
        the run), an outage (:class:`_Outage`: retried, benches the server) or another status (:class:`_Retry`)."""
        # lazy: loads openai (heavy), which only this path needs
        import openai

        client = hidden_states_client()
        where = self._names[url]
        try:
            # the whole request within timeout_s here, whatever speculators' client bounds (the SDK's timeout is per
            # read): a trickled reply ends as a timeout, an outage like a silent server
            async with asyncio.timeout(self.options.timeout_s):
                path, _params = await client.generate_hidden_states_async(
                    self._clients[url], self._model, {"input_ids": ids}, timeout=self.options.timeout_s, max_retries=0
                )
            local = local_file(path, self._storage)
            states = await self._read_local(local, ids)
            return states.to(self.store_dtype)
        except ExtractionStopped:
            raise
        except ReplyTooLarge as error:  # the server answered, with a body that never ends: retried, never benched
            raise _Retry() from error
        except (client.InvalidResponseError, ExtractionError, openai.APIResponseValidationError) as error:
            # the server answered, with something unusable: another attempt or server would not help
            raise ExtractionError(f"{where}: a {len(ids)}-token sample: {error}", index) from error
        except (openai.AuthenticationError, openai.PermissionDeniedError) as error:
            raise self._stop(
                ExtractionStopped(
                    f"{where} refused the API key (HTTP {error.status_code}): check EAGLE3_API_KEY (the extraction "
                    "servers' --api-key / VLLM_API_KEY); samples already stored are kept"
                )
            ) from None
        except openai.BadRequestError as error:
            raise ExtractionError(f"{where} refused a {len(ids)}-token sample: {error}", index) from error
        except openai.APIStatusError as error:
            if error.status_code >= 500:
                raise _Outage() from error
            raise _Retry() from error  # 404, 408, 429...: the server is up; retried, never benched
        except TimeoutError:  # silent, or trickling a body: a timeout of the whole request
            timeout = self.options.timeout_s
            raise _Outage() from TimeoutError(f"the reply did not end within the request timeout of {timeout:g} s")
        except (openai.APIError, OSError) as error:  # refused, reset, timed out per read
            raise _Outage() from error

    async def _read_local(self, local: Path, ids: list[int]) -> torch.Tensor:
        """The connector's file for this request, read on a worker thread; an OSError there is this machine's (the
        server has answered): :class:`LocalStorageError`, never an outage retried for the outage budget."""
        n_states = len(self.layer_ids) + 1
        try:
            return await asyncio.to_thread(
                read_connector_file, local, ids, n_states, self.hidden_size, self.options.timeout_s, self._closing
            )
        except OSError as error:
            where = error.filename or local
            raise self._stop(
                LocalStorageError(
                    f"local storage error on this machine, not a server outage: {error.strerror or error} "
                    f"({errno.errorcode.get(error.errno or 0, error.errno)}) on {where}; check that {self._storage} "
                    f"(EAGLE3_HIDDEN_STATES_STORAGE) is readable and writable by this user (uid {os.getuid()}) and "
                    "has space; samples already stored are kept"
                )
            ) from error

    def close(self) -> None:
        self._closing.set()
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
