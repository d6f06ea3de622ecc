"""kv_offload_host_register / _unregister in a build without the npu backend
(the npu path itself is covered against the simulated ACL runtime in
test_npu_acl_sim.py; it never ran on an NPU)."""

from __future__ import annotations

import pytest

from vllm_ascend.kv_offload import ops

pytestmark = pytest.mark.skipif(
    not ops.HAS_NATIVE_OP or "npu" in ops.native_backends(),
    reason="needs the native op built without the npu backend",
)


def test_npu_registration_needs_the_npu_backend():
    with pytest.raises(RuntimeError, match="backend 'npu' was not compiled"):
        ops.host_register(4096, 4096, "npu")
    with pytest.raises(RuntimeError, match="backend 'npu' was not compiled"):
        ops.host_unregister(4096, "npu")


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_other_devices_are_not_registered_through_the_op(device):
    with pytest.raises(RuntimeError, match="only 'npu' is implemented"):
        ops.host_register(4096, 4096, device)


def test_unknown_device():
    with pytest.raises(RuntimeError, match="unknown device 'tpu'"):
        ops.host_register(4096, 4096, "tpu")
