// SIMULATION of the ACL runtime functions that
// csrc/kv_offload/npu/acl_batch_copy.cpp calls -- NOT CANN. There is no device
// and no DMA here: "device" memory is host memory a test registered as such,
// and a stream is a queue of memcpy tasks that runs when it is synchronized
// (aclrtSynchronizeStream), in submission order. Compiled against the real
// declarations (torch-npu wheel's acl/acl_rt.h), so signatures match.
//
// Semantics follow the CANN documentation of aclrtMemcpyBatchAsync,
// aclrtMemcpyAsync, aclrtMemLocationType and aclrtMemcpyBatchAttr:
//  - batch: dsts/srcs/sizes have numBatches entries; rsv must be 0; one
//    direction per batch, host-to-device or device-to-host;
//    failIndex names the bad entry for memory-attribute / direction checks
//    and is SIZE_MAX for errors not tied to an entry; pageable host memory
//    (ACL_MEM_LOCATION_TYPE_UNREGISTERED) is copied synchronously.
//  - aclrtMemcpyAsync with ACL_MEMCPY_HOST_TO_HOST returns
//    ACL_ERROR_RT_FEATURE_NOT_SUPPORT.
// Only what the npu backend calls is simulated: one attribute set per batch
// (numAttrs == 1, attrsIndexes[0] == 0; anything else is
// ACL_ERROR_INVALID_PARAM) and the kinds HOST_TO_DEVICE and DEVICE_TO_HOST.
// Where the docs are silent the simulation makes a choice, marked SIM
// CHOICE: the 4096-entry cap, the error codes of failed checks, that a
// failing batch copies nothing, and WHEN the runtime reads a batch's host
// arrays. The docs do not say that aclrtMemcpyBatchAsync copies dsts,
// destMaxs, srcs, sizes, attrs and attrsIndexes at enqueue, so the simulation
// takes the least favourable reading: it validates them at enqueue (errors
// are returned by the call, as documented) but keeps only the POINTERS, and
// reads the arrays again when the copy executes, at aclrtSynchronizeStream.
// A caller that frees or reuses them before then gets copies of whatever the
// arrays hold by that time; an entry that no longer names the registered
// memory its attrs declare is skipped (a device would fault) and the
// synchronize returns ACL_ERROR_RT_COPY_DATA (SIM CHOICE). Copies with a
// pageable host side run at enqueue, as documented ("if the memory is not
// page-locked, synchronous copying will be performed").
//
// Host registration (aclrtHostRegisterV2 / aclrtHostUnregister), following
// the CANN docs: "register pageable host memory (malloc, new, a default
// mmap) as page-locked memory" with ACL_HOST_REG_PINNED; the address must
// be 4 KiB-aligned; unregister with aclrtHostUnregister(ptr). A registered
// range becomes page-locked host memory known to ACL: aclrtPointerGetAttributes
// reports ACL_MEM_LOCATION_TYPE_HOST for it (SIM CHOICE: the docs do not say
// what it reports; simacl_set_host_register_location changes it), and copies
// from or to it are queued like any pinned copy. Unregistering makes it
// pageable again; copies still queued then fault when they run. SIM CHOICES:
// the codes ACL_ERROR_RT_ADDR_UNALIGNED (unaligned), ACL_ERROR_INVALID_PARAM
// (null, size 0, flag 0 or with bits other than MAPPED / PINNED; MAPPED
// alone is accepted, as A5 requires),
// ACL_ERROR_HOST_MEMORY_ALREADY_REGISTERED (overlaps any registered range)
// and ACL_ERROR_HOST_MEMORY_NOT_REGISTERED (unregister of an address that
// is not the start of a host registration); the two last are the header's
// own names for these cases. What a real runtime does on kernels <= 5.10
// (the docs: pageable memory "causes exceptions" there) is not modelled.
#include "sim_acl.h"

#include <acl/acl_rt.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>

