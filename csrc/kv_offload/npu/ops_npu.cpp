// "npu" backend of swap_blocks_batch and "npu" implementation of
// kv_offload_host_register / _unregister and kv_offload_host_alloc / _free
// (contract: csrc/kv_offload/ops.h). The only part that needs torch_npu: it
// picks the stream, allocates the job's workspace and turns errors into
// c10::Error. The ACL calls live in acl_batch_copy.cpp and
// acl_host_register.cpp (acl_core.h), which are also tested against a
// simulated ACL runtime (tests/sim_acl/).
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch_npu/csrc/core/npu/NPUStream.h>

#include <exception>
#include <vector>

#include "acl_core.h"
#include "ops.h"

namespace vllm_ascend::kv_offload {
namespace {

// f(), its std::exception rethrown as c10::Error.
template <typename F>
auto as_c10_error(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what());
  }
}

// One per process: once the batch API is found unsupported, every later job
// goes straight to the per-copy loop.
npu::AclBatchCopier& process_copier() {
  static npu::AclBatchCopier copier;
  return copier;
}

}  // namespace

at::Tensor swap_blocks_npu(const std::vector<CopyRegion>& regions,
                           bool per_copy) {
  npu::AclBatchCopier& copier = process_copier();
  // The host arrays of aclrtMemcpyBatchAsync live here, in a tensor the op
  // returns: the caller keeps it until the copies have completed (ops.h).
  // Ordinary CPU memory: the ACL docs ask nothing more of these arrays.
  // Empty when copying per copy (that passes no arrays).
  at::Tensor workspace = at::empty(
      {static_cast<int64_t>(copier.workspace_bytes(regions.size(), per_copy))},
      at::kByte);
  // stream() (unlike stream(false)) first flushes torch_npu's host-side task
  // queue, so these copies are ordered after torch ops already issued on the
  // current stream (e.g. the attention kernels that wrote the KV blocks).
  const aclrtStream stream = c10_npu::getCurrentNPUStream().stream();
  const npu::BatchCopyReport report = as_c10_error([&] {
    return copier.copy(regions, stream, workspace.data_ptr(),
                       static_cast<size_t>(workspace.numel()), per_copy);
  });
  if (report.fallback_started) {
    TORCH_WARN(
        "swap_blocks_batch(device='npu'): aclrtMemcpyBatchAsync is not "
        "supported by this CANN runtime / device; using one aclrtMemcpyAsync "
        "per copy from now on (slower for many small blocks)");
  }
  return workspace;
}

void host_register_npu(uint64_t addr, uint64_t size, uint32_t flags) {
  as_c10_error([&] { npu::register_host_range(addr, size, flags); });
}

void host_unregister_npu(uint64_t addr) {
  as_c10_error([&] { npu::unregister_host_range(addr); });
}

uint64_t host_alloc_npu(uint64_t size) {
  return as_c10_error([&] { return npu::allocate_host(size); });
}

void host_free_npu(uint64_t addr) {
  as_c10_error([&] { npu::free_host(addr); });
}

}  // namespace vllm_ascend::kv_offload
