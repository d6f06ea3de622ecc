"""NPUTieringOffloadingSpec's pieces without an engine: identity, verified
files, configuration errors, the region's registration."""

from __future__ import annotations

import dataclasses
import mmap
import os
from types import SimpleNamespace

import pytest
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingModelConfig,
)

from tests.unit.conftest import TIERING, new_engine_id
from tests.unit.kv_helpers import cpu_queues, make_config, make_kv_caches
from tests.unit.tier_helpers import refusal, tiering_spec
from tests.vllm_version import VLLM_VERSION
from vllm_ascend.kv_offload import ops, region_worker
from vllm_ascend.kv_offload.acl_host import kernel_registers_pageable_memory
from vllm_ascend.kv_offload.config import OffloadConfigError, check_keys
from vllm_ascend.kv_offload.connector import our_spec_class
from vllm_ascend.kv_offload.npu import NPUOffloadingSpec
from vllm_ascend.kv_offload.region import (
    AclRegionRegistration,
    close_region,
    region_path,
    register_with_cuda,
    slot_pool,
)
from vllm_ascend.kv_offload.self_check import SelfCheckResult
from vllm_ascend.kv_offload.tiering.identity import identity_digest, storage_identity
from vllm_ascend.kv_offload.tiering.spec import (
    NPUTieringOffloadingSpec,
    check_tiering_config,
)


def offloading_config(tp: int = 1, dtype: str = "float32", **changes):
    config = make_config({}, worker_kv_bytes_per_block=65536 // tp, world_size=tp)
    changes.setdefault("model", OffloadingModelConfig("/nonexistent/model", dtype))
    return dataclasses.replace(config, **changes)


def digest(config, device="cpu") -> str:
    return identity_digest(storage_identity(config, device, None))


def test_identity_separates_what_makes_bytes_incompatible():
    """TP sizes among them: a per-rank row of this package's worker differs
    between TP 1 and TP 2, wherever vLLM's fs tier would put the files."""
    base = digest(offloading_config())
    assert digest(offloading_config()) == base  # deterministic
    assert digest(offloading_config(), device="npu") != base
    for changed in (
        {"tp": 2},
        {"dtype": "bfloat16"},
        {"kv_cache_layout": "HND"},
        {"model": OffloadingModelConfig("/other", "float32")},
        {"cache": OffloadingCacheConfig(128, 2)},
    ):
        assert digest(offloading_config(**changed)) != base, changed


# -- configuration ------------------------------------------------------------

FS_TIER = {"type": "fs", "root_dir": "/x"}


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"canonical_layout": True}, "canonical_layout"),
        ({"store_threshold": 2}, "store_threshold"),
        ({"secondary_tiers": {"type": "fs"}}, "must be a list"),
        ({"secondary_tiers": [{"root_dir": "/x"}]}, "with a 'type'"),
        ({"secondary_tiers": [{"type": "fs"}]}, "needs 'root_dir'"),
        ({"backpressure": 1}, "must be a dict"),
        # The fs tier's size bound: a positive integer, on the fs tier only.
        *[
            ({"secondary_tiers": [{**FS_TIER, "max_bytes": v}]}, r"\['max_bytes'\]")
            for v in (0, -1, 1.5, "10GiB", True, None)
        ],
        ({"secondary_tiers": [{"type": "obj", "max_bytes": 2**30}]}, "fs tier"),
        # The fs tier's shared id and key: on the fs tier only.
        *[
            ({"secondary_tiers": [{"type": "obj", k: "x"}]}, "read by 'fs' tiers only")
            for k in ("identity", "auth_key_file")
        ],
    ],
)
def test_what_the_spec_cannot_do_is_refused(extra, message):
    """Both start-up checks of the spec: its keys, then what it cannot do."""
    with pytest.raises(OffloadConfigError, match=message):
        config = {**TIERING, **extra}
        check_keys(config, NPUTieringOffloadingSpec.extra_config_keys)
        check_tiering_config(config)


class CustomTieringSpec(NPUTieringOffloadingSpec):
    """A deployment's own subclass of the tiering spec."""


def test_tiering_keys_need_the_tiering_spec_or_a_subclass():
    """Our connector serves both; subclasses of our specs are ours
    everywhere names are checked."""
    tiers = [FS_TIER]
    custom = {"spec_name": "CustomTieringSpec", "spec_module_path": __name__}
    npu = {
        "spec_name": "NPUOffloadingSpec",
        "spec_module_path": "vllm_ascend.kv_offload.npu",
    }
    assert our_spec_class(TIERING) is NPUTieringOffloadingSpec
    assert our_spec_class(custom) is CustomTieringSpec
    assert our_spec_class(npu) is NPUOffloadingSpec
    for spec in (TIERING, custom):
        check_keys({**spec, "secondary_tiers": tiers}, spec_keys(spec))
    with pytest.raises(OffloadConfigError, match=r"Spec only \(or a subclass"):
        check_keys({**npu, "secondary_tiers": tiers}, spec_keys(npu))


