// "npu" implementation of kv_offload_host_register / _unregister and
// kv_offload_host_alloc / _free (contract:
// csrc/kv_offload/ops.h): turns the errors of the ACL-facing core
// (acl_host_register.cpp, also tested against a simulated ACL runtime in
// tests/sim_acl/) into c10::Error.
#include <c10/util/Exception.h>

#include <exception>

#include "acl_host_register.h"
#include "ops.h"

namespace vllm_ascend::kv_offload {
namespace {

// f(), its std::exception rethrown as c10::Error.
template <typename F>
auto as_c10_error(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace

void host_register_npu(uint64_t addr, uint64_t size, uint32_t flags) {
  as_c10_error([&] { npu::register_host_range(addr, size, flags); });
}

void host_unregister_npu(uint64_t addr) {
  as_c10_error([&] { npu::unregister_host_range(addr); });
}

uint64_t host_alloc_npu(uint64_t size) {
  return as_c10_error([&] { return npu::allocate_host(size); });
}

void host_free_npu(uint64_t addr) {
  as_c10_error([&] { npu::free_host(addr); });
}

}  // namespace vllm_ascend::kv_offload
