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
// The test hooks (simacl_*) and the harness that runs the real core against
// this runtime: sim_hooks.cpp; the shared state: sim_state.h.
#include <acl/acl_rt.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "sim_state.h"

using namespace simacl;  // NOLINT: the simulation's own names

namespace {

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

}  // extern "C"