def spec_keys(extra: dict) -> frozenset:
    """The extra-config keys the spec ``extra`` names accepts."""
    return our_spec_class(extra).extra_config_keys


# -- registering the region: npu (ACL, through our op) and cuda (vLLM's) ----


def _kv_caches(device_type: str, page: int):
    tensor = SimpleNamespace(device=SimpleNamespace(type=device_type))
    return SimpleNamespace(
        tensors=[SimpleNamespace(tensor=tensor, page_size_bytes=page)]
    )


def _passed_self_check(device, page_sizes, pool, paths, **kwargs) -> SelfCheckResult:
    # Device, memory kind, path, passed, failure, GB/s, bytes, seconds.
    return SelfCheckResult(
        str(device), pool.memory.kind, paths[0].name, True, None, 0.0, 0, 0.0,
        swap=lambda src, dst, sizes: (0, None),  # never called: no copies here
    )  # fmt: skip


def test_the_tiering_worker_copies_by_the_copy_path_setting():
    """copy_path applies to the tiering spec's worker as to the guide's (it
    was ignored: the worker always chose as for "auto")."""
    page = mmap.PAGESIZE
    engine_id = new_engine_id("unit-cpu")
    spec = tiering_spec(engine_id, 2 * page, copy_path="torch")
    worker = spec.get_worker(make_kv_caches(4, [page]))
    try:
        assert worker.copy_path == "torch"
    finally:
        worker.shutdown()
    assert not os.path.exists(region_path(engine_id))


@pytest.fixture
def kernel_release(monkeypatch):
    """Sets the kernel release this process reports (``os.uname``)."""

    def pretend(release: str) -> None:
        real = os.uname()
        fake = os.uname_result((real.sysname, real.nodename, release, *real[3:]))
        monkeypatch.setattr(os, "uname", lambda: fake)

    return pretend


@pytest.fixture
def acl_calls(monkeypatch, kernel_release):
    """ops.host_register / host_unregister replaced by recorders (no NPU
    here); the tiering worker built with no copy engine, CPU queues and no
    self-check (no npu streams here), through its constructor's arguments."""
    calls = []

    def register(addr, size, device, flags):
        calls.append(("register", addr, size, device))

    def unregister(addr, device):
        path = calls[0][4] if len(calls[0]) > 4 else None
        calls.append(("unregister", addr, device, os.path.exists(path or "")))

    def worker(*args, real=region_worker.RegionWorker, **kwargs):
        engine = SimpleNamespace(use=lambda swap: None, buffers=lambda: [])
        queues, check = cpu_queues(), _passed_self_check
        return real(*args, engine=engine, queues=queues, self_check=check, **kwargs)

    monkeypatch.setattr(ops, "host_register", register)
    monkeypatch.setattr(ops, "host_unregister", unregister)
    monkeypatch.setattr(region_worker, "RegionWorker", worker)
    kernel_release("6.8.0-generic")
    return calls


def test_npu_worker_registers_the_region_and_unregisters_it_before_unmapping(
    acl_calls,
):
    page = mmap.PAGESIZE
    spec = tiering_spec(new_engine_id("unit-npu"), 2 * page)
    worker = spec.get_worker(_kv_caches("npu", page))
    region = worker.region
    base, size = region.base_tensor.data_ptr(), region.total_size_bytes
    assert acl_calls == [("register", base, size, "npu")]
    assert size == 4 * 2 * page and worker.pool.pinned
    acl_calls[0] += (region.mmap_path,)  # unregister checks the file is there
    worker.shutdown()
    # Unregistered once, while the region was still mapped; then unmapped.
    assert acl_calls[1] == ("unregister", base, "npu", True)
    assert len(acl_calls) == 2
    assert region.mmap_obj is None and not os.path.exists(region.mmap_path)