namespace {

constexpr size_t kSimMaxBatchEntries = 4096;  // SIM CHOICE, see header

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
// the caller's array POINTERS (read at execution, see the header comment); a
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
  // simacl_stat's counters and records (calls are counted by API name).
  std::map<std::string, int64_t> stats{{"last_kind", -1},
                                       {"last_register_flag", -1}};
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

// Counts the call; true (with *code set) when an injected failure fires.
bool count_call(State& s, const char* api, aclError* code) {
  const auto n = static_cast<size_t>(++s.stats[api]);
  const auto it = s.injections.find(api);
  if (it == s.injections.end() || it->second.nth_call != n) return false;
  const Injection fired = it->second;
  s.injections.erase(it);  // one shot
  s.fired_fail_index = fired.fail_index;
  *code = error(
      s, fired.code,
      std::string("injected failure of ") + api + " call " + std::to_string(n));
  return true;
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

// simacl_set_host_limits' size limit: true (with *code set) when one call
// of `api` asks for more than it.
bool over_host_limit(State& s, uint64_t size, const char* api, aclError* code) {
  if (s.max_host_bytes == 0 || size <= s.max_host_bytes) return false;
  *code = error(s, ACL_ERROR_RT_MEMORY_ALLOCATION,
                std::to_string(size) + " bytes in one " + api +
                    ", more than the simulated limit of " +
                    std::to_string(s.max_host_bytes));
  return true;
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
aclError check_entry(const State& s, void** dsts, size_t* destMaxs, void** srcs,
                     size_t* sizes, size_t i, const aclrtMemcpyBatchAttr& attr,
                     std::string* why) {
  *why = "entry " + std::to_string(i) + ": ";
  if (srcs[i] == nullptr || dsts[i] == nullptr || sizes[i] == 0 ||
      sizes[i] > destMaxs[i]) {
    *why += "null address, zero size or size > destMax";
    return ACL_ERROR_INVALID_PARAM;
  }
  aclrtMemLocation src, dst;
  if (!locate(s, srcs[i], sizes[i], &src) ||
      !locate(s, dsts[i], sizes[i], &dst) || !same_location(attr.srcLoc, src) ||
      !same_location(attr.dstLoc, dst)) {
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
    if (check_entry(s, t.dsts, t.destMaxs, t.srcs, t.sizes, i, *t.attrs,
                    &why) != ACL_SUCCESS) {
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

// Documented: a copy with a pageable host side is synchronous, i.e. runs now
// (after the work queued before it, which a synchronous copy waits for).
void run_synchronously(State& s, aclrtStream stream, const Task& task) {
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
  aclError code;
  if (count_call(s, "aclrtPointerGetAttributes", &code)) return code;
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
  aclError code;
  if (count_call(s, "aclrtHostRegisterV2", &code)) return code;
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
  if (over_host_limit(s, size, "aclrtHostRegisterV2", &code)) return code;
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
  aclError code;
  if (count_call(s, "aclrtMallocHost", &code)) return code;
  if (hostPtr == nullptr || size == 0) {
    return error(s, ACL_ERROR_INVALID_PARAM, "null hostPtr or size 0");
  }
  if (over_host_limit(s, size, "aclrtMallocHost", &code)) return code;
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
  aclError code;
  if (count_call(s, "aclrtFreeHost", &code)) return code;
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
  aclError code;
  if (count_call(s, "aclrtHostUnregister", &code)) return code;
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
  aclError code;
  const bool injected = count_call(s, "aclrtMemcpyBatchAsync", &code);
  if (failIndex == nullptr) {
    return error(s, ACL_ERROR_INVALID_PARAM, "failIndex is null");
  }
  *failIndex = SIZE_MAX;  // documented value for "no specific entry"
  if (injected) {
    *failIndex = s.fired_fail_index;
    return code;
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
  // Check every entry before copying any (SIM CHOICE: all or nothing).
  for (size_t i = 0; i < numBatches; ++i) {
    std::string why;
    code = check_entry(s, dsts, destMaxs, srcs, sizes, i, attrs[0], &why);
    if (code != ACL_SUCCESS) {
      *failIndex = i;
      return error(s, code, why);
    }
  }
  Task task;
  task.batch = true;
  task.dsts = dsts, task.destMaxs = destMaxs, task.srcs = srcs;
  task.sizes = sizes, task.numBatches = numBatches, task.attrs = attrs;
  const aclrtMemLocation& host = d2h ? attrs[0].dstLoc : attrs[0].srcLoc;
  if (host.type == ACL_MEM_LOCATION_TYPE_UNREGISTERED) {
    run_synchronously(s, stream, task);
  } else {
    s.streams[stream].push_back(task);
  }
  return ACL_SUCCESS;
}
#endif

aclError aclrtMemcpyAsync(void* dst, size_t destMax, const void* src,
                          size_t count, aclrtMemcpyKind kind,
                          aclrtStream stream) {
  auto [lock, s] = Locked{};
  s.stats["last_stream"] = reinterpret_cast<int64_t>(stream);
  s.stats["last_kind"] = kind;
  aclError code;
  if (count_call(s, "aclrtMemcpyAsync", &code)) return code;
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
  const Task task{dst, src, count};
  if (from.type == ACL_MEM_LOCATION_TYPE_UNREGISTERED ||
      to.type == ACL_MEM_LOCATION_TYPE_UNREGISTERED) {
    run_synchronously(s, stream, task);  // pageable, as for the batch API
  } else {
    s.streams[stream].push_back(task);
  }
  return ACL_SUCCESS;
}

aclError aclrtSynchronizeStream(aclrtStream stream) {
  auto [lock, s] = Locked{};
  aclError code;
  if (count_call(s, "aclrtSynchronizeStream", &code)) return code;
  // SIM CHOICE: ACL_ERROR_RT_COPY_DATA; last_error is set by execute.
  return drain(s, stream) == 0 ? ACL_SUCCESS : ACL_ERROR_RT_COPY_DATA;
}

const char* aclGetRecentErrMsg() {
  auto [lock, s] = Locked{};
  thread_local std::string copy;  // stays valid after the lock is released
  copy = s.last_error;
  return copy.c_str();
}

void simacl_reset(void) {
  auto [lock, s] = Locked{};
  s = State{};  // queued copies are dropped, never run
}

void simacl_set(const char* name, int64_t value) {
  auto [lock, s] = Locked{};
  const std::string key = name;
  if (key == "batch_unsupported") s.batch_unsupported = value != 0;
  if (key == "host_register_location") {
    s.host_register_location = static_cast<aclrtMemLocationType>(value);
  }
  if (key == "max_host_bytes") s.max_host_bytes = static_cast<uint64_t>(value);
  if (key == "host_alignment") {
    s.host_alignment = value == 0 ? 4096 : static_cast<uint64_t>(value);
  }
  if (key == "a5") s.a5 = value != 0;
}

int64_t simacl_stat(const char* name) {
  auto [lock, s] = Locked{};
  if (std::string(name) == "pending") {
    size_t n = 0;
    for (const auto& [stream, tasks] : s.streams) n += tasks.size();
    return static_cast<int64_t>(n);
  }
  const auto it = s.stats.find(name);
  return it == s.stats.end() ? 0 : it->second;
}

int simacl_location_of(const void* ptr) {
  auto [lock, s] = Locked{};
  aclrtMemLocation loc;
  locate(s, ptr, 1, &loc);
  return loc.type;
}

void simacl_register(const void* ptr, size_t size, int location_type,
                     uint32_t id) {
  auto [lock, s] = Locked{};
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  s.ranges[p] = Range{
      p + size,
      aclrtMemLocation{id, static_cast<aclrtMemLocationType>(location_type)}};
}

void simacl_inject_failure(const char* api, size_t nth_call, int code,
                           size_t fail_index) {
  Locked{}.s.injections[api] = Injection{api, nth_call, code, fail_index};
}

}  // extern "C"
