// SIMULATION (tests only, not CANN), beside the simulated ACL runtime of
// sim_acl.cpp: none of these functions is in CANN. The simulation's test
// hooks (simacl_*) and a harness (simacl_core_*) that runs the real
// ACL-facing core of the npu backend (csrc/kv_offload/npu/acl_core.h) against
// that runtime, for pytest (ctypes, tests/unit/npu_sim/sim_acl.py).
#include <acl/acl_rt.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "acl_core.h"  // the real core, driven by the harness below
#include "sim_state.h"

using namespace simacl;  // NOLINT: the simulation's own names

extern "C" {

// --- test hooks ----------------------------------------------------------

// Forgets registered memory, counters, injected failures and switches.
void simacl_reset(void) {
  auto [lock, s] = Locked{};
  s = State{};  // queued copies are dropped, never run
}

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
// 107000, as on A5, where only ACL_HOST_REG_MAPPED is accepted). Returns 0,
// or -1 for a name it does not know (nothing set: a test must not pass
// because its switch was misspelled).
int simacl_set(const char* name, int64_t value) {
  auto [lock, s] = Locked{};
  const std::string key = name;
  if (key == "batch_unsupported") {
    s.batch_unsupported = value != 0;
  } else if (key == "host_register_location") {
    s.host_register_location = static_cast<aclrtMemLocationType>(value);
  } else if (key == "max_host_bytes") {
    s.max_host_bytes = static_cast<uint64_t>(value);
  } else if (key == "host_alignment") {
    s.host_alignment = value == 0 ? 4096 : static_cast<uint64_t>(value);
  } else if (key == "a5") {
    s.a5 = value != 0;
  } else {
    return -1;
  }
  return 0;
}

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
// none), and "report.*" (simacl_core_copy's). An unknown name is INT64_MIN
// (not 0: an assertion of 0 on a misspelled name must not pass).
int64_t simacl_stat(const char* name) {
  auto [lock, s] = Locked{};
  if (std::string(name) == "pending") {
    size_t n = 0;
    for (const auto& [stream, tasks] : s.streams) n += tasks.size();
    return static_cast<int64_t>(n);
  }
  const auto it = s.stats.find(name);
  return it == s.stats.end() ? INT64_MIN : it->second;
}

// The aclrtMemLocationType the simulation holds for the byte at `ptr`.
int simacl_location_of(const void* ptr) {
  auto [lock, s] = Locked{};
  aclrtMemLocation loc;
  locate(s, ptr, 1, &loc);
  return loc.type;
}

// Declares [ptr, ptr + size) to be memory of aclrtMemLocationType
// `location_type` (e.g. ACL_MEM_LOCATION_TYPE_DEVICE with device `id`, or
// ACL_MEM_LOCATION_TYPE_HOST for page-locked host memory). Everything never
// registered is ACL_MEM_LOCATION_TYPE_UNREGISTERED (pageable host memory).
void simacl_register(const void* ptr, size_t size, int location_type,
                     uint32_t id) {
  auto [lock, s] = Locked{};
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  s.ranges[p] = Range{
      p + size,
      aclrtMemLocation{id, static_cast<aclrtMemLocationType>(location_type)}};
}

// Makes call number `nth_call` (1-based, counted since simacl_reset) of ACL
// function `api` return `code`; the batch API also sets *failIndex to
// `fail_index`. One shot; one armed failure per function (arming `api`
// again replaces its earlier one).
void simacl_inject_failure(const char* api, size_t nth_call, int code,
                           size_t fail_index) {
  Locked{}.s.injections[api] = Injection{api, nth_call, code, fail_index};
}

// --- harness: the real core ------------------------------------------------
// Like the op (csrc/kv_offload/npu/ops_npu.cpp) the harness owns each job's
// workspace; unlike the op, a test decides how long it lives. Every
// simacl_core_* call returns 0, or 1 with the exception's message in `err`.

}  // extern "C"

namespace {

namespace npu = vllm_ascend::kv_offload::npu;

std::unique_ptr<npu::AclBatchCopier> g_copier =
    std::make_unique<npu::AclBatchCopier>();
// Workspaces of jobs whose copies may not have run yet, freed by
// simacl_core_sync once they have (the transfer queue's end-event wait).
std::vector<std::unique_ptr<unsigned char[]>> g_workspaces;
constexpr unsigned char kPoison = 0xA5;  // what a freed workspace holds

template <typename F>
int run_core(F&& f, char* err, size_t err_len) {
  try {
    f();
  } catch (const std::exception& e) {
    std::strncpy(err, e.what(), err_len - 1);
    err[err_len - 1] = '\0';
    return 1;
  }
  return 0;
}

}  // namespace

