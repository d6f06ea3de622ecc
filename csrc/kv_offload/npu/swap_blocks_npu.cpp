// "npu" backend of swap_blocks_batch (contract: csrc/kv_offload/ops.h). The
// only part that needs torch_npu: it picks the stream, allocates the job's
// workspace and turns errors into c10::Error. The ACL calls live in
// acl_batch_copy.cpp, which is also tested against a simulated ACL runtime
// (tests/sim_acl/).
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch_npu/csrc/core/npu/NPUStream.h>

#include <exception>
#include <vector>

#include "acl_batch_copy.h"
#include "ops.h"

namespace vllm_ascend::kv_offload {

namespace {

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
  npu::BatchCopyReport report;
  try {
    report = copier.copy(regions, stream, workspace.data_ptr(),
                         static_cast<size_t>(workspace.numel()), per_copy);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what());
  }
  if (report.fallback_started) {
    TORCH_WARN(
        "swap_blocks_batch(device='npu'): aclrtMemcpyBatchAsync is not "
        "supported by this CANN runtime / device; using one aclrtMemcpyAsync "
        "per copy from now on (slower for many small blocks)");
  }
  return workspace;
}

}  // namespace vllm_ascend::kv_offload
