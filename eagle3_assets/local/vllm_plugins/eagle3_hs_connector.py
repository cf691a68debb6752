"""A hidden-states KV connector for vLLM's ``extract_hidden_states`` method that also runs on a CPU build.

This file is imported INSIDE the vLLM server process (its own virtualenv, without this project installed): the
local server manager puts this folder on the server's ``PYTHONPATH`` and names the module in
``--kv-transfer-config`` (``"kv_connector_module_path": "eagle3_hs_connector"``). So it imports nothing from
``eagle3_assets``.

vLLM's stock ``ExampleHiddenStatesConnector`` copies each finished request's states device-to-host on a CUDA
stream into pinned memory and polls a CUDA event. On a CPU build both fail: pinning memory needs an accelerator,
and ``torch.cuda.Event`` is a placeholder whose ``query()`` raises. The states already live in host memory there,
so this subclass slices them out of the cache, copies them, and hands the write to the stock writer threads with an
event that is already complete. Everything else (file naming, the ``.lock`` handshake that lets a client wait for
the write, ``kv_transfer_params.hidden_states_path`` in the response) is the stock connector's. On a CUDA device
the stock path runs unchanged.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _CompletedEvent:
    """Stands in for the CUDA copy-done event: the host copy finished before the event was made."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


# Every file this connector writes is named ``eagle3-hs-<request id>.safetensors`` (the stock connector: ``<request
# id>.safetensors``), so the client's sweep of stale files (hidden_states/connector_files.py CONNECTOR_FILE_PREFIX,
# spelled again here: this module imports nothing from eagle3_assets) touches nothing else in the folder.
FILE_PREFIX = "eagle3-hs-"


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` without pinned memory or CUDA events when the cache is in host memory, whose
    files carry this project's name prefix."""

    def build_connector_meta(self, scheduler_output):  # type: ignore[no-untyped-def]
        meta = super().build_connector_meta(scheduler_output)
        for req_id, filename in list(meta.new_req_filenames.items()):
            # the default name only, never a custom path
            if filename == os.path.join(self._storage_path, f"{req_id}.safetensors"):
                ours = os.path.join(self._storage_path, f"{FILE_PREFIX}{req_id}.safetensors")
                meta.new_req_filenames[req_id] = ours
                self._request_filenames[req_id] = ours
        return meta

    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.device.type == "cuda":
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        # clone: the blocks are freed (and reused) as soon as get_finished reports the request done
        states = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens).clone()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        if pending.req_id in self._req_futures:
            raise RuntimeError(f"a hidden-states write for request {pending.req_id} is already in flight")
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _CompletedEvent()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done  # type: ignore[assignment]
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
