// SIMULATION of the ACL runtime functions that the npu backend's core
// (csrc/kv_offload/npu/acl_core.h) calls -- NOT CANN. There is no device
// and no DMA here: "device" memory is host memory a test registered as such,
// and a stream is a queue of memcpy tasks that runs when it is synchronized
// (aclrtSynchronizeStream), in submission order. Compiled against the real
// declarations (torch-npu wheel's acl/acl_rt.h), so signatures match.
//
// What it follows of the CANN documentation of aclrtMemcpyBatchAsync,
// aclrtMemcpyAsync, aclrtMemLocationType and aclrtMemcpyBatchAttr, and the
// choices it makes where the docs are silent, marked SIM CHOICE below (the
// 4096-entry cap, the error codes of failed checks, that a failing batch
// copies nothing, and WHEN the runtime reads a batch's host arrays):
// docs/npu_backend.md. The least favourable reading of the latter: a batch
// is validated at enqueue (errors are returned by the call, as documented),
// but only the POINTERS to its arrays are kept, and the arrays are read
// again when the copy executes; an entry that no longer names the memory its
// attrs declare is then skipped (a device would fault) and the synchronize
// returns ACL_ERROR_RT_COPY_DATA. Copies with a pageable host side run at
// enqueue, as documented. Only what the npu backend calls is simulated: one
// attribute set per batch (numAttrs == 1, attrsIndexes[0] == 0) and the
// kinds HOST_TO_DEVICE and DEVICE_TO_HOST; anything else is
// ACL_ERROR_INVALID_PARAM.
//
// Host registration (aclrtHostRegisterV2 / aclrtHostUnregister), following
// the CANN docs: "register pageable host memory (malloc, new, a default
// mmap) as page-locked memory" with ACL_HOST_REG_PINNED; the address must
// be 4 KiB-aligned; unregister with aclrtHostUnregister(ptr). A registered
// range becomes page-locked host memory known to ACL: aclrtPointerGetAttributes
// reports ACL_MEM_LOCATION_TYPE_HOST for it (SIM CHOICE: the docs do not say
// what it reports; simacl_set's "host_register_location" changes it), and
// copies from or to it are queued like any pinned copy. Unregistering makes it
// pageable again; copies still queued then fault when they run. SIM CHOICE:
// the error code of each check (flag 0, or with bits other than MAPPED /
// PINNED, is refused; MAPPED alone is accepted, as A5 requires). What a real
// runtime does on kernels <= 5.10 (the docs: pageable memory "causes
// exceptions" there) is not modelled.
//
// Below the ACL functions, for pytest (ctypes, tests/unit/npu_sim/sim_acl.py)
// and none of them in CANN: the simulation's test hooks (simacl_*) and a
// harness (simacl_core_*) that runs the real ACL-facing core of the npu
// backend (csrc/kv_offload/npu/acl_core.h) against this runtime.
#include <acl/acl_rt.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "acl_core.h"  // the real core, driven by the harness below

