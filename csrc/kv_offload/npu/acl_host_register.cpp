// ACL-facing core of host-memory registration; see acl_core.h.
#include <stdexcept>
#include <string>

#include "acl_core.h"

// Newer than some CANN releases torch_npu still runs on: a weak reference
// keeps the extension importable there (registration then fails clearly).
#pragma weak aclrtHostRegisterV2
#pragma weak aclrtPointerGetAttributes

namespace vllm_ascend::kv_offload::npu {
namespace {

std::string range(uint64_t addr, uint64_t size) {
  return "[" + hex(addr) + ", " + hex(addr + size) + ") (" +
         std::to_string(size) + " bytes)";
}

[[noreturn]] void fail(const char* op, const std::string& what) {
  throw std::runtime_error(std::string(op) + "(device='npu'): " + what);
}

constexpr const char* kRegister = "kv_offload_host_register";
constexpr const char* kUnregister = "kv_offload_host_unregister";
constexpr const char* kAlloc = "kv_offload_host_alloc";
constexpr const char* kFree = "kv_offload_host_free";

// "" when ACL reports the first and the last byte of [addr, addr + size) as
// page-locked host memory, which the npu copy backend requires; else why not.
std::string not_page_locked_host(uint64_t addr, uint64_t size) {
  for (const uint64_t b : {addr, addr + size - 1}) {
    aclrtPtrAttributes attrs{};
    const aclError e =
        aclrtPointerGetAttributes(reinterpret_cast<const void*>(b), &attrs);
    if (e != ACL_SUCCESS) {
      return "aclrtPointerGetAttributes(" + hex(b) +
             ") failed with ACL error " + std::to_string(e) + acl_detail();
    }
    const aclrtMemLocationType t = attrs.location.type;
    if (t != ACL_MEM_LOCATION_TYPE_HOST &&
        t != ACL_MEM_LOCATION_TYPE_HOST_NUMA) {
      return "aclrtPointerGetAttributes reports location type " +
             std::to_string(t) + " for byte " + hex(b) +
             ", not page-locked host memory (ACL_MEM_LOCATION_TYPE_HOST), so "
             "the npu copy backend would refuse it";
    }
  }
  return "";
}

std::string flag_names(uint32_t flags) {
  std::string out;
  if (flags & ACL_HOST_REG_MAPPED) out = "ACL_HOST_REG_MAPPED";
  if (flags & ACL_HOST_REG_PINNED) {
    out += out.empty() ? "ACL_HOST_REG_PINNED" : "|ACL_HOST_REG_PINNED";
  }
  return out;
}

}  // namespace

void register_host_range(uint64_t addr, uint64_t size, uint32_t flags) {
  if (addr == 0 || size == 0) {
    fail(kRegister, "nothing to register: range " + range(addr, size) +
                        " is empty or at address 0");
  }
  if ((flags & ACL_HOST_REG_MAPPED) == 0 ||
      (flags & ~kHostRegisterKnownFlags) != 0) {
    fail(kRegister, "flags " + hex(flags) + " for range " + range(addr, size) +
                        ": pass ACL_HOST_REG_MAPPED (0x2), optionally | "
                        "ACL_HOST_REG_PINNED (0x10000000)");
  }
  if (addr % kHostRegisterAlignment != 0) {
    fail(kRegister, "range " + range(addr, size) +
                        " does not start on a 4 KiB boundary, which "
                        "aclrtHostRegisterV2 requires; register a "
                        "page-aligned mapping (e.g. an mmap)");
  }
  if (&aclrtHostRegisterV2 == nullptr ||
      &aclrtPointerGetAttributes == nullptr) {
    fail(kRegister,
         "this CANN runtime has no aclrtHostRegisterV2 / "
         "aclrtPointerGetAttributes, needed to page-lock range " +
             range(addr, size) +
             "; upgrade CANN to a release that has them (the CANN 8.5 "
             "documentation does)");
  }
  const aclError e =
      aclrtHostRegisterV2(reinterpret_cast<void*>(addr), size, flags);
  if (e != ACL_SUCCESS) {
    fail(kRegister, "aclrtHostRegisterV2(range " + range(addr, size) + ", " +
                        flag_names(flags) + ") failed with ACL error " +
                        std::to_string(e) + acl_detail());
  }
  // The copy backend accepts only memory ACL reports as page-locked host
  // memory; a registration it would refuse is undone here, at start-up,
  // rather than failing every copy later.
  const std::string why = not_page_locked_host(addr, size);
  if (!why.empty()) {
    const aclError u = aclrtHostUnregister(reinterpret_cast<void*>(addr));
    fail(kRegister,
         "range " + range(addr, size) +
             " was registered (aclrtHostRegisterV2, " + flag_names(flags) +
             "), but " + why + "; it was unregistered again" +
             (u == ACL_SUCCESS
                  ? std::string()
                  : " (aclrtHostUnregister failed as well, with ACL error " +
                        std::to_string(u) + ")"));
  }
}

void unregister_host_range(uint64_t addr) {
  if (addr == 0) fail(kUnregister, "address 0 was never registered");
  const aclError e = aclrtHostUnregister(reinterpret_cast<void*>(addr));
  if (e != ACL_SUCCESS) {
    fail(kUnregister, "aclrtHostUnregister(" + hex(addr) +
                          ") failed with ACL error " + std::to_string(e) +
                          acl_detail());
  }
}

uint64_t allocate_host(uint64_t size) {
  if (size == 0) fail(kAlloc, "nothing to allocate: size 0");
  void* ptr = nullptr;
  const aclError e = aclrtMallocHost(&ptr, size);
  if (e != ACL_SUCCESS || ptr == nullptr) {
    fail(kAlloc, "aclrtMallocHost(" + std::to_string(size) +
                     " bytes) failed with ACL error " + std::to_string(e) +
                     acl_detail());
  }
  const auto addr = reinterpret_cast<uint64_t>(ptr);
  if (&aclrtPointerGetAttributes == nullptr) return addr;  // nothing to ask
  const std::string why = not_page_locked_host(addr, size);
  if (!why.empty()) {
    aclrtFreeHost(ptr);
    fail(kAlloc, "aclrtMallocHost returned " + range(addr, size) + ", but " +
                     why + "; it was freed again");
  }
  return addr;
}

void free_host(uint64_t addr) {
  if (addr == 0) fail(kFree, "address 0 was never allocated");
  const aclError e = aclrtFreeHost(reinterpret_cast<void*>(addr));
  if (e != ACL_SUCCESS) {
    fail(kFree, "aclrtFreeHost(" + hex(addr) + ") failed with ACL error " +
                    std::to_string(e) + acl_detail());
  }
}

}  // namespace vllm_ascend::kv_offload::npu
