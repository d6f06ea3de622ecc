// ACL-facing core of host-memory registration for the "npu" backend: makes
// an existing pageable host range (e.g. vLLM's shared /dev/shm offload
// region) page-locked memory known to ACL, so that swap_blocks_batch's npu
// backend (acl_batch_copy.cpp) copies from and to it asynchronously. Like
// acl_batch_copy.cpp it depends on the ACL headers only, not on torch, so
// that tests/sim_acl/ can link it against a SIMULATED ACL runtime.
// host_register_npu.cpp is the torch op around it (ops.h).
#pragma once

#include <acl/acl_rt.h>

#include <cstdint>

namespace vllm_ascend::kv_offload::npu {

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
