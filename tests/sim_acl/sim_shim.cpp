// SIMULATION harness: a C entry point (for ctypes) that runs the real
// ACL-facing core of the npu backend, csrc/kv_offload/npu/acl_batch_copy.cpp,
// which in this library is linked against the simulated ACL runtime of
// sim_acl.cpp. Like the op (csrc/kv_offload/npu/ops_npu.cpp) it owns
// each job's workspace; unlike the op, a test decides how long it lives.
#include <acl/acl_rt.h>

#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

#include "acl_core.h"
#include "sim_acl.h"

namespace {

namespace npu = vllm_ascend::kv_offload::npu;

std::unique_ptr<npu::AclBatchCopier>& copier() {
  static auto c = std::make_unique<npu::AclBatchCopier>();
  return c;
}

// Workspaces of jobs whose copies may not have run yet, freed by
// simacl_core_sync once they have (the transfer queue's end-event wait).
std::mutex g_mu;
std::vector<std::unique_ptr<unsigned char[]>> g_workspaces;

constexpr unsigned char kPoison = 0xA5;  // what a freed workspace holds

// Runs f(); returns 0, or 1 with the exception's message in `err`.
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

int simacl_core_copy(const uint64_t* src, const uint64_t* dst,
                     const uint64_t* sizes, const int64_t* first_fragment,
                     size_t n, void* stream, int64_t workspace_bytes,
                     int free_workspace_at_return, int per_copy,
                     SimCopyReport* report, char* err, size_t err_len) {
  std::vector<vllm_ascend::kv_offload::CopyRegion> regions(n);
  for (size_t i = 0; i < n; ++i) {
    regions[i] = {src[i], dst[i], sizes[i], first_fragment[i]};
  }
  const size_t bytes = workspace_bytes < 0
                           ? copier()->workspace_bytes(n, per_copy != 0)
                           : static_cast<size_t>(workspace_bytes);
  // operator new[] is aligned to max_align_t, as the core requires.
  std::unique_ptr<unsigned char[]> workspace(new unsigned char[bytes + 1]);
  const int rc = run_core(
      [&] {
        const auto r = copier()->copy(regions, stream,
                                      bytes == 0 ? nullptr : workspace.get(),
                                      bytes, per_copy != 0);
        report->direction =
            r.direction == npu::CopyDirection::kHostToDevice ? 0 : 1;
        report->fallback_started = r.fallback_started ? 1 : 0;
        report->batch_calls = r.batch_calls;
        report->single_calls = r.single_calls;
        report->workspace_bytes = bytes;
      },
      err, err_len);
  // Freeing is modelled as poisoning (plus the real free at the next sync),
  // so that the simulation reads defined, recognisably wrong contents. The
  // op's workspace tensor is freed as an exception leaves it.
  if (free_workspace_at_return || rc != 0) {
    std::memset(workspace.get(), kPoison, bytes);
  }
  std::lock_guard<std::mutex> lock(g_mu);
  g_workspaces.push_back(std::move(workspace));
  return rc;
}

int simacl_core_sync(void* stream) {
  const aclError rc = aclrtSynchronizeStream(stream);
  std::lock_guard<std::mutex> lock(g_mu);
  g_workspaces.clear();
  return rc;
}

void simacl_core_reset(void) {
  copier() = std::make_unique<npu::AclBatchCopier>();
  std::lock_guard<std::mutex> lock(g_mu);
  g_workspaces.clear();
}

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