namespace {

constexpr size_t kSimMaxBatchEntries = 4096;  // SIM CHOICE (see the top)

struct Range {
  uintptr_t end;
  aclrtMemLocation loc;
  bool host_registered = false;  // by aclrtHostRegisterV2, not a test hook
  bool malloc_host = false;      // by aclrtMallocHost: freed by aclrtFreeHost
};

struct Injection {
  std::string api;
  size_t nth_call = 0;
  aclError code = ACL_SUCCESS;
  size_t fail_index = SIZE_MAX;
};

// A copy queued on a stream, run by aclrtSynchronizeStream. A batch keeps
// the caller's array POINTERS (read at execution, see the top); a
// single copy's arguments are scalars, kept by value.
struct Task {
  void* dst = nullptr;  // single copy
  const void* src = nullptr;
  size_t count = 0;
  bool batch = false;
  void** dsts = nullptr;
  size_t* destMaxs = nullptr;
  void** srcs = nullptr;
  size_t* sizes = nullptr;
  size_t numBatches = 0;
  aclrtMemcpyBatchAttr* attrs = nullptr;  // one set (numAttrs == 1)
};

// Everything simacl_reset forgets: its default values are the reset state.
struct State {
  std::map<uintptr_t, Range> ranges;                // keyed by start address
  std::map<aclrtStream, std::deque<Task>> streams;  // queued, not yet run
  // simacl_stat's counters and records, every name it knows (calls are
  // counted by API name; "pending" is computed): 0, the two last_* -1.
  std::map<std::string, int64_t> stats = [] {
    std::map<std::string, int64_t> m{{"last_kind", -1},
                                     {"last_register_flag", -1}};
    for (const char* name :
         {"aclrtPointerGetAttributes", "aclrtHostRegisterV2", "aclrtMallocHost",
          "aclrtFreeHost", "aclrtHostUnregister", "aclrtMemcpyBatchAsync",
          "aclrtMemcpyAsync", "aclrtSynchronizeStream", "max_entries",
          "sync_copies", "faulted_entries", "last_stream", "report.direction",
          "report.fallback_started", "report.batch_calls",
          "report.single_calls", "report.workspace_bytes"}) {
      m[name] = 0;
    }
    return m;
  }();
  // One armed failure per ACL function (armed while nth_call != 0).
  std::map<std::string, Injection> injections;
  size_t fired_fail_index = SIZE_MAX;  // of the failure that fired last
  std::string last_error;
  // simacl_set's switches.
  bool batch_unsupported = false;
  aclrtMemLocationType host_register_location = ACL_MEM_LOCATION_TYPE_HOST;
  uint64_t max_host_bytes = 0;
  uint64_t host_alignment = 4096;
  bool a5 = false;
};

std::mutex g_mu;
State g_state;

// The state, locked while this lives: `auto [lock, s] = Locked{};`.
struct Locked {
  std::lock_guard<std::mutex> lock{g_mu};
  State& s = g_state;
};

// Records the message aclGetRecentErrMsg returns and passes `code` through.
aclError error(State& s, aclError code, const std::string& msg) {
  s.last_error = "SIMULATED ACL: " + msg;
  return code;
}

// Counts the call; the code of an injected failure that fires on it.
std::optional<aclError> count_call(State& s, const char* api) {
  const auto n = static_cast<size_t>(++s.stats[api]);
  const auto it = s.injections.find(api);
  if (it == s.injections.end() || it->second.nth_call != n) return {};
  const Injection fired = it->second;
  s.injections.erase(it);  // one shot
  s.fired_fail_index = fired.fail_index;
  return error(
      s, fired.code,
      std::string("injected failure of ") + api + " call " + std::to_string(n));
}

// Location of the bytes [p, p + n): the registered range holding all of
// them, UNREGISTERED when they touch no registered range; false when they
// straddle a range boundary (no single location).
bool locate(const State& s, const void* ptr, size_t n, aclrtMemLocation* out) {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  auto it = s.ranges.upper_bound(p);  // first range starting after p
  if (it != s.ranges.begin()) {
    const auto& [begin, range] = *std::prev(it);
    if (p < range.end) {
      *out = range.loc;
      return n <= range.end - p;
    }
  }
  *out = aclrtMemLocation{0, ACL_MEM_LOCATION_TYPE_UNREGISTERED};
  return it == s.ranges.end() || it->first - p >= n;
}

// simacl_set's "max_host_bytes": the error when one call of `api` asks for
// more than it.
std::optional<aclError> over_host_limit(State& s, uint64_t size,
                                        const char* api) {
  if (s.max_host_bytes == 0 || size <= s.max_host_bytes) return {};
  return error(s, ACL_ERROR_RT_MEMORY_ALLOCATION,
               std::to_string(size) + " bytes in one " + api +
                   ", more than the simulated limit of " +
                   std::to_string(s.max_host_bytes));
}

bool is_device(const aclrtMemLocation& loc) {
  return loc.type == ACL_MEM_LOCATION_TYPE_DEVICE;
}

// Declared and actual location agree (device id only matters on a device).
[[maybe_unused]] bool same_location(const aclrtMemLocation& declared,
                                    const aclrtMemLocation& actual) {
  return declared.type == actual.type &&
         (!is_device(declared) || declared.id == actual.id);
}

// Entry i of a batch, read from the caller's arrays NOW: ACL_SUCCESS when it
// names registered memory as `attr` declares (and may be copied), else the
// error (SIM CHOICE) with why not in *why. Only reads the arrays and the
// registry, so it is safe on any contents.
aclError check_entry(const State& s, const Task& t, size_t i,
                     std::string* why) {
  *why = "entry " + std::to_string(i) + ": ";
  if (t.srcs[i] == nullptr || t.dsts[i] == nullptr || t.sizes[i] == 0 ||
      t.sizes[i] > t.destMaxs[i]) {
    *why += "null address, zero size or size > destMax";
    return ACL_ERROR_INVALID_PARAM;
  }
  aclrtMemLocation src, dst;
  if (!locate(s, t.srcs[i], t.sizes[i], &src) ||
      !locate(s, t.dsts[i], t.sizes[i], &dst) ||
      !same_location(t.attrs->srcLoc, src) ||
      !same_location(t.attrs->dstLoc, dst)) {
    *why += "memory location differs from attrs[0]";
    return ACL_ERROR_RT_INVALID_MEMORY_TYPE;
  }
  return ACL_SUCCESS;
}

// Runs one queued task, reading a batch's arrays as they are now. Entries
// that no longer check out are skipped and counted; returns how many.
size_t execute(State& s, const Task& t) {
  if (!t.batch) {
    std::memcpy(t.dst, t.src, t.count);  // scalars, checked at enqueue
    return 0;
  }
  size_t faults = 0;
  for (size_t i = 0; i < t.numBatches; ++i) {
    std::string why;
    if (check_entry(s, t, i, &why) != ACL_SUCCESS) {
      ++faults;
      s.last_error = "SIMULATED ACL: batch copy faulted at execution, " + why +
                     " (were its arrays freed or reused before the copy ran?)";
      continue;
    }
    std::memcpy(t.dsts[i], t.srcs[i], t.sizes[i]);
  }
  return faults;
}

// Runs the tasks queued on `stream`, in order; returns the entries skipped.
size_t drain(State& s, aclrtStream stream) {
  size_t faults = 0;
  for (const Task& t : s.streams[stream]) faults += execute(s, t);
  s.streams.erase(stream);
  s.stats["faulted_entries"] += static_cast<int64_t>(faults);
  return faults;
}

// Queues `task` on `stream`; documented: a copy with a `pageable` host side
// is synchronous, i.e. runs now (after the work queued before it, which a
// synchronous copy waits for).
void enqueue(State& s, aclrtStream stream, const Task& task, bool pageable) {
  if (!pageable) {
    s.streams[stream].push_back(task);
    return;
  }
  drain(s, stream);
  s.stats["faulted_entries"] += static_cast<int64_t>(execute(s, task));
  s.stats["sync_copies"] +=
      static_cast<int64_t>(task.batch ? task.numBatches : 1);
}

}  // namespace

