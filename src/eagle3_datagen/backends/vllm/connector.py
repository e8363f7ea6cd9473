"""The hidden-states connector vLLM loads inside its engine (`kv_connector_module_path`).

vLLM 0.32.0's `ExampleHiddenStatesConnector` writes each finished request's states from the
`extract_hidden_states` cache to `{shared_storage_path}/{request id}.safetensors` (`hidden_states`
[T, layers, H], `token_ids` [T]), copying them on a CUDA stream into pinned memory, which fails on a CPU
(`pin_memory` needs CUDA). This subclass copies them on the calling thread instead, the cache already
in host memory; what it writes, the lock file protocol and the scheduler's side are the example's.
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


class _Copied:
    """Stands for the example's CUDA event once the copy is done: `get_finished` polls `query()` and the
    writer thread calls `synchronize()`."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` without CUDA streams: the copy is a plain `clone()` of the cache's slots."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slot_mapping.to(self._kv_cache.device), len(pending.token_ids))
        tensors = {"hidden_states": states.to("cpu", copy=True).contiguous(), "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        copied = _Copied()
        future = self._executor.submit(self._write_tensors, tensors, copied, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = copied
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
