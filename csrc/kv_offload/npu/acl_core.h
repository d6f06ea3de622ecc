// ACL-facing core of the "npu" backend (contract: csrc/kv_offload/ops.h):
// batch copies (acl_batch_copy.cpp) and host-memory registration and
// allocation (acl_host_register.cpp). It depends on the ACL headers only --
// not on torch or torch_npu -- so that tests/sim_acl/ can link it against a
// SIMULATED ACL runtime on machines without CANN. ops_npu.cpp is the torch
// op around it (stream, workspace tensor, c10::Error).
#pragma once

#include <acl/acl_rt.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "copy_region.h"  // CopyRegion, HostArrayLayout

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
  // (`per_copy`: one aclrtMemcpyAsync per region, batch API or not; ops.h,
  // per_copy). The direction is read once, from the first region (ops.h,
  // "npu"). `workspace`: `workspace_bytes` bytes of caller-owned host memory,
  // aligned to HostArrayLayout::kAlignment, at least
  // workspace_bytes(regions.size()) of them, where copy() builds every array
  // it passes to aclrtMemcpyBatchAsync; the caller keeps it unchanged until
  // the copies have completed on `stream` (ops.h, Returns).
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

// Host registration (the shared /dev/shm region of the tiering spec) and
// exact-size page-locked allocation (the CPU block pool).
// aclrtHostRegisterV2 requires a 4 KiB-aligned address (CANN docs).
inline constexpr uint64_t kHostRegisterAlignment = 4096;
// The flags register_host_range accepts. A2/A3 take MAPPED | PINNED (what
// upstream vllm-ascend registers shared memory with); A5 rejects PINNED
// (error 107000) and takes MAPPED alone, so the caller chooses.
inline constexpr uint32_t kHostRegisterKnownFlags =
    static_cast<uint32_t>(ACL_HOST_REG_MAPPED | ACL_HOST_REG_PINNED);

// Registers [addr, addr + size) with aclrtHostRegisterV2(..., flags) (flags:
// ACL_HOST_REG_MAPPED, optionally | ACL_HOST_REG_PINNED; anything else is
// refused before any ACL call) and checks that aclrtPointerGetAttributes then
// reports its first and last byte as page-locked host memory
// (ACL_MEM_LOCATION_TYPE_HOST or _HOST_NUMA), which is what the batch copy path
// requires; if it does not, the range is unregistered again and the call fails.
// Throws std::runtime_error naming the range, the ACL call and its error code
// (and the runtime's message). Refused before any ACL call: a null address,
// size 0, an address that is not 4 KiB-aligned, a runtime without
// aclrtHostRegisterV2.
void register_host_range(uint64_t addr, uint64_t size, uint32_t flags);

// aclrtHostUnregister(addr): `addr` is the address given to
// register_host_range. Call it only once no copy from or to the range is
// queued any more, and before the range is unmapped. Throws like
// register_host_range.
void unregister_host_range(uint64_t addr);

// aclrtMallocHost(size): page-locked host memory of exactly `size` bytes
// (the runtime rounds to its pages at most) that ACL's async copies accept on
// every kernel, unlike a registration (pageable memory "causes exceptions"
// on Linux <= 5.10, CANN docs). Checked like a registration: ACL must report
// its first and last byte as page-locked host memory, else it is freed again.
// Returns the address; throws std::runtime_error naming the size, the ACL
// call and its error code.
uint64_t allocate_host(uint64_t size);

// aclrtFreeHost(addr) for an address from allocate_host, once no copy from
// or to it is queued any more. Throws like allocate_host.
void free_host(uint64_t addr);

}  // namespace vllm_ascend::kv_offload::npu
