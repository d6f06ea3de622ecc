"""The ways the worker can copy a job's fragments, best first.

* ``native-batch``: our native op as built (npu: ``aclrtMemcpyBatchAsync``;
  cuda: the copy kernel or ``cudaMemcpyBatchAsync``).
* ``native-per-copy``: the same op, one async memcpy per merged copy
  (``ops.set_per_copy``), for a runtime whose batch call misbehaves.
* ``native`` (cpu): the op's multi-threaded memcpy; ``python``: the op's
  pure-Python fallback, when the op is not built.
* ``torch``: public torch calls only (``torch_copy.py``), on any device.

``candidate_paths`` lists those a device can try, in the order the start-up
self-check tries them (``self_check.py``); ``copy_path`` in
``kv_connector_extra_config`` ("auto", "native", "torch") narrows the list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from vllm_ascend.kv_offload import ops
from vllm_ascend.kv_offload.config import PREFIX, OffloadConfigError
from vllm_ascend.kv_offload.torch_copy import TorchCopier

# (src_addrs, dst_addrs, sizes) -> (copies, what must live until they complete)
Swap = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[int, object]]

NATIVE_BATCH = "native-batch"
NATIVE_PER_COPY = "native-per-copy"
NATIVE_CPU = "native"
PYTHON = "python"
TORCH = "torch"
SETTINGS = ("auto", "native", "torch")


@dataclass(frozen=True)
class CopyPath:
    """One way to copy on ``device_type``; ``bind`` makes its copy function
    over the buffers a job may touch (the torch path needs them)."""

    name: str
    device_type: str

    def bind(self, buffers: Iterable[torch.Tensor]) -> Swap:
        device = self.device_type
        if self.name == TORCH:
            return TorchCopier(buffers).swap
        if self.name == PYTHON:
            return lambda s, d, n: ops.fallback_swap_blocks_batch(s, d, n, device)
        if self.name in (NATIVE_BATCH, NATIVE_PER_COPY):
            # Process-wide, like the op's own switch to the per-copy loop.
            ops.set_per_copy(device, self.name == NATIVE_PER_COPY)
        return lambda s, d, n: ops.swap_blocks_batch(s, d, n, device)

    @property
    def native(self) -> bool:
        return self.name != TORCH


def native_paths(device_type: str) -> list[CopyPath]:
    """What the native op (or its fallback) offers on ``device_type``."""
    if device_type == "cpu":
        names = [NATIVE_CPU, PYTHON] if ops.HAS_NATIVE_OP else [PYTHON]
    elif device_type in ops.native_backends():
        names = [NATIVE_BATCH, NATIVE_PER_COPY]
    else:
        names = []
    return [CopyPath(n, device_type) for n in names]


def candidate_paths(device_type: str, setting: str = "auto") -> Sequence[CopyPath]:
    """The paths to try, best first, for the ``copy_path`` setting."""
    if setting not in SETTINGS:
        raise OffloadConfigError(
            f"{PREFIX}['copy_path']={setting!r} is not supported; use one of "
            f"{', '.join(SETTINGS)}"
        )
    torch_path = [CopyPath(TORCH, device_type)]
    if setting == "torch":
        return torch_path
    native = native_paths(device_type)
    if setting == "native" and not native:
        raise OffloadConfigError(
            f"{PREFIX}['copy_path']='native', but the native op has no "
            f"'{device_type}' backend here (compiled: "
            f"{', '.join(ops.native_backends()) or 'none'}); build it with "
            "`pip install --no-build-isolation -e .` on this machine, or set "
            "copy_path='auto' (falls back to the torch path)"
        )
    return native if setting == "native" else native + torch_path