extern "C" {

// Runs the core on regions i = 0..n-1 (src[i], dst[i], sizes[i],
// first_fragment[i]) with a workspace of `workspace_bytes` bytes (< 0: what
// the core asks for, AclBatchCopier::workspace_bytes). The harness keeps the
// workspace until simacl_core_sync has run the stream, or, with
// `free_workspace_at_return` (what the op did before workspaces existed: its
// arrays were locals), frees it (= fills it with 0xA5) as soon as copy()
// returns. It is always freed when copy() throws. `per_copy`: copy()'s
// argument of that name (one aclrtMemcpyAsync per copy). What copy()
// reported is recorded for simacl_stat as "report.direction" (0
// host-to-device, 1 device-to-host), "report.fallback_started",
// "report.batch_calls", "report.single_calls" and "report.workspace_bytes".
int simacl_core_copy(const uint64_t* src, const uint64_t* dst,
                     const uint64_t* sizes, const int64_t* first_fragment,
                     size_t n, void* stream, int64_t workspace_bytes,
                     int free_workspace_at_return, int per_copy, char* err,
                     size_t err_len) {
  std::vector<vllm_ascend::kv_offload::CopyRegion> regions(n);
  for (size_t i = 0; i < n; ++i) {
    regions[i] = {src[i], dst[i], sizes[i], first_fragment[i]};
  }
  const size_t bytes = workspace_bytes < 0
                           ? g_copier->workspace_bytes(n, per_copy != 0)
                           : static_cast<size_t>(workspace_bytes);
  // operator new[] is aligned to max_align_t, as the core requires.
  std::unique_ptr<unsigned char[]> workspace(new unsigned char[bytes + 1]);
  const int rc = run_core(
      [&] {
        const auto r = g_copier->copy(regions, stream,
                                      bytes == 0 ? nullptr : workspace.get(),
                                      bytes, per_copy != 0);
        auto [lock, s] = Locked{};
        s.stats["report.direction"] =
            r.direction == npu::CopyDirection::kHostToDevice ? 0 : 1;
        s.stats["report.fallback_started"] = r.fallback_started ? 1 : 0;
        s.stats["report.batch_calls"] = static_cast<int64_t>(r.batch_calls);
        s.stats["report.single_calls"] = static_cast<int64_t>(r.single_calls);
        s.stats["report.workspace_bytes"] = static_cast<int64_t>(bytes);
      },
      err, err_len);
  // Freeing is modelled as poisoning (plus the real free at the next sync),
  // so that the simulation reads defined, recognisably wrong contents. The
  // op's workspace tensor is freed as an exception leaves it.
  if (free_workspace_at_return || rc != 0) {
    std::memset(workspace.get(), kPoison, bytes);
  }
  g_workspaces.push_back(std::move(workspace));
  return rc;
}

// aclrtSynchronizeStream(stream), i.e. runs the copies queued on it, then
// frees every workspace the harness holds (as the transfer queue drops a
// job's workspace once its end event has completed). Returns the ACL code.
int simacl_core_sync(void* stream) {
  const aclError rc = aclrtSynchronizeStream(stream);
  g_workspaces.clear();
  return rc;
}

// Replaces the core's copier with a fresh one (forgets a fallback) and frees
// the workspaces held.
void simacl_core_reset(void) {
  g_copier = std::make_unique<npu::AclBatchCopier>();
  g_workspaces.clear();
}

// The core's register_host_range / unregister_host_range / allocate_host
// (the address in *addr) / free_host (acl_host_register.cpp).
int simacl_core_host_register(uint64_t addr, uint64_t size, uint32_t flags,
                              char* err, size_t err_len) {
  return run_core([&] { npu::register_host_range(addr, size, flags); }, err,
                  err_len);
}

int simacl_core_host_unregister(uint64_t addr, char* err, size_t err_len) {
  return run_core([&] { npu::unregister_host_range(addr); }, err, err_len);
}

int simacl_core_host_alloc(uint64_t size, uint64_t* addr, char* err,
                           size_t err_len) {
  return run_core([&] { *addr = npu::allocate_host(size); }, err, err_len);
}

int simacl_core_host_free(uint64_t addr, char* err, size_t err_len) {
  return run_core([&] { npu::free_host(addr); }, err, err_len);
}

}  // extern "C"
