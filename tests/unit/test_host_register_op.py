"""kv_offload_host_register / _unregister / _alloc / _free in a build without
the npu backend (the npu path itself is covered against the simulated ACL
runtime in test_npu_acl_sim.py; it never ran on an NPU)."""

from __future__ import annotations

import pytest

from vllm_ascend.kv_offload import ops

pytestmark = pytest.mark.skipif(
    not ops.HAS_NATIVE_OP or "npu" in ops.native_backends(),
    reason="needs the native op built without the npu backend",
)
NOT_COMPILED = "backend 'npu' was not compiled into this build"


@pytest.mark.parametrize(
    "call, message",
    [
        # npu: every op needs the npu backend.
        (lambda: ops.host_register(4096, 4096, "npu"), NOT_COMPILED),
        (lambda: ops.host_unregister(4096, "npu"), NOT_COMPILED),
        (lambda: ops.host_alloc(4096, "npu"), NOT_COMPILED),
        (lambda: ops.host_free(4096, "npu"), NOT_COMPILED),
        # Other devices are not registered through the op.
        (lambda: ops.host_register(4096, 4096, "cuda"), "only 'npu' is implemented"),
        (lambda: ops.host_register(4096, 4096, "cpu"), "only 'npu' is implemented"),
        (lambda: ops.host_register(4096, 4096, "tpu"), "unknown device 'tpu'"),
    ],
    ids=["register", "unregister", "alloc", "free", "cuda", "cpu", "unknown"],
)
def test_host_memory_ops_refuse_what_this_build_cannot_do(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()
