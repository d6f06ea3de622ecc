// SIMULATION harness: a C entry point (for ctypes) that runs the real
// ACL-facing core of the npu backend, csrc/kv_offload/npu/acl_batch_copy.cpp,
// which in this library is linked against the simulated ACL runtime of
// sim_acl.cpp.
#include <cstring>
#include <exception>
#include <memory>
#include <vector>

#include "acl_batch_copy.h"
#include "sim_acl.h"

namespace {

std::unique_ptr<vllm_ascend::kv_offload::npu::AclBatchCopier>& copier() {
  static auto c =
      std::make_unique<vllm_ascend::kv_offload::npu::AclBatchCopier>();
  return c;
}

}  // namespace

int simacl_core_copy(const uint64_t* src, const uint64_t* dst,
                     const uint64_t* sizes, const int64_t* first_fragment,
                     size_t n, void* stream, SimCopyReport* report, char* err,
                     size_t err_len) {
  std::vector<vllm_ascend::kv_offload::CopyRegion> regions(n);
  for (size_t i = 0; i < n; ++i) {
    regions[i] = {src[i], dst[i], sizes[i], first_fragment[i]};
  }
  try {
    const auto r = copier()->copy(regions, stream);
    report->direction =
        r.direction ==
                vllm_ascend::kv_offload::npu::CopyDirection::kHostToDevice
            ? 0
            : 1;
    report->fallback_started = r.fallback_started ? 1 : 0;
    report->batch_calls = r.batch_calls;
    report->single_calls = r.single_calls;
    return 0;
  } catch (const std::exception& e) {
    std::strncpy(err, e.what(), err_len - 1);
    err[err_len - 1] = '\0';
    return 1;
  }
}

void simacl_core_reset(void) {
  copier() = std::make_unique<vllm_ascend::kv_offload::npu::AclBatchCopier>();
}
