// ACL-facing core of the "npu" backend of swap_blocks_batch (contract:
// csrc/kv_offload/ops.h). It depends on the ACL headers only -- not on torch or
// torch_npu -- so that tests/sim_acl/ can link it against a simulated ACL
// runtime on machines without CANN. swap_blocks_npu.cpp supplies the stream.
#pragma once

#include <acl/acl_rt.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "copy_region.h"
#include "host_arrays.h"

namespace vllm_ascend::kv_offload::npu {

// Most entries per aclrtMemcpyBatchAsync call. The documentation gives no
// limit; another project splits at 4096, so we do too (unverified on
// hardware, see docs/npu_backend.md).
inline constexpr size_t kMaxBatchEntries = 4096;

enum class CopyDirection { kHostToDevice, kDeviceToHost };

// What one copy() did; returned for logging and tests.
struct BatchCopyReport {
  CopyDirection direction = CopyDirection::kHostToDevice;
  size_t batch_calls = 0;   // successful aclrtMemcpyBatchAsync calls
  size_t single_calls = 0;  // aclrtMemcpyAsync calls (fallback path)
  // True for exactly one copy() per copier: the one that found the batch API
  // unsupported and switched this copier to the per-copy loop for good.
  bool fallback_started = false;
};

// "0x..." of `v`, for messages (also acl_host_register.cpp).
std::string hex(uint64_t v);
// "; ACL reports: " and aclGetRecentErrMsg(), or "" when the runtime has no
// message for its most recent error.
std::string acl_detail();

// Thread-safe; the only state is whether the batch API was found unsupported.
class AclBatchCopier {
 public:
  // Bytes of host memory copy() needs as its workspace for `num_regions`
  // regions: the arrays it hands to aclrtMemcpyBatchAsync. 0 when there is
  // nothing to copy, when copying `per_copy`, or when the batch API is
  // known to be unsupported (the per-copy loop passes no arrays). Once 0
  // for that last reason, always 0.
  size_t workspace_bytes(size_t num_regions, bool per_copy = false) const;

  // Enqueues every region on `stream` and returns once they are submitted
  // (`per_copy`: one aclrtMemcpyAsync per region, batch API or not: the
  // start-up self-check's next path down when a batch copy was wrong,
  // vllm_ascend/kv_offload/self_check.py)
  // (completion is ordered on the stream like any other stream work).
  // The direction is read once, from the first region: all regions of a job
  // must share it (a later region that does not is rejected by the runtime,
  // which is reported with that region's fragment index).
  //
  // Workspace: `workspace` points to `workspace_bytes` bytes of host memory,
  // aligned to HostArrayLayout::kAlignment, at least
  // workspace_bytes(regions.size()) of them, owned by the caller. copy()
  // builds every array it passes to aclrtMemcpyBatchAsync there (nothing on
  // its own stack or heap), because the ACL documentation does not say that
  // the runtime has read them when the call returns: the caller must keep
  // the workspace unchanged until the copies have completed on `stream`
  // (event or stream synchronize), not merely until copy() returns.
  //
  // Throws std::runtime_error naming the ACL call, its error code and the
  // failing fragment. Regions submitted before the failure are not undone;
  // if any batch call of this job had been enqueued, copy() first waits for
  // the stream (aclrtSynchronizeStream), so that the caller may free the
  // workspace as soon as copy() has thrown.
  BatchCopyReport copy(const std::vector<CopyRegion>& regions,
                       aclrtStream stream, void* workspace,
                       size_t workspace_bytes, bool per_copy = false);

  bool using_fallback() const { return batch_unsupported_.load(); }

 private:
  std::atomic<bool> batch_unsupported_{false};
};

}  // namespace vllm_ascend::kv_offload::npu