extern "C" {

aclError aclrtPointerGetAttributes(const void* ptr,
                                   aclrtPtrAttributes* attributes) {
  auto [lock, s] = Locked{};
  if (const auto code = count_call(s, "aclrtPointerGetAttributes"))
    return *code;
  if (ptr == nullptr || attributes == nullptr) {
    return error(s, ACL_ERROR_INVALID_PARAM, "null ptr or attributes");
  }
  *attributes = aclrtPtrAttributes{};
  locate(s, ptr, 1, &attributes->location);
  attributes->pageSize = 4096;  // SIM CHOICE
  return ACL_SUCCESS;
}

#ifndef SIMACL_OMIT_BATCH_API  // the variant that models CANN < 8.3
aclError aclrtHostRegisterV2(void* ptr, uint64_t size, uint32_t flag) {
  auto [lock, s] = Locked{};
  s.stats["last_register_flag"] = flag;
  if (const auto code = count_call(s, "aclrtHostRegisterV2")) return *code;
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  if (ptr == nullptr || size == 0) {
    return error(s, ACL_ERROR_INVALID_PARAM, "null ptr or size 0");
  }
  constexpr uint32_t kKnown =
      static_cast<uint32_t>(ACL_HOST_REG_MAPPED | ACL_HOST_REG_PINNED);
  if (flag == 0 || (flag & ~kKnown) != 0) {
    return error(s, ACL_ERROR_INVALID_PARAM,
                 "flag " + std::to_string(flag) +
                     ": the simulation registers with ACL_HOST_REG_MAPPED "
                     "and/or ACL_HOST_REG_PINNED only");
  }
  if (s.a5 && (flag & ACL_HOST_REG_PINNED) != 0) {
    return error(s, ACL_ERROR_RT_PARAM_INVALID,
                 "A5 rejects ACL_HOST_REG_PINNED; register with "
                 "ACL_HOST_REG_MAPPED only");
  }
  if (p % s.host_alignment != 0) {
    return error(s, ACL_ERROR_RT_ADDR_UNALIGNED,
                 "host address is not " + std::to_string(s.host_alignment) +
                     "-byte aligned");
  }
  if (const auto code = over_host_limit(s, size, "aclrtHostRegisterV2"))
    return *code;
  // Any overlap with a registered range (host registration or test hook).
  auto it = s.ranges.lower_bound(p);
  const bool overlaps_next = it != s.ranges.end() && it->first < p + size;
  const bool overlaps_prev =
      it != s.ranges.begin() && std::prev(it)->second.end > p;
  if (overlaps_next || overlaps_prev) {
    return error(s, ACL_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
                 "range overlaps memory already registered");
  }
  Range r{p + size, aclrtMemLocation{0, s.host_register_location}};
  r.host_registered = true;
  s.ranges[p] = r;
  return ACL_SUCCESS;
}
#endif

// aclrtMallocHost / aclrtFreeHost: page-locked host memory from the
// runtime (SIM CHOICE: 4 KiB-aligned, reported as ACL_MEM_LOCATION_TYPE_HOST).
aclError aclrtMallocHost(void** hostPtr, size_t size) {
  auto [lock, s] = Locked{};
  if (const auto code = count_call(s, "aclrtMallocHost")) return *code;
  if (hostPtr == nullptr || size == 0) {
    return error(s, ACL_ERROR_INVALID_PARAM, "null hostPtr or size 0");
  }
  if (const auto code = over_host_limit(s, size, "aclrtMallocHost"))
    return *code;
  const size_t align = s.host_alignment;
  const size_t rounded = (size + align - 1) / align * align;
  void* p = std::aligned_alloc(align, rounded);
  if (p == nullptr)
    return error(s, ACL_ERROR_RT_MEMORY_ALLOCATION, "no memory");
  const auto a = reinterpret_cast<uintptr_t>(p);
  Range r{a + size, aclrtMemLocation{0, ACL_MEM_LOCATION_TYPE_HOST}};
  r.malloc_host = true;
  s.ranges[a] = r;
  *hostPtr = p;
  return ACL_SUCCESS;
}

aclError aclrtFreeHost(void* hostPtr) {
  auto [lock, s] = Locked{};
  if (const auto code = count_call(s, "aclrtFreeHost")) return *code;
  const auto it = s.ranges.find(reinterpret_cast<uintptr_t>(hostPtr));
  if (it == s.ranges.end() || !it->second.malloc_host) {
    return error(s, ACL_ERROR_INVALID_PARAM,
                 "not an address from aclrtMallocHost");
  }
  s.ranges.erase(it);
  std::free(hostPtr);
  return ACL_SUCCESS;
}

aclError aclrtHostUnregister(void* ptr) {
  auto [lock, s] = Locked{};
  if (const auto code = count_call(s, "aclrtHostUnregister")) return *code;
  const auto it = s.ranges.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == s.ranges.end() || !it->second.host_registered) {
    return error(s, ACL_ERROR_HOST_MEMORY_NOT_REGISTERED,
                 "not the start of a host registration");
  }
  s.ranges.erase(it);  // pageable again
  return ACL_SUCCESS;
}

