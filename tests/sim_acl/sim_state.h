// SIMULATION (tests only, not CANN): the state of the simulated ACL runtime,
// shared by its ACL functions (sim_acl.cpp) and its test hooks and harness
// (sim_hooks.cpp), which are linked into one library: one registry of
// memory ranges, queued copies, counters, injected failures and switches.
#pragma once

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

namespace simacl {

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

inline std::mutex g_mu;
inline State g_state;

// The state, locked while this lives: `auto [lock, s] = Locked{};`.
struct Locked {
  std::lock_guard<std::mutex> lock{g_mu};
  State& s = g_state;
};

// Records the message aclGetRecentErrMsg returns and passes `code` through.
inline aclError error(State& s, aclError code, const std::string& msg) {
  s.last_error = "SIMULATED ACL: " + msg;
  return code;
}

// Counts the call; the code of an injected failure that fires on it.
inline std::optional<aclError> count_call(State& s, const char* api) {
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
inline bool locate(const State& s, const void* ptr, size_t n,
                   aclrtMemLocation* out) {
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
inline std::optional<aclError> over_host_limit(State& s, uint64_t size,
                                               const char* api) {
  if (s.max_host_bytes == 0 || size <= s.max_host_bytes) return {};
  return error(s, ACL_ERROR_RT_MEMORY_ALLOCATION,
               std::to_string(size) + " bytes in one " + api +
                   ", more than the simulated limit of " +
                   std::to_string(s.max_host_bytes));
}

inline bool is_device(const aclrtMemLocation& loc) {
  return loc.type == ACL_MEM_LOCATION_TYPE_DEVICE;
}

// Declared and actual location agree (device id only matters on a device).
inline bool same_location(const aclrtMemLocation& declared,
                          const aclrtMemLocation& actual) {
  return declared.type == actual.type &&
         (!is_device(declared) || declared.id == actual.id);
}

}  // namespace simacl
