"""Batched raw-memory copies for KV offloading: the native op, and its
validation and merging of adjacent fragments in numpy (``coalesce``).

``swap_blocks_batch(src_addrs, dst_addrs, sizes, device, per_copy=False)
-> (copies, workspace)`` copies fragment i, ``sizes[i]`` bytes, from address
``src_addrs[i]`` to ``dst_addrs[i]`` (1-D contiguous CPU int64 tensors of
equal length), merging runs of fragments adjacent on both sides first;
``copies`` counts the copies performed. Keep ``workspace`` (host memory the
"npu" batch API may still read; empty on "cpu") until the copies have
completed, not merely until the call returns. ``per_copy`` ("npu"): one
async memcpy per copy instead of the batch call, for this call only. CUDA
copies with vLLM's own op (``copy_paths.py``). The contract (validation,
backends, threading) is ``csrc/kv_offload/ops.h``.

The native op ``torch.ops._C_ascend.kv_offload_swap_blocks`` comes from the
extension ``vllm_ascend.kv_offload._C_kv_offload`` (``pip install
--no-build-isolation -e .``), or from upstream vllm-ascend's own library when
this subtree is grafted into it (docs/upstream_graft.md). Without it, or with
``VLLM_ASCEND_NATIVE_OP=0``, ``swap_blocks_batch`` raises, saying why, and
the worker copies on the torch path (``copy_paths.TorchCopier``: ``coalesce``,
then one tensor copy per merged copy), which its start-up self-check binds.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable

import numpy as np
import torch

_UINT64_MAX = np.uint64(np.iinfo(np.uint64).max)
_BUILD_HINT = "build it with `pip install --no-build-isolation -e .`"

_SwapFn = Callable[..., tuple[int, torch.Tensor]]


@functools.cache
def _native() -> tuple[_SwapFn | None, tuple[str, ...], str | None]:
    """(op, compiled backends, why the op is not in use or None). Loaded on
    first use: a process that never copies (the scheduler's, the API
    server's) does not load the library."""
    if os.environ.get("VLLM_ASCEND_NATIVE_OP", "1") == "0":
        return None, (), "VLLM_ASCEND_NATIVE_OP=0 is set"
    missing = None
    try:
        # Standalone build: loading the library registers the ops.
        from vllm_ascend.kv_offload import _C_kv_offload  # noqa: F401
    except ImportError as e:
        missing = f"vllm_ascend.kv_offload._C_kv_offload is not importable ({e})"
        # Grafted into upstream vllm-ascend: its library carries the ops.
        with contextlib.suppress(ImportError):
            import vllm_ascend.vllm_ascend_C  # noqa: F401
    namespace = torch.ops._C_ascend
    if not hasattr(namespace, "kv_offload_swap_blocks"):
        return None, (), f"{missing or 'the op is not registered'}; {_BUILD_HINT}"
    # The exact overload: the namespace is shared with upstream's ops, and the
    # OpOverload skips the packet's overload resolution on every call.
    return (
        namespace.kv_offload_swap_blocks.default,
        tuple(namespace.kv_offload_backends.default()),
        None,
    )


def __getattr__(name: str) -> bool:
    # HAS_NATIVE_OP: whether the native op is in use (loads it on first read).
    if name == "HAS_NATIVE_OP":
        return _native()[0] is not None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fallback_reason() -> str | None:
    """Why the native op is not in use (None when it is)."""
    return _native()[2]


def native_backends() -> tuple[str, ...]:
    """Backends compiled into the native op in use; () when falling back."""
    return _native()[1]


def swap_blocks_batch(
    src_addrs: torch.Tensor,
    dst_addrs: torch.Tensor,
    sizes: torch.Tensor,
    device: str,
    per_copy: bool = False,
) -> tuple[int, torch.Tensor]:
    """The native op on ``device`` ("cpu", "npu"): the module docstring."""
    return native_swap(device, per_copy)(src_addrs, dst_addrs, sizes)


def native_swap(device: str, per_copy: bool = False) -> _SwapFn:
    """``swap_blocks_batch`` with ``device`` and ``per_copy`` bound: the op
    itself (no Python frame of ours per call). Raises RuntimeError, saying
    why, when the native op is not in use."""
    native_op, _, reason = _native()
    if native_op is None:
        raise RuntimeError(
            f"swap_blocks_batch: the native op is not in use ({reason}); "
            "without it KV offloading copies on the torch path "
            "(copy_paths.TorchCopier)"
        )
    return functools.partial(native_op, device=device, per_copy=per_copy)


def _host_register_op(name: str):
    native_op, _, reason = _native()
    op = getattr(torch.ops._C_ascend, f"kv_offload_host_{name}", None)
    if native_op is None or op is None:
        raise RuntimeError(
            f"kv_offload_host_{name} needs the native extension "
            f"vllm_ascend.kv_offload._C_kv_offload with the npu backend; "
            f"{_BUILD_HINT} on a machine with torch_npu "
            f"({reason or 'this build predates the op'})"
        )
    return op.default


def host_register(addr: int, size: int, device: str, flags: int = 0x10000002) -> None:
    """Makes the existing host range ``[addr, addr + size)`` page-locked memory
    that ``device``'s copy backend accepts ("npu": aclrtHostRegisterV2 with
    ``flags``, by default ACL_HOST_REG_MAPPED | ACL_HOST_REG_PINNED; A5 takes
    MAPPED, 0x2, alone); raises RuntimeError naming the range and the ACL
    error. Contract: ``kv_offload_host_register`` in ``csrc/kv_offload/ops.h``."""
    _host_register_op("register")(addr, size, device, flags)


def host_unregister(addr: int, device: str) -> None:
    """Undoes ``host_register(addr, ...)``: after every copy from or to the
    range has completed, before it is unmapped."""
    _host_register_op("unregister")(addr, device)


def host_alloc(size: int, device: str) -> int:
    """Exact-size page-locked host memory ("npu": aclrtMallocHost); returns
    its address. Contract: ``kv_offload_host_alloc`` in ``ops.h``."""
    return int(_host_register_op("alloc")(size, device))


def host_free(addr: int, device: str) -> None:
    """Frees memory from ``host_alloc`` once no copy uses it any more."""
    _host_register_op("free")(addr, device)


def _check_descriptor(t: torch.Tensor, name: str) -> None:
    # Same checks and wording as check_descriptor() in csrc/kv_offload/dispatch.cpp.
    prefix = f"swap_blocks_batch: {name} must be"
    if t.device.type != "cpu":
        raise RuntimeError(
            f"{prefix} a CPU tensor (got {t.device}); descriptors always live on "
            "the host, build them with device='cpu'"
        )
    if t.dtype != torch.int64:
        raise RuntimeError(
            f"{prefix} an int64 tensor (got {t.dtype}); build it with dtype=torch.int64"
        )
    if t.dim() != 1:
        raise RuntimeError(f"{prefix} 1-D (got {t.dim()}-D); flatten it with .view(-1)")
    if not t.is_contiguous():
        raise RuntimeError(f"{prefix} contiguous; call .contiguous() on it first")


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def check_disjoint(
    src: np.ndarray, dst: np.ndarray, size: np.ndarray, first: np.ndarray, device: str
) -> None:
    """Raises, as the op's "cpu" backend does, if a merged copy's source and
    destination overlap (``coalesce``'s arrays)."""
    overlap = (src < dst + size) & (dst < src + size)
    if overlap.any():
        j = _first(overlap)
        raise RuntimeError(
            f"swap_blocks_batch(device='{device}'): source and destination of "
            f"fragment {first[j]} (after merging adjacent fragments) overlap "
            f"(src_addrs={src[j]}, dst_addrs={dst[j]}, bytes={size[j]}); "
            "source and destination ranges must be disjoint"
        )


def coalesce(
    src_addrs: torch.Tensor, dst_addrs: torch.Tensor, sizes: torch.Tensor
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The op's validation and merging of adjacent fragments, in numpy:
    ``(src, dst, size)`` uint64 arrays of the copies to perform, and the
    index of each copy's first fragment. Raises
    RuntimeError with the op's wording (``dispatch.cpp``) for a bad batch."""
    _check_descriptor(src_addrs, "src_addrs")
    _check_descriptor(dst_addrs, "dst_addrs")
    _check_descriptor(sizes, "sizes")
    n = sizes.numel()
    if src_addrs.numel() != n or dst_addrs.numel() != n:
        raise RuntimeError(
            "swap_blocks_batch: src_addrs, dst_addrs and sizes must have the same "
            f"length (got {src_addrs.numel()}, {dst_addrs.numel()}, {n}); pass "
            "exactly one entry per fragment in each"
        )
    empty = np.empty(0, dtype=np.uint64)
    if n == 0:
        return empty, empty, empty, np.empty(0, dtype=np.int64)
    # Addresses are unsigned; int64 is only the transport type.
    src = src_addrs.numpy().view(np.uint64)
    dst = dst_addrs.numpy().view(np.uint64)
    signed_size = sizes.numpy()
    if (signed_size <= 0).any():
        i = _first(signed_size <= 0)
        raise RuntimeError(
            f"swap_blocks_batch: sizes[{i}] = {signed_size[i]} but every size must "
            "be > 0; drop empty fragments first"
        )
    size = signed_size.view(np.uint64)
    for name, addrs in (("src_addrs", src), ("dst_addrs", dst)):
        if (addrs == 0).any():
            raise RuntimeError(
                f"swap_blocks_batch: {name}[{_first(addrs == 0)}] is a null address; "
                "pass the data_ptr() of an allocated buffer"
            )
    wraps = (src > _UINT64_MAX - size) | (dst > _UINT64_MAX - size)
    if wraps.any():
        i = _first(wraps)
        raise RuntimeError(
            f"swap_blocks_batch: fragment {i} wraps around the end of the address "
            f"space (src_addrs={src[i]}, dst_addrs={dst[i]}, sizes={size[i]}); "
            "check the address arithmetic"
        )

    # Same check as coalesce() in dispatch.cpp: byte counts are uint64 and
    # must not wrap. Each size is < 2^63, so a running sum wraps at most once
    # per step, and a wrap shows as a decrease.
    running = np.cumsum(size, dtype=np.uint64)
    wrapped = running[1:] < running[:-1]
    if wrapped.any():
        i = _first(wrapped) + 1
        raise RuntimeError(
            "swap_blocks_batch: the sizes add up to more than 2^64 - 1 bytes at "
            f"fragment {i} (sizes[{i}]={size[i]}); no batch can copy more than "
            "the address space holds, check the sizes"
        )

    # A fragment starts a new copy unless it continues the previous one on
    # both sides; chains of continuations merge into one copy.
    src_end, dst_end = src[:-1] + size[:-1], dst[:-1] + size[:-1]
    starts_copy = np.concatenate(([True], (src[1:] != src_end) | (dst[1:] != dst_end)))
    first = np.flatnonzero(starts_copy)
    m_src, m_dst = src[first], dst[first]
    m_size = np.add.reduceat(size, first)

    return m_src, m_dst, m_size, first