#ifndef SIMACL_OMIT_BATCH_API
aclError aclrtMemcpyBatchAsync(void** dsts, size_t* destMaxs, void** srcs,
                               size_t* sizes, size_t numBatches,
                               aclrtMemcpyBatchAttr* attrs,
                               size_t* attrsIndexes, size_t numAttrs,
                               size_t* failIndex, aclrtStream stream) {
  auto [lock, s] = Locked{};
  s.stats["last_stream"] = reinterpret_cast<int64_t>(stream);
  int64_t& max_entries = s.stats["max_entries"];
  max_entries = std::max(max_entries, static_cast<int64_t>(numBatches));
  const auto injected = count_call(s, "aclrtMemcpyBatchAsync");
  if (failIndex == nullptr) {
    return error(s, ACL_ERROR_INVALID_PARAM, "failIndex is null");
  }
  *failIndex = SIZE_MAX;  // documented value for "no specific entry"
  if (injected) {
    *failIndex = s.fired_fail_index;
    return *injected;
  }
  if (s.batch_unsupported) {
    return error(s, ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
                 "batch copies switched off by simacl_set");
  }
  if (dsts == nullptr || destMaxs == nullptr || srcs == nullptr ||
      sizes == nullptr || attrs == nullptr || attrsIndexes == nullptr) {
    return error(s, ACL_ERROR_INVALID_PARAM, "null array argument");
  }
  if (numBatches == 0 || numBatches > kSimMaxBatchEntries) {
    return error(
        s, ACL_ERROR_INVALID_PARAM,
        "numBatches=" + std::to_string(numBatches) + " is outside [1, 4096]");
  }
  if (numAttrs != 1 || attrsIndexes[0] != 0) {  // only what our op passes
    return error(s, ACL_ERROR_INVALID_PARAM,
                 "the simulation takes one attribute set from entry 0");
  }
  static const uint8_t kZero[sizeof(attrs[0].rsv)] = {};
  if (std::memcmp(attrs[0].rsv, kZero, sizeof(kZero)) != 0) {
    return error(s, ACL_ERROR_INVALID_PARAM, "attrs[].rsv must be 0");
  }
  const bool d2h = is_device(attrs[0].srcLoc) && !is_device(attrs[0].dstLoc);
  const bool h2d = !is_device(attrs[0].srcLoc) && is_device(attrs[0].dstLoc);
  if (!d2h && !h2d) {
    *failIndex = 0;
    return error(s, ACL_ERROR_INVALID_PARAM,
                 "a batch copies host-to-device or device-to-host only");
  }
  Task task;
  task.batch = true;
  task.dsts = dsts, task.destMaxs = destMaxs, task.srcs = srcs;
  task.sizes = sizes, task.numBatches = numBatches, task.attrs = attrs;
  // Check every entry before copying any (SIM CHOICE: all or nothing).
  for (size_t i = 0; i < numBatches; ++i) {
    std::string why;
    if (const aclError code = check_entry(s, task, i, &why); code != 0) {
      *failIndex = i;
      return error(s, code, why);
    }
  }
  const aclrtMemLocation& host = d2h ? attrs[0].dstLoc : attrs[0].srcLoc;
  enqueue(s, stream, task, host.type == ACL_MEM_LOCATION_TYPE_UNREGISTERED);
  return ACL_SUCCESS;
}
#endif

