"""Host registration by the npu backend's core (``acl_host_register.cpp``)
under the SIMULATED ACL runtime: how the shared /dev/shm region of the
tiering spec becomes page-locked memory the batch copy takes.
aclrtHostRegisterV2(ptr, size, ACL_HOST_REG_PINNED) page-locks pageable host
memory (CANN docs); the simulation then reports it as
ACL_MEM_LOCATION_TYPE_HOST (SIM CHOICE)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.npu_sim.sim_acl import (
    ACL_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    ACL_ERROR_HOST_MEMORY_NOT_REGISTERED,
    ACL_ERROR_RT_COPY_DATA,
    ACL_ERROR_RT_INTERNAL_ERROR,
    HOST_REGISTER,
    HOST_UNREGISTER,
    LOC_DEVICE,
    LOC_HOST,
    LOC_UNREGISTERED,
    MAPPED_PINNED,
    Job,
    Region,
    SimAcl,
)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_sim_a_registered_region_is_copied_on_the_batch_path(
    sim: SimAcl, direction: str
) -> None:
    """Pageable: refused by the copy backend. Registered through the core:
    page-locked host memory known to ACL, copied by a queued batch call.
    Unregistered: copies still queued fault (the simulation itself: why the
    worker unregisters only after its copies have completed, at shutdown),
    and it is pageable (refused) again."""
    n, size = 64, 256
    region = Region(2 * n * size)
    device = np.random.default_rng(1).integers(0, 256, 2 * n * size, np.uint8)
    sim.register(device, LOC_DEVICE, device_id=3)
    bufs = (device, region.buf)
    job = Job(*(bufs if direction == "d2h" else bufs[::-1]), n, size)
    assert sim.location_of(region.addr) == LOC_UNREGISTERED
    with pytest.raises(RuntimeError, match="host side is not page-locked"):
        job.run(sim)
    sim.host_register(region.addr, region.nbytes)
    assert sim.stat("last_register_flag") == MAPPED_PINNED
    assert sim.stat(HOST_REGISTER) == 1
    for byte in (0, region.nbytes - 1):
        assert sim.location_of(region.addr + byte) == LOC_HOST
    report = job.run(sim, sync=False)
    assert (report["batch_calls"], report["single_calls"]) == (1, 0)
    assert sim.stat("pending") == 1  # queued, not a synchronous pageable copy
    assert sim.sync() == 0
    assert sim.stat("sync_copies") == 0
    np.testing.assert_array_equal(job.dst_buf, job.want)

    job.run(sim, sync=False)
    sim.host_unregister(region.addr)
    assert sim.sync() == ACL_ERROR_RT_COPY_DATA
    assert sim.stat("faulted_entries") == n
    assert sim.stat(HOST_UNREGISTER) == 1
    assert sim.location_of(region.addr) == LOC_UNREGISTERED
    with pytest.raises(RuntimeError, match="host side is not page-locked"):
        job.run(sim)


def test_sim_host_register_errors_name_the_range_and_the_code(sim: SimAcl) -> None:
    region = Region(16 * 4096)
    rng = rf"\[{hex(region.addr)}, {hex(region.addr + region.nbytes)}\) \(65536 bytes\)"
    sim.host_register(region.addr, region.nbytes)
    with pytest.raises(RuntimeError) as info:
        sim.host_register(region.addr + 4096, 4096)  # inside: already registered
    msg = str(info.value)
    assert msg.startswith(
        "kv_offload_host_register(device='npu'): aclrtHostRegisterV2("
    )
    assert f"range [{hex(region.addr + 4096)}, {hex(region.addr + 8192)})" in msg
    assert f"failed with ACL error {ACL_ERROR_HOST_MEMORY_ALREADY_REGISTERED}" in msg
    assert "ACL reports: SIMULATED ACL: range overlaps memory already registered" in msg
    sim.host_unregister(region.addr)

    sim.inject(HOST_REGISTER, 3, ACL_ERROR_RT_INTERNAL_ERROR)
    with pytest.raises(
        RuntimeError,
        match=rf"aclrtHostRegisterV2\(range {rng}, ACL_HOST_REG_MAPPED\|"
        r"ACL_HOST_REG_PINNED\) failed "
        r"with ACL error 507000; ACL reports: SIMULATED ACL: injected failure",
    ):
        sim.host_register(region.addr, region.nbytes)
    assert sim.location_of(region.addr) == LOC_UNREGISTERED

    with pytest.raises(
        RuntimeError,
        match=rf"kv_offload_host_unregister\(device='npu'\): aclrtHostUnregister\("
        rf"{hex(region.addr)}\) failed with ACL error "
        rf"{ACL_ERROR_HOST_MEMORY_NOT_REGISTERED}; ACL reports: SIMULATED ACL: not "
        "the start of a host registration",
    ):
        sim.host_unregister(region.addr)

    calls = sim.stat(HOST_REGISTER)
    for addr, size, why in [
        (region.addr + 8, 4096, "does not start on a 4 KiB boundary"),
        (region.addr, 0, "is empty or at address 0"),
        (0, 4096, "is empty or at address 0"),
    ]:
        with pytest.raises(RuntimeError, match=why):
            sim.host_register(addr, size)
    assert sim.stat(HOST_REGISTER) == calls  # refused before any ACL call


def test_sim_a_registration_acl_does_not_report_as_host_memory_is_undone(
    sim: SimAcl,
) -> None:
    """If the runtime reported registered memory as something the copy
    backend refuses (assumption 1 of docs/npu_backend.md failing), the
    registration fails at start-up and leaves nothing registered."""
    region = Region(4 * 4096)
    sim.set(host_register_location=LOC_UNREGISTERED)
    with pytest.raises(RuntimeError) as info:
        sim.host_register(region.addr, region.nbytes)
    msg = str(info.value)
    assert (
        "was registered (aclrtHostRegisterV2, ACL_HOST_REG_MAPPED|"
        "ACL_HOST_REG_PINNED)" in msg
    )
    assert (
        f"reports location type {LOC_UNREGISTERED} for byte {hex(region.addr)}" in msg
    )
    assert msg.endswith("; it was unregistered again")
    assert sim.stat(HOST_UNREGISTER) == 1
    sim.set(host_register_location=LOC_HOST)
    sim.host_register(region.addr, region.nbytes)  # nothing was left behind


def test_sim_a_runtime_without_host_register_v2_is_named(sim_libs) -> None:
    sim = sim_libs["nobatch"]  # models an older CANN: no batch API, no V2
    sim.reset()
    region = Region(4096)
    with pytest.raises(
        RuntimeError, match="this CANN runtime has no aclrtHostRegisterV2"
    ):
        sim.host_register(region.addr, region.nbytes)
