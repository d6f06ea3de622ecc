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
    region_path,
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
SHARED_ID_REFUSED = r"\['secondary_tiers'\]\[0\]\['identity'\]=.*my-deployment-v3"


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
        # A shared id: named by its setting, with an example of a good one.
        *[
            ({"secondary_tiers": [{**FS_TIER, "identity": bad}]}, SHARED_ID_REFUSED)
            for bad in ("", " dep", "dep/v3", "a" * 129, 3, ["dep"])
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
        keys = our_spec_class(spec).extra_config_keys
        check_keys({**spec, "secondary_tiers": tiers}, keys)
    with pytest.raises(OffloadConfigError, match=r"Spec only \(or a subclass"):
        check_keys(
            {**npu, "secondary_tiers": tiers}, NPUOffloadingSpec.extra_config_keys
        )


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


MAPPED, PINNED = 0x2, 0x10000000  # ACL_HOST_REG_MAPPED, ACL_HOST_REG_PINNED


@pytest.fixture
def acl(monkeypatch):
    """ops.host_register / host_unregister replaced by recorders (no NPU
    here) of the region of engine ``acl.engine_id``: ``calls``, the
    ``flags`` asked for; ``refuse(size, flags)`` names an ACL error to raise
    or None, ``unregister_error`` one for every unregister;
    ``kernel_release(release)`` sets what ``os.uname`` reports. The tiering
    worker built with no copy engine, CPU queues and no self-check (no npu
    streams here), through its constructor's arguments."""
    acl = SimpleNamespace(calls=[], flags=[], refuse=lambda size, flags: None)
    acl.unregister_error = None
    acl.engine_id = new_engine_id("unit-npu")

    def register(addr, size, device, flags):
        acl.flags.append(flags)
        if error := acl.refuse(size, flags):
            raise RuntimeError(error)
        acl.calls.append(("register", addr, size, device))
        return True  # taken (what vLLM's host_register says)

    def unregister(addr, device):  # and whether the region is still mapped
        acl.calls.append(("unregister", addr, device, acl.region.mmap_obj is not None))
        if acl.unregister_error:
            raise RuntimeError(acl.unregister_error)

    def worker(kv_caches, region, *args, real=region_worker.RegionWorker, **kw):
        acl.region = region
        engine = SimpleNamespace(use=lambda swap: None, buffers=lambda: [])
        queues, check = cpu_queues(), _passed_self_check
        kw.update(engine=engine, queues=queues, self_check=check)
        return real(kv_caches, region, *args, **kw)

    def kernel_release(release: str) -> None:
        real = os.uname()
        fake = os.uname_result((real.sysname, real.nodename, release, *real[3:]))
        monkeypatch.setattr(os, "uname", lambda: fake)

    acl.register, acl.unregister = register, unregister
    acl.kernel_release = kernel_release
    monkeypatch.setattr(ops, "host_register", register)
    monkeypatch.setattr(ops, "host_unregister", unregister)
    monkeypatch.setattr(region_worker, "RegionWorker", worker)
    kernel_release("6.8.0-generic")
    return acl


ROW = 8192  # the region's: 64 rows, 512 KiB
PIECE = 64 << 10  # what the runtime takes at most a piece on A5


# cuda: vLLM's own pin_mmap_region/cleanup, as the installed release does
# them: 0.32 moved them onto host_register/host_unregister (intercepted
# here); 0.30 (one torch.cuda.cudart() call) and 0.31 (CudaRTLibrary chunks)
# call the CUDA runtime directly, and only on a CUDA platform.
@pytest.mark.parametrize(
    "device, on_a5, step, flags, unregister_error",
    [
        ("npu", False, 64 * ROW, [MAPPED | PINNED], None),
        # 128 KiB: PINNED refused, MAPPED too (size); 64 KiB: PINNED
        # refused, MAPPED taken, and from then on PINNED is not asked for.
        ("npu", True, PIECE, [MAPPED | PINNED, MAPPED] * 2 + [MAPPED] * 7, None),
        ("npu", False, 64 * ROW, [MAPPED | PINNED], "ACL error 507911"),
        # Chunks of 24 rows: 3 for 64 rows, the last short.
        pytest.param("cuda", False, 3 * PIECE, [0] * 3, None, marks=pytest.mark.skipif(
            VLLM_VERSION < (0, 32),
            reason="vLLM < 0.32 registers through the CUDA runtime directly, "
            "only on a CUDA platform (no host_register/host_unregister to "
            "intercept)",
        )),
    ],
    ids=["npu", "npu-a5", "npu-unregister-fails", "cuda"],
)  # fmt: skip
def test_the_region_is_registered_in_pieces_unregistered_before_unmapping(
    acl, monkeypatch, caplog, device, on_a5, step, flags, unregister_error
):
    """npu: the pool's rule for the region: pieces of whole rows of at most
    host_piece_bytes; a piece the runtime refuses is retried at half its
    size; where PINNED is refused (A5), MAPPED alone. cuda: vLLM's own
    pin_mmap_region (row-aligned chunks). Every piece is unregistered while
    the region is still mapped, then it is unmapped (a failing unregister
    logged)."""
    acl.unregister_error = unregister_error
    if on_a5:  # 128 KiB pieces asked for
        acl.refuse = lambda size, flags: (
            "ACL error 107000 (PINNED, as on A5)" if flags & PINNED
            else "ACL error 207001 (more than the runtime takes)" if size > PIECE
            else None
        )  # fmt: skip
    if device == "cuda":  # vLLM's calls into the recorders
        from vllm.utils import torch_utils
        from vllm.v1.kv_offload.cpu import gpu_worker, shared_offload_region

        monkeypatch.setattr(torch_utils, "PIN_MEMORY", True)
        monkeypatch.setattr(gpu_worker, "MAX_HOST_REGISTER_CHUNK_BYTES", step)
        register, unregister = acl.register, acl.unregister
        monkeypatch.setattr(
            gpu_worker, "host_register", lambda a, n: register(a, n, "cuda", 0)
        )
        monkeypatch.setattr(
            shared_offload_region, "host_unregister", lambda a: unregister(a, "cuda")
        )
    extra = {"host_piece_bytes": 2 * PIECE} if on_a5 else {}
    spec = tiering_spec(acl.engine_id, ROW, 64, **extra)
    worker = spec.get_worker(_kv_caches(device, ROW // 2))
    region = worker.region
    base, size = region.base_tensor.data_ptr(), region.total_size_bytes
    assert size == 64 * ROW and worker.pool.pinned
    assert region.is_pinned == (device == "cuda")  # ours on npu, vLLM's on cuda
    # Whole rows, back to back.
    pieces = [(a, min(step, base + size - a)) for a in range(base, base + size, step)]
    assert acl.calls == [("register", a, n, device) for a, n in pieces]
    assert acl.flags == flags
    worker.shutdown()
    unregistered = [("unregister", a, device, True) for a, _ in reversed(pieces)]
    assert acl.calls[len(pieces) :] == unregistered
    assert region.mmap_obj is None and not os.path.exists(region.mmap_path)
    if unregister_error:
        assert "unregistering the shared region" in caplog.text
        assert unregister_error in caplog.text
        worker.registration.release()  # once only: nothing happens
        assert len(acl.calls) == 2 * len(pieces)


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
    acl, release, acl_error, wrong
):
    acl.kernel_release(release)
    acl.refuse = lambda size, flags: acl_error
    page = mmap.PAGESIZE
    spec = tiering_spec(acl.engine_id, 2 * page)
    msg = refusal(lambda: spec.get_worker(_kv_caches("npu", page)))
    assert all(w in msg for w in wrong), msg
    assert not os.path.exists(region_path(acl.engine_id))
    assert acl.calls == []  # nothing registered, nothing to unregister
    assert kernel_registers_pageable_memory("5.15.0-91-generic")
    assert kernel_registers_pageable_memory("6.1.0")
    assert not kernel_registers_pageable_memory("4.19.90-24.4.v2101.ky10")