def test_npu_region_is_registered_in_pieces_smaller_where_refused_mapped_on_a5(
    acl_calls, monkeypatch
):
    """The pool's rule for the region: pieces of whole rows of at most
    host_piece_bytes; a piece the runtime refuses is retried at half its
    size; where PINNED is refused (A5), MAPPED alone. Every piece is
    unregistered before the region is unmapped."""
    mapped, pinned, limit = 0x2, 0x10000000, 64 * 2**10
    flags_seen = []

    def register(addr, size, device, flags):
        flags_seen.append(flags)
        if flags & pinned:
            raise RuntimeError("ACL error 107000 (PINNED, as on A5)")
        if size > limit:
            raise RuntimeError("ACL error 207001 (more than the runtime takes)")
        acl_calls.append(("register", addr, size, device))

    monkeypatch.setattr(ops, "host_register", register)
    page = 8192
    spec = tiering_spec(new_engine_id("unit-npu"), page, 64, host_piece_bytes=2 * limit)
    worker = spec.get_worker(_kv_caches("npu", page // 2))
    region = worker.region
    base = region.base_tensor.data_ptr()
    assert region.total_size_bytes == 64 * page == 8 * limit
    # 128 KiB pieces refused, 64 KiB pieces taken: whole rows, back to back.
    assert acl_calls == [("register", base + i * limit, limit, "npu") for i in range(8)]
    # 128 KiB: PINNED refused, MAPPED too (size); 64 KiB: PINNED refused,
    # MAPPED taken, and from then on PINNED is not asked for again.
    both = mapped | pinned
    assert flags_seen == [both, mapped, both, mapped] + [mapped] * 7
    assert worker.pool.pinned
    worker.shutdown()
    unregistered = [c[1] for c in acl_calls[8:]]
    assert unregistered == [base + i * limit for i in reversed(range(8))]
    assert region.mmap_obj is None


ACL_REFUSED = "kv_offload_host_register(device='npu'): ACL error 507899"


@pytest.mark.parametrize(
    "release, acl_error, wrong",
    [
        ("6.8.0-generic", ACL_REFUSED, ["registering the shared region",
         "ACL error 507899", "aclrtHostRegisterV2", "spec_name='NPUOffloadingSpec'"]),
        ("5.10.0-60.18.0.50.oe2203", None, ["newer than 5.10 only"]),
    ],
    ids=["acl-refuses", "kernel-cannot-lock-pageable-memory"],
)  # fmt: skip
def test_a_refused_npu_registration_is_a_clear_error_and_leaves_nothing(
    acl_calls, kernel_release, monkeypatch, release, acl_error, wrong
):
    def refuse(addr, size, device, flags):
        raise RuntimeError(acl_error)

    kernel_release(release)
    monkeypatch.setattr(ops, "host_register", refuse)
    page = mmap.PAGESIZE
    engine_id = new_engine_id("unit-npu")
    spec = tiering_spec(engine_id, 2 * page)
    msg = refusal(lambda: spec.get_worker(_kv_caches("npu", page)))
    assert all(w in msg for w in wrong), msg
    assert not os.path.exists(region_path(engine_id))
    assert acl_calls == []  # nothing registered, nothing to unregister
    assert kernel_registers_pageable_memory("5.15.0-91-generic")
    assert kernel_registers_pageable_memory("6.1.0")
    assert not kernel_registers_pageable_memory("4.19.90-24.4.v2101.ky10")


def test_a_failing_unregister_is_logged_and_the_region_still_unmapped(
    caplog, shared_region
):
    page = mmap.PAGESIZE
    region, mark = shared_region(2, kv_bytes_per_chunk=page, cpu_page_size=page)

    def unregister(addr, device):
        raise RuntimeError("ACL error 507911")

    registration = AclRegionRegistration(
        region,
        register=lambda addr, size, device, flags: None,
        unregister=unregister,
        kernel_release="6.1",
    )
    close_region(region, registration, mark)
    assert "unregistering the shared region" in caplog.text
    assert "ACL error 507911" in caplog.text
    assert region.mmap_obj is None and not os.path.exists(region.mmap_path)
    registration.release()  # once only: nothing happens


# vLLM's own pin_mmap_region/cleanup, as the installed release does them:
# 0.32 moved them onto host_register/host_unregister (intercepted here);
# 0.30 (one torch.cuda.cudart() call) and 0.31 (CudaRTLibrary chunks) call the
# CUDA runtime directly, and only on a CUDA platform.
@pytest.mark.skipif(
    VLLM_VERSION < (0, 32),
    reason="vLLM < 0.32 registers through the CUDA runtime directly, only on "
    "a CUDA platform (no host_register/host_unregister to intercept)",
)
def test_cuda_registration_is_vllms_pin_mmap_region(monkeypatch, shared_region):
    """On cuda the region is registered by vLLM's own pin_mmap_region (row-
    aligned chunks) and unregistered by the region's cleanup before unmap."""
    from vllm.utils import torch_utils
    from vllm.v1.kv_offload.cpu import gpu_worker, shared_offload_region

    calls = []

    def register(addr, size):
        calls.append(("register", addr, size))
        return True

    def unregister(addr):
        calls.append(("unregister", addr, region.mmap_obj is not None))

    monkeypatch.setattr(torch_utils, "PIN_MEMORY", True)
    monkeypatch.setattr(gpu_worker, "host_register", register)
    monkeypatch.setattr(shared_offload_region, "host_unregister", unregister)
    page = mmap.PAGESIZE
    # Chunks of 2 rows, as vLLM cuts 64 GiB ones: 3 chunks for 5 rows.
    monkeypatch.setattr(gpu_worker, "MAX_HOST_REGISTER_CHUNK_BYTES", 2 * page)
    region, mark = shared_region(5, kv_bytes_per_chunk=page, cpu_page_size=page)
    base = region.base_tensor.data_ptr()
    pool = slot_pool(region, [page], 1, 0, page, page)
    register_with_cuda(region, pool)
    assert calls == [
        ("register", base, 2 * page),
        ("register", base + 2 * page, 2 * page),
        ("register", base + 4 * page, page),
    ]
    assert pool.pinned and region.is_pinned
    close_region(region, None, mark)
    assert calls[3:] == [
        ("unregister", base + 4 * page, True),
        ("unregister", base + 2 * page, True),
        ("unregister", base, True),
    ]