aclError aclrtMemcpyAsync(void* dst, size_t destMax, const void* src,
                          size_t count, aclrtMemcpyKind kind,
                          aclrtStream stream) {
  auto [lock, s] = Locked{};
  s.stats["last_stream"] = reinterpret_cast<int64_t>(stream);
  s.stats["last_kind"] = kind;
  if (const auto code = count_call(s, "aclrtMemcpyAsync")) return *code;
  if (dst == nullptr || src == nullptr || count > destMax) {
    return error(s, ACL_ERROR_INVALID_PARAM, "null address or count > destMax");
  }
  if (kind == ACL_MEMCPY_HOST_TO_HOST) {  // documented
    return error(s, ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
                 "no asynchronous host-to-host copies");
  }
  if (kind != ACL_MEMCPY_HOST_TO_DEVICE && kind != ACL_MEMCPY_DEVICE_TO_HOST) {
    return error(s, ACL_ERROR_INVALID_PARAM,  // only what our op passes
                 "the simulation copies host-to-device or device-to-host only");
  }
  aclrtMemLocation from, to;
  if (!locate(s, src, count, &from) || !locate(s, dst, count, &to)) {
    return error(s, ACL_ERROR_RT_INVALID_MEMORY_TYPE,
                 "range straddles registered memory");
  }
  const bool h2d = kind == ACL_MEMCPY_HOST_TO_DEVICE;
  if (is_device(from) == h2d || is_device(to) != h2d) {
    return error(s, ACL_ERROR_RT_INVALID_MEMORY_TYPE,  // SIM CHOICE
                 "memory locations do not match kind " + std::to_string(kind));
  }
  enqueue(s, stream, Task{dst, src, count},  // pageable: as for the batch API
          from.type == ACL_MEM_LOCATION_TYPE_UNREGISTERED ||
              to.type == ACL_MEM_LOCATION_TYPE_UNREGISTERED);
  return ACL_SUCCESS;
}

aclError aclrtSynchronizeStream(aclrtStream stream) {
  auto [lock, s] = Locked{};
  if (const auto code = count_call(s, "aclrtSynchronizeStream")) return *code;
  // SIM CHOICE: ACL_ERROR_RT_COPY_DATA; last_error is set by execute.
  return drain(s, stream) == 0 ? ACL_SUCCESS : ACL_ERROR_RT_COPY_DATA;
}

const char* aclGetRecentErrMsg() {
  auto [lock, s] = Locked{};
  thread_local std::string copy;  // stays valid after the lock is released
  copy = s.last_error;
  return copy.c_str();
}

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
