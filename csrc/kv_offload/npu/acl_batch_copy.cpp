// ACL-facing core of the "npu" backend: batch copies; see acl_core.h, ops.h.
#include <algorithm>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

#include "acl_core.h"

// Both symbols are newer than some CANN releases torch_npu still runs on
// (torch_npu itself looks them up at run time). Weak references keep the
// extension importable there: a missing batch API is handled like "not
// supported", a missing aclrtPointerGetAttributes raises a clear error.
#pragma weak aclrtMemcpyBatchAsync
#pragma weak aclrtPointerGetAttributes

namespace vllm_ascend::kv_offload::npu {
namespace {

// What a job needs besides its regions: one attribute set for the batch API,
// the kind for the per-copy fallback, and the direction for messages.
struct Plan {
  CopyDirection direction;
  aclrtMemcpyBatchAttr attr;
  aclrtMemcpyKind kind;
};

const char* direction_name(CopyDirection d) {
  return d == CopyDirection::kHostToDevice ? "host-to-device"
                                           : "device-to-host";
}

// Return codes taken to mean "this runtime / SoC has no batch copies".
// Which one a given CANN release returns is not verified, so accept all.
bool is_not_supported(aclError e) {
  return e == ACL_ERROR_RT_FEATURE_NOT_SUPPORT ||
         e == ACL_ERROR_FEATURE_UNSUPPORTED || e == ACL_ERROR_API_NOT_SUPPORT;
}

std::string describe(const CopyRegion& r) {
  return "src_addrs=" + hex(r.src) + ", dst_addrs=" + hex(r.dst) +
         ", bytes=" + std::to_string(r.size);
}

[[noreturn]] void fail(const std::string& what) {
  throw std::runtime_error("swap_blocks_batch(device='npu'): " + what);
}

aclrtMemLocation location_of(uint64_t addr, const char* name,
                             const CopyRegion& r) {
  aclrtPtrAttributes attrs{};
  const aclError e =
      aclrtPointerGetAttributes(reinterpret_cast<const void*>(addr), &attrs);
  if (e != ACL_SUCCESS) {
    fail("aclrtPointerGetAttributes(" + std::string(name) + "[" +
         std::to_string(r.first_fragment) + "]=" + hex(addr) +
         ") failed with ACL error " + std::to_string(e) + acl_detail());
  }
  return attrs.location;
}

// The dispatcher only knows addresses, so the direction comes from the
// runtime's view of the first region; the batch API requires one direction
// per call anyway, and KV offloading jobs are one-directional.
Plan classify(const CopyRegion& first) {
  if (&aclrtPointerGetAttributes == nullptr) {
    fail(
        "this CANN runtime has no aclrtPointerGetAttributes, which the npu "
        "backend needs to tell host from device memory; upgrade CANN (8.3 "
        "or newer)");
  }
  const aclrtMemLocation src = location_of(first.src, "src_addrs", first);
  const aclrtMemLocation dst = location_of(first.dst, "dst_addrs", first);
  const bool src_dev = src.type == ACL_MEM_LOCATION_TYPE_DEVICE;
  const bool dst_dev = dst.type == ACL_MEM_LOCATION_TYPE_DEVICE;
  const std::string where = "fragment " + std::to_string(first.first_fragment) +
                            " (" + describe(first) + ", location types " +
                            std::to_string(src.type) + " -> " +
                            std::to_string(dst.type) + ")";
  if (src_dev && dst_dev) {
    fail(where +
         " copies device to device; the npu backend only copies between "
         "host and device (aclrtMemcpyBatchAsync has no device-to-device "
         "mode)");
  }
  if (!src_dev && !dst_dev) {
    fail(where +
         " has no device side; the npu backend only copies between host "
         "and device, use device='cpu' for host-to-host copies");
  }
  // Pageable host memory would make the batch API copy synchronously (and
  // aclrtMemcpyAsync may fail on it), defeating asynchronous offloading.
  const aclrtMemLocationType host = src_dev ? dst.type : src.type;
  if (host != ACL_MEM_LOCATION_TYPE_HOST &&
      host != ACL_MEM_LOCATION_TYPE_HOST_NUMA) {
    fail(where +
         ": the host side is not page-locked memory known to ACL; allocate "
         "the CPU buffer pinned (torch pin_memory=True, i.e. "
         "aclrtMallocHost)");
  }
  Plan plan{};  // zeroes attr.rsv, which must be 0
  plan.direction =
      src_dev ? CopyDirection::kDeviceToHost : CopyDirection::kHostToDevice;
  plan.kind = src_dev ? ACL_MEMCPY_DEVICE_TO_HOST : ACL_MEMCPY_HOST_TO_DEVICE;
  // The runtime's own answer (type, and device / NUMA id) is what it expects.
  plan.attr.srcLoc = src;
  plan.attr.dstLoc = dst;
  return plan;
}

// Where copy() builds the arrays of aclrtMemcpyBatchAsync in the caller's
// workspace: one attribute set and its index, then srcs, dsts and sizes for
// all n regions (each call of a job passes its own slice of them, so no call
// overwrites the arrays of an earlier one that may not have run yet).
struct BatchArrays {
  explicit BatchArrays(size_t n)
      : attr(layout.add<aclrtMemcpyBatchAttr>(1)),
        attr_index(layout.add<size_t>(1)),
        srcs(layout.add<void*>(n)),
        dsts(layout.add<void*>(n)),
        sizes(layout.add<size_t>(n)) {}

