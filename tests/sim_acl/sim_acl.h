// SIMULATION ONLY -- test hooks of the simulated ACL runtime in sim_acl.cpp
// and the C entry point of sim_shim.cpp. None of this exists in CANN; it lets
// pytest (through ctypes) drive csrc/kv_offload/npu/acl_batch_copy.cpp without
// an NPU.
#pragma once

#include <cstddef>
#include <cstdint>

#define SIMACL_API extern "C" __attribute__((visibility("default")))

// Forgets registered memory, counters, injected failures and switches.
SIMACL_API void simacl_reset(void);
// Declares [ptr, ptr + size) to be memory of aclrtMemLocationType
// `location_type` (e.g. ACL_MEM_LOCATION_TYPE_DEVICE with device `id`, or
// ACL_MEM_LOCATION_TYPE_HOST for page-locked host memory). Everything never
// registered is ACL_MEM_LOCATION_TYPE_UNREGISTERED (pageable host memory).
SIMACL_API void simacl_register(const void* ptr, size_t size, int location_type,
                                uint32_t id);
// Makes call number `nth_call` (1-based, counted since simacl_reset) of ACL
// function `api` return `code`; the batch API also sets *failIndex to
// `fail_index`. One shot; one armed failure per function (arming `api`
// again replaces its earlier one).
SIMACL_API void simacl_inject_failure(const char* api, size_t nth_call,
                                      int code, size_t fail_index);
// A counter or record of the simulation since simacl_reset: the name of an
// ACL function (its calls), "max_entries" (largest numBatches passed to
// aclrtMemcpyBatchAsync), "sync_copies" (copies whose host side was pageable:
// run at once, as the CANN docs say), "faulted_entries" (batch entries
// skipped at execution because their arrays no longer named the memory
// declared at enqueue: freed or reused too early), "pending" (copy calls
// queued that have not run yet; they run, in order, at
// aclrtSynchronizeStream), "last_stream" (of the most recent copy call),
// "last_kind" (aclrtMemcpyKind of the most recent aclrtMemcpyAsync, -1:
// none), "last_register_flag" (of the most recent aclrtHostRegisterV2, -1:
// none). Unknown names are 0.
SIMACL_API int64_t simacl_stat(const char* name);

// Switches of the simulation, off until set (simacl_reset clears them):
// "batch_unsupported" (1: aclrtMemcpyBatchAsync returns
// ACL_ERROR_RT_FEATURE_NOT_SUPPORT); "host_register_location" (the
// aclrtMemLocationType aclrtPointerGetAttributes reports for ranges
// registered with aclrtHostRegisterV2 from now on; default
// ACL_MEM_LOCATION_TYPE_HOST); and host-memory limits of real runtimes:
// "max_host_bytes" (aclrtMallocHost and aclrtHostRegisterV2 of more bytes in
// one call fail with ACL_ERROR_RT_MEMORY_ALLOCATION, 207001, what a 910B host
// returned for one aclrtMallocHost above ~200-250 GB; 0: no limit),
// "host_alignment" (aclrtHostRegisterV2 of an address that is not a multiple
// fails with ACL_ERROR_RT_ADDR_UNALIGNED, and aclrtMallocHost returns memory
// aligned to it; 4096 by default, 65536 models Ascend SVM's rule), "a5" (1: a
// flag with ACL_HOST_REG_PINNED fails with ACL_ERROR_RT_PARAM_INVALID,
// 107000, as on A5, where only ACL_HOST_REG_MAPPED is accepted).
SIMACL_API void simacl_set(const char* name, int64_t value);
// The aclrtMemLocationType the simulation holds for the byte at `ptr`.
SIMACL_API int simacl_location_of(const void* ptr);

// What AclBatchCopier::copy reported (sim_shim.cpp).
struct SimCopyReport {
  int32_t direction;  // 0 host-to-device, 1 device-to-host
  int32_t fallback_started;
  uint64_t batch_calls;
  uint64_t single_calls;
  uint64_t workspace_bytes;  // the workspace the harness gave copy()
};

// Runs the real core on regions i = 0..n-1 (src[i], dst[i], sizes[i],
// first_fragment[i]) with a workspace of `workspace_bytes` bytes (< 0: what
// the core asks for, AclBatchCopier::workspace_bytes). Like the op, the
// harness owns the workspace: it keeps it until simacl_core_sync has run the
// stream, or, with `free_workspace_at_return` (what the op did before
// workspaces existed: its arrays were locals), frees it (= fills it with
// 0xA5) as soon as copy() returns. It is always freed when copy() throws.
// `per_copy`: copy()'s argument of that name (one aclrtMemcpyAsync per copy).
// Returns 0, or 1 with the exception message in `err`.
SIMACL_API int simacl_core_copy(const uint64_t* src, const uint64_t* dst,
                                const uint64_t* sizes,
                                const int64_t* first_fragment, size_t n,
                                void* stream, int64_t workspace_bytes,
                                int free_workspace_at_return, int per_copy,
                                SimCopyReport* report, char* err,
                                size_t err_len);
// aclrtSynchronizeStream(stream), i.e. runs the copies queued on it, then
// frees every workspace the harness holds (as the transfer queue drops a
// job's workspace once its end event has completed). Returns the ACL code.
SIMACL_API int simacl_core_sync(void* stream);
// The real register_host_range / unregister_host_range of
// csrc/kv_offload/npu/acl_host_register.cpp. Return 0, or 1 with the
// exception message in `err`.
SIMACL_API int simacl_core_host_register(uint64_t addr, uint64_t size,
                                         uint32_t flags, char* err,
                                         size_t err_len);
SIMACL_API int simacl_core_host_unregister(uint64_t addr, char* err,
                                           size_t err_len);
// The real allocate_host / free_host (aclrtMallocHost / aclrtFreeHost) of
// acl_host_register.cpp. Return 0 (with the address in *addr), or 1 with the
// exception message in `err`.
SIMACL_API int simacl_core_host_alloc(uint64_t size, uint64_t* addr, char* err,
                                      size_t err_len);
SIMACL_API int simacl_core_host_free(uint64_t addr, char* err, size_t err_len);
// Replaces the core's copier with a fresh one (forgets a fallback) and frees
// the workspaces held.
SIMACL_API void simacl_core_reset(void);