  HostArrayLayout layout;  // declared first: the offsets below use it
  size_t attr;
  size_t attr_index;
  size_t srcs;
  size_t dsts;
  size_t sizes;
};

void check_workspace(const void* workspace, size_t bytes, size_t needed) {
  const auto addr = reinterpret_cast<uintptr_t>(workspace);
  if (workspace == nullptr || bytes < needed ||
      addr % HostArrayLayout::kAlignment != 0) {
    fail("the workspace (" + std::to_string(bytes) + " bytes at " + hex(addr) +
         ") must be at least " + std::to_string(needed) + " bytes aligned to " +
         std::to_string(HostArrayLayout::kAlignment) +
         "; allocate AclBatchCopier::workspace_bytes() for this job");
  }
}

// Raises `what`. Batch calls of the failing job that were enqueued already
// may still read the workspace, which the caller frees once copy() throws:
// wait for them first.
[[noreturn]] void fail_after_enqueue(std::string what, size_t batch_calls,
                                     aclrtStream stream) {
  if (batch_calls > 0) {
    const aclError e = aclrtSynchronizeStream(stream);
    if (e != ACL_SUCCESS) {
      what += "; waiting for the " + std::to_string(batch_calls) +
              " batch call(s) already enqueued (aclrtSynchronizeStream) "
              "failed as well, with ACL error " +
              std::to_string(e) + acl_detail();
    }
  }
  fail(what);
}

}  // namespace

std::string hex(uint64_t v) {
  std::ostringstream out;
  out << "0x" << std::hex << v;
  return out.str();
}

std::string acl_detail() {
  const char* msg = aclGetRecentErrMsg();
  return msg != nullptr && *msg != '\0' ? std::string("; ACL reports: ") + msg
                                        : std::string();
}

size_t AclBatchCopier::workspace_bytes(size_t num_regions,
                                       bool per_copy) const {
  if (num_regions == 0 || per_copy || &aclrtMemcpyBatchAsync == nullptr ||
      batch_unsupported_.load()) {
    return 0;
  }
  return BatchArrays(num_regions).layout.bytes();
}

BatchCopyReport AclBatchCopier::copy(const std::vector<CopyRegion>& regions,
                                     aclrtStream stream, void* workspace,
                                     size_t workspace_bytes, bool per_copy) {
  BatchCopyReport report;
  if (regions.empty()) return report;
  Plan plan = classify(regions.front());
  report.direction = plan.direction;
  const char* dir = direction_name(plan.direction);
  const size_t n = regions.size();
  // exchange() so that exactly one job reports (and its caller logs) it.
  auto disable_batch_api = [&] {
    if (!batch_unsupported_.exchange(true)) report.fallback_started = true;
  };
  if (&aclrtMemcpyBatchAsync == nullptr) disable_batch_api();

  size_t begin = 0;  // first region not submitted yet
  if (!per_copy && !batch_unsupported_.load()) {
    const BatchArrays arrays(n);
    check_workspace(workspace, workspace_bytes, arrays.layout.bytes());
    auto* attr = place_array<aclrtMemcpyBatchAttr>(workspace, arrays.attr, 1);
    *attr = plan.attr;
    // 0: the single attribute set applies from entry 0.
    size_t* attr_index = place_array<size_t>(workspace, arrays.attr_index, 1);
    void** srcs = place_array<void*>(workspace, arrays.srcs, n);
    void** dsts = place_array<void*>(workspace, arrays.dsts, n);
    size_t* sizes = place_array<size_t>(workspace, arrays.sizes, n);
    for (size_t i = 0; i < n; ++i) {
      srcs[i] = reinterpret_cast<void*>(regions[i].src);
      dsts[i] = reinterpret_cast<void*>(regions[i].dst);
      sizes[i] = static_cast<size_t>(regions[i].size);
    }
    const size_t calls = (n + kMaxBatchEntries - 1) / kMaxBatchEntries;
    for (size_t call = 1; begin < n; ++call) {
      const size_t count = std::min(n - begin, kMaxBatchEntries);
      size_t fail_index = SIZE_MAX;  // an output of the call itself
      // destMaxs = sizes: each destination range is exactly `size` bytes.
      const aclError e = aclrtMemcpyBatchAsync(
          dsts + begin, sizes + begin, srcs + begin, sizes + begin, count, attr,
          attr_index, 1, &fail_index, stream);
      if (e == ACL_SUCCESS) {
        ++report.batch_calls;
        begin += count;
        continue;
      }
      if (is_not_supported(e)) {
        disable_batch_api();
        break;  // the loop below copies regions [begin, n)
      }
      const std::string call_desc = "call " + std::to_string(call) + " of " +
                                    std::to_string(calls) + " (" +
                                    std::to_string(count) + " entries)";
      if (fail_index < count) {
        const CopyRegion& r = regions[begin + fail_index];
        fail_after_enqueue("aclrtMemcpyBatchAsync (" + std::string(dir) +
                               ") failed with ACL error " + std::to_string(e) +
                               " at fragment " +
                               std::to_string(r.first_fragment) + " (entry " +
                               std::to_string(fail_index) + " of " + call_desc +
                               ", after merging adjacent fragments; " +
                               describe(r) + ")" + acl_detail(),
                           report.batch_calls, stream);
      }
      fail_after_enqueue(
          "aclrtMemcpyBatchAsync (" + std::string(dir) +
              ") failed with ACL error " + std::to_string(e) + " in " +
              call_desc + " starting at fragment " +
              std::to_string(regions[begin].first_fragment) +
              "; the runtime named no single entry (failIndex=" +
              (fail_index == SIZE_MAX ? std::string("SIZE_MAX")
                                      : std::to_string(fail_index)) +
              ")" + acl_detail(),
          report.batch_calls, stream);
    }
  }

  // Per-copy fallback once the batch API is known to be unsupported.
  for (size_t i = begin; i < n; ++i) {
    const CopyRegion& r = regions[i];
    const aclError e = aclrtMemcpyAsync(
        reinterpret_cast<void*>(r.dst), static_cast<size_t>(r.size),
        reinterpret_cast<const void*>(r.src), static_cast<size_t>(r.size),
        plan.kind, stream);
    if (e != ACL_SUCCESS) {
      fail_after_enqueue("aclrtMemcpyAsync (" + std::string(dir) +
                             ", per-copy fallback) failed with ACL error " +
                             std::to_string(e) + " at fragment " +
                             std::to_string(r.first_fragment) +
                             " (after merging adjacent fragments; " +
                             describe(r) + ")" + acl_detail(),
                         report.batch_calls, stream);
    }
    ++report.single_calls;
  }
  return report;
}

}  // namespace vllm_ascend::kv_offload::npu
